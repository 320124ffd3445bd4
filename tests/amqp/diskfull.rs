//! Issue 3 point 6: a disk that really fills up. The real binary runs on a small tmpfs (needs
//! root to mount it, as the test command runs; set WARREN_SKIP_MOUNT_TESTS=1 to skip on a
//! machine without). With the disk alarm off, publishes that cannot be stored are nacked, the
//! broker stays up and answers other clients, takes publishes again once space returns, and
//! after a restart holds every message it confirmed.

use crate::common::{spawn_binary, Binary, WAIT};
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

async fn spawn(data: &Path) -> (Binary, String) {
    let b = spawn_binary(data, &["--disk-free-limit", "0"]).await;
    let url = b.url.clone();
    (b, url)
}

/// Bodies that do not compress: id, then pseudo-random bytes.
fn body(id: u64) -> Vec<u8> {
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut b = id.to_be_bytes().to_vec();
    b.extend((0..1016).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    }));
    b
}

/// Publish `ids` persistently with confirms (window 200); returns (acked, nacked).
async fn publish(ch: &lapin::Channel, ids: std::ops::Range<u64>) -> (BTreeSet<u64>, BTreeSet<u64>) {
    let (mut acked, mut nacked) = (BTreeSet::new(), BTreeSet::new());
    let mut pending = std::collections::VecDeque::new();
    let props = BasicProperties::default().with_delivery_mode(2);
    for id in ids {
        let c = ch
            .basic_publish(
                "".into(),
                "full".into(),
                BasicPublishOptions::default(),
                &body(id),
                props.clone(),
            )
            .await
            .unwrap();
        pending.push_back((id, c));
        while pending.len() > 200 || (id % 1000 == 0 && !pending.is_empty()) {
            let (id, c): (u64, lapin::PublisherConfirm) = pending.pop_front().unwrap();
            if tokio::time::timeout(WAIT, c)
                .await
                .unwrap()
                .unwrap()
                .is_ack()
            {
                acked.insert(id);
            } else {
                nacked.insert(id);
            }
        }
        if !nacked.is_empty() && pending.is_empty() {
            break;
        }
    }
    for (id, c) in pending {
        if tokio::time::timeout(WAIT, c)
            .await
            .unwrap()
            .unwrap()
            .is_ack()
        {
            acked.insert(id);
        } else {
            nacked.insert(id);
        }
    }
    (acked, nacked)
}

async fn confirming(url: &str) -> (Connection, lapin::Channel) {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.queue_declare(
        "full".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    (conn, ch)
}

#[tokio::test]
async fn a_full_disk_nacks_publishes_and_the_broker_recovers_when_space_returns() {
    if std::env::var_os("WARREN_SKIP_MOUNT_TESTS").is_some() {
        eprintln!("skipped: WARREN_SKIP_MOUNT_TESTS is set");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=48m", "tmpfs"])
        .arg(dir.path())
        .status()
        .expect("run mount");
    assert!(
        status.success(),
        "mounting a tmpfs needs root (set WARREN_SKIP_MOUNT_TESTS=1 to skip this test)"
    );
    let _mount = Mount(dir.path().to_path_buf());
    // Space to give back later.
    let filler = dir.path().join("filler");
    std::fs::write(&filler, vec![0u8; 16 << 20]).unwrap();
    let data = dir.path().join("data");
    let (mut broker, url) = spawn(&data).await;

    let (conn, ch) = confirming(&url).await;
    let (mut acked, nacked) = publish(&ch, 0..100_000).await;
    assert!(!nacked.is_empty(), "the disk never filled");
    assert!(acked.len() > 1000, "only {} confirmed", acked.len());
    // The broker is up and other clients carry on.
    {
        let other = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let och = other.create_channel().await.unwrap();
        let q = och
            .queue_declare(
                "full".into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        assert!(q.message_count() as usize >= acked.len());
        other.close(200, "bye".into()).await.unwrap();
    }
    // Space comes back: publishes are confirmed again (the store resumes on its own).
    std::fs::remove_file(&filler).unwrap();
    let mut next = 200_000;
    let deadline = tokio::time::Instant::now() + WAIT * 3;
    loop {
        let (a, n) = publish(&ch, next..next + 200).await;
        next += 200;
        acked.extend(a);
        if n.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "publishes still nacked after space returned"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = conn.close(200, "bye".into()).await;

    // Restart: every confirmed message is there.
    let _ = Command::new("kill")
        .args(["-TERM", &broker.child.id().to_string()])
        .status();
    let _ = broker.child.wait();
    let (mut broker, url) = spawn(&data).await;
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut got = BTreeSet::new();
    while let Some(m) = ch
        .basic_get("full".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got.insert(u64::from_be_bytes(m.delivery.data[..8].try_into().unwrap()));
    }
    let missing: Vec<_> = acked.difference(&got).take(10).collect();
    assert!(
        missing.is_empty(),
        "{} confirmed messages lost, e.g. {missing:?}",
        acked.difference(&got).count()
    );
    let _ = broker.child.kill();
    let _ = broker.child.wait();
}

//! Issue 3 point 3: SIGKILL at random moments loses no confirmed message. Runs the real
//! `warren` binary, bounded in rounds and time.

use crate::common::{spawn_binary, Binary, WAIT};
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

async fn spawn(data: &Path) -> Binary {
    spawn_binary(data, &[]).await
}

async fn channel(url: &str) -> (Connection, lapin::Channel) {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.queue_declare(
        "crash".into(),
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

/// Publish ids from `*next` on, with up to `window` unconfirmed, until `stop` fires or an error;
/// returns the ids confirmed.
async fn publish_until(
    ch: &lapin::Channel,
    next: &mut u64,
    window: usize,
    stop: tokio::time::Instant,
) -> (BTreeSet<u64>, VecDeque<(u64, lapin::PublisherConfirm)>) {
    let mut confirmed = BTreeSet::new();
    let mut pending = VecDeque::new();
    let props = BasicProperties::default().with_delivery_mode(2);
    while tokio::time::Instant::now() < stop {
        if pending.len() >= window {
            let (id, c): (u64, lapin::PublisherConfirm) = pending.pop_front().unwrap();
            match tokio::time::timeout(WAIT, c).await {
                Ok(Ok(conf)) if conf.is_ack() => {
                    confirmed.insert(id);
                }
                _ => return (confirmed, pending),
            }
        }
        let id = *next;
        match ch
            .basic_publish(
                "".into(),
                "crash".into(),
                Default::default(),
                &id.to_be_bytes(),
                props.clone(),
            )
            .await
        {
            Ok(c) => {
                *next += 1;
                pending.push_back((id, c));
            }
            Err(_) => return (confirmed, pending),
        }
    }
    (confirmed, pending)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_loses_no_confirmed_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut confirmed: BTreeSet<u64> = BTreeSet::new();
    let mut next = 0u64;
    for round in 0..4 {
        let mut broker = spawn(dir.path()).await;
        let (_conn, ch) = channel(&broker.url).await;
        let run_for = Duration::from_millis(rand::random_range(200..700));
        let killer = tokio::spawn(async move {
            tokio::time::sleep(run_for).await;
            broker.child.kill().unwrap();
            broker.child.wait().unwrap();
        });
        let stop = tokio::time::Instant::now() + Duration::from_secs(5);
        let (got, pending) = publish_until(&ch, &mut next, 256, stop).await;
        confirmed.extend(got);
        killer.await.unwrap();
        // Confirms that arrived just before the kill count too.
        for (id, c) in pending {
            if let Ok(Ok(conf)) = tokio::time::timeout(Duration::from_millis(200), c).await {
                if conf.is_ack() {
                    confirmed.insert(id);
                }
            }
        }
        eprintln!(
            "round {round}: published {next}, confirmed {}",
            confirmed.len()
        );
    }
    // A clean shutdown in the middle, too.
    let mut broker = spawn(dir.path()).await;
    let (conn, ch) = channel(&broker.url).await;
    let stop = tokio::time::Instant::now() + Duration::from_millis(300);
    let (got, pending) = publish_until(&ch, &mut next, 256, stop).await;
    confirmed.extend(got);
    for (id, c) in pending {
        if c.await.unwrap().is_ack() {
            confirmed.insert(id);
        }
    }
    conn.close(200, "bye".into()).await.unwrap();
    Command::new("kill")
        .args(["-TERM", &broker.child.id().to_string()])
        .status()
        .unwrap();
    assert!(
        broker.child.wait().unwrap().success(),
        "clean exit on SIGTERM"
    );

    // Drain everything and check.
    let mut broker = spawn(dir.path()).await;
    let (_conn, ch) = channel(&broker.url).await;
    let mut seen: BTreeMap<u64, u32> = BTreeMap::new();
    while let Some(m) = ch
        .basic_get("crash".into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let id = u64::from_be_bytes(m.delivery.data[..8].try_into().unwrap());
        *seen.entry(id).or_default() += 1;
    }
    broker.child.kill().unwrap();
    let _ = broker.child.wait();
    let lost: Vec<u64> = confirmed
        .iter()
        .filter(|id| !seen.contains_key(id))
        .copied()
        .collect();
    let unknown: Vec<u64> = seen.keys().filter(|id| **id >= next).copied().collect();
    let duplicates: u32 = seen.values().map(|n| n - 1).sum();
    eprintln!(
        "published {next}, confirmed {}, recovered {}, duplicates {duplicates}",
        confirmed.len(),
        seen.len()
    );
    assert!(
        confirmed.len() > 100,
        "the test published too little to mean anything"
    );
    assert!(
        lost.is_empty(),
        "confirmed but lost: {} ids, first {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(unknown.is_empty(), "never published: {unknown:?}");
}

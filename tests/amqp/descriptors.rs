//! Hardening issue point 4: table files must not pile up (each was an open descriptor, and at
//! the descriptor limit persistence stopped until a restart), and a store stopped by a failed
//! write must come back once the cause is gone, without a restart. Runs the real binary under a
//! low `ulimit -n` (util-linux's `prlimit`; lowering a limit needs no privilege, changing another
//! process's does, and the test command runs as root).

use crate::common::{spawn_binary_wrapped, stop_binary, Binary, WAIT};
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::VecDeque;
use std::path::Path;
use std::time::Duration;

/// A full frame's body (frame_max 131072 less the frame overhead): zeros, which compress to
/// almost nothing, so each memtable flush is a tiny table file (the case that piled up).
const BODY: usize = 131_064;

async fn spawn_limited(data: &Path, nofile: u64) -> Binary {
    // prlimit execs the broker in place: the limit is there before the store opens.
    let limit = format!("--nofile={nofile}:{nofile}");
    spawn_binary_wrapped(data, &[], &["prlimit", &limit, "--"], |_| {}).await
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn table_files(data: &Path) -> usize {
    std::fs::read_dir(data.join("store"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
        .count()
}

async fn confirming(url: &str, queue: &str) -> (Connection, lapin::Channel) {
    let conn = tokio::time::timeout(
        WAIT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .expect("connect timed out")
    .expect("connect");
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    ch.queue_declare(
        queue.into(),
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

/// Publish persistent messages with up to 64 unconfirmed until `stop`; returns (acked, nacked).
async fn flood(ch: lapin::Channel, queue: String, stop: tokio::time::Instant) -> (u64, u64) {
    let body = vec![0u8; BODY];
    let props = BasicProperties::default().with_delivery_mode(2);
    let mut pending = VecDeque::new();
    let (mut acked, mut nacked) = (0, 0);
    let mut settle = |c: lapin::Confirmation| {
        if c.is_ack() {
            acked += 1
        } else {
            nacked += 1
        }
    };
    while tokio::time::Instant::now() < stop {
        let c = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                Default::default(),
                &body,
                props.clone(),
            )
            .await
            .unwrap();
        pending.push_back(c);
        if pending.len() >= 64 {
            let c = pending.pop_front().unwrap();
            settle(tokio::time::timeout(WAIT, c).await.unwrap().unwrap());
        }
    }
    for c in pending {
        settle(tokio::time::timeout(WAIT, c).await.unwrap().unwrap());
    }
    (acked, nacked)
}

async fn message_count(url: &str, queue: &str) -> u32 {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    q.message_count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_flood_under_a_low_descriptor_limit_keeps_files_bounded_and_confirms() {
    const LIMIT: u64 = 256;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let mut b = spawn_limited(data, LIMIT).await;
    let pid = b.child.id();
    // The queues are flooded in turn, 5 s each: while one queue takes everything, each flushed
    // memtable is a file whose key range no other file touches, the case that piled up (with
    // all three at once every file spans all three, and level compaction merges them).
    let queues = ["fd-a", "fd-b", "fd-c"];
    let mut conns = Vec::new();
    let mut acked = Vec::new();
    let (mut max_fds, mut max_files) = (0, 0);
    for q in queues {
        let (conn, ch) = confirming(&b.url, q).await;
        conns.push(conn);
        let stop = tokio::time::Instant::now() + Duration::from_secs(5);
        let publisher = tokio::spawn(flood(ch, q.to_string(), stop));
        while tokio::time::Instant::now() < stop {
            max_fds = max_fds.max(open_fds(pid));
            max_files = max_files.max(table_files(data));
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let (a, n) = publisher.await.unwrap();
        assert_eq!(n, 0, "publishes to {q} nacked during the flood");
        acked.push(a);
    }
    let files_at_end = table_files(data);
    eprintln!(
        "flood: {acked:?} confirmed ({} MiB), at most {max_fds} descriptors (limit {LIMIT}), at most {max_files} table files, {files_at_end} at the end",
        (acked.iter().sum::<u64>() * BODY as u64) >> 20
    );
    assert!(
        acked.iter().all(|a| *a > 100),
        "too little published to mean anything"
    );
    assert!(
        max_fds < (LIMIT as usize) * 3 / 4,
        "{max_fds} descriptors open under a limit of {LIMIT}"
    );
    // Runs of small files are merged twice a second: a flood leaves a few dozen, not one per
    // flush (without that, 25 a second here: 375 over the flood). Measured 56 and, once with
    // the machine busy, over 64: the bound leaves room for that.
    assert!(max_files <= 100, "{max_files} table files");
    // A new client gets in and a durable declaration is stored.
    {
        let (conn, _ch) = confirming(&b.url, "fd-new").await;
        conn.close(200, "bye".into()).await.unwrap();
    }
    for c in conns {
        let _ = c.close(200, "bye".into()).await;
    }
    // Every confirmed message is there after a restart (under the same limit).
    stop_binary(&mut b);
    let mut b = spawn_limited(data, LIMIT).await;
    for (q, a) in queues.iter().zip(&acked) {
        assert_eq!(message_count(&b.url, q).await as u64, *a, "queue {q}");
    }
    assert_eq!(message_count(&b.url, "fd-new").await, 0);
    stop_binary(&mut b);
}

/// Lower the running broker's descriptor limit to what it has open: the store's next new
/// file (a log, a flushed table) fails with EMFILE, which RocksDB does not resume from, and
/// publishes are nacked. Once the limit is back, publishes are confirmed again without a
/// restart, and everything confirmed is there after one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_stopped_by_a_failed_write_takes_writes_again_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let mut b = spawn_limited(data, 1024).await;
    let pid = b.child.id();
    let (conn, ch) = confirming(&b.url, "stopped").await;
    // Connected before the limit drops (a new socket could not be accepted under it).
    let declarer = lapin::Connection::connect(&b.url, Default::default())
        .await
        .unwrap();
    let dch = declarer.create_channel().await.unwrap();
    let prlimit = |soft: usize| {
        let status = std::process::Command::new("prlimit")
            .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:1024")])
            .status()
            .expect("run prlimit");
        assert!(status.success(), "prlimit failed");
    };
    let mut acked = 0u64;
    // Healthy first.
    let (a, n) = flood(
        ch.clone(),
        "stopped".into(),
        tokio::time::Instant::now() + Duration::from_millis(500),
    )
    .await;
    assert!(a > 0 && n == 0);
    acked += a;
    prlimit(open_fds(pid));
    // Memtables fill and need a new log and table files: the store stops.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (a, n) = flood(
            ch.clone(),
            "stopped".into(),
            tokio::time::Instant::now() + Duration::from_millis(500),
        )
        .await;
        acked += a;
        if n > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store never failed a write at the limit"
        );
    }
    // Still failing a while later: the cause is still there.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (a, n) = flood(
        ch.clone(),
        "stopped".into(),
        tokio::time::Instant::now() + Duration::from_millis(300),
    )
    .await;
    assert!(n > 0, "confirmed at the limit ({a} acks)?");
    acked += a;
    // A durable declare that cannot be stored gets no declare-ok, but a connection.close 541
    // (it used to lose the socket without a frame).
    let refused = dch
        .queue_declare(
            "never-stored".into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .expect_err("declare-ok for a declaration the store did not write");
    assert_eq!(crate::common::reply_code(&refused), Some(541), "{refused}");
    // The cause goes: confirmed again, same process.
    prlimit(1024);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (a, n) = flood(
            ch.clone(),
            "stopped".into(),
            tokio::time::Instant::now() + Duration::from_millis(500),
        )
        .await;
        acked += a;
        if n == 0 && a > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "publishes still nacked 20 s after the limit was raised"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        b.child.try_wait().unwrap().is_none(),
        "the broker restarted?"
    );
    let _ = conn.close(200, "bye".into()).await;
    stop_binary(&mut b);
    let mut b = spawn_limited(data, 1024).await;
    let count = message_count(&b.url, "stopped").await as u64;
    assert!(
        count >= acked,
        "{count} messages after the restart, {acked} were confirmed"
    );
    stop_binary(&mut b);
}

/// Whether the broker at `port` answers a protocol header (accepted) or closes the socket.
async fn answers(port: u16) -> Option<tokio::net::TcpStream> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(b"AMQP\x00\x00\x09\x01").await.ok()?;
    let mut buf = [0u8; 7];
    match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => Some(s),
        _ => None,
    }
}

/// Client sockets cannot take the descriptors the store needs: past the budget (the limit
/// less the store's files and the broker's own) a new connection is closed at once, and
/// persistent publishes on a connection already in go on being confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_descriptor_budget_are_refused_and_the_store_keeps_working() {
    const LIMIT: u64 = 160;
    let dir = tempfile::tempdir().unwrap();
    let mut b = spawn_limited(dir.path(), LIMIT).await;
    let port = b.addr().port();
    let (conn, ch) = confirming(&b.url, "budget").await;
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..LIMIT {
        match answers(port).await {
            Some(s) => held.push(s),
            None => refused += 1,
        }
    }
    eprintln!(
        "under ulimit -n {LIMIT}: {} more connections accepted, {refused} refused, {} descriptors open",
        held.len(),
        open_fds(b.child.id())
    );
    assert!(
        refused > 0,
        "every connection accepted under a limit of {LIMIT}"
    );
    assert!(held.len() >= 20, "only {} connections accepted", held.len());
    // Memtable flushes need new files: the store still gets them.
    let stop = tokio::time::Instant::now() + Duration::from_secs(3);
    let (a, n) = flood(ch, "budget".into(), stop).await;
    assert!(
        a > 100 && n == 0,
        "{a} confirmed, {n} nacked with every socket taken"
    );
    drop(held);
    let _ = conn.close(200, "bye".into()).await;
    stop_binary(&mut b);
}

//! Hardening issue point 3: a damaged store is refused, not half-loaded. Runs the real binary on
//! a store holding 300 confirmed persistent messages, damages one of its files the way a disk
//! or an operator can (a flipped bit in the log, the log cut short or deleted, a flipped byte in
//! a table file's data block, the MANIFEST deleted), and checks that the broker exits non-zero
//! naming the damage and the `--recover-damaged` flag, with every file left as it was; that
//! with the flag it starts, keeps a copy of the damaged store and logs what was lost; and that
//! a torn tail (what a crash mid-append leaves) is not damage.

use crate::common::{run_binary_to_exit, spawn_binary, spawn_binary_with, stop_binary, WAIT};
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const MESSAGES: u64 = 300;
const QUEUE: &str = "kept";

/// Bodies that do not compress: id, then pseudo-random bytes.
fn body(id: u64) -> Vec<u8> {
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut b = id.to_be_bytes().to_vec();
    b.extend((0..200).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    }));
    b
}

async fn channel(url: &str) -> (Connection, lapin::Channel) {
    let conn = tokio::time::timeout(
        WAIT,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .unwrap()
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

/// A stopped broker's store holding `MESSAGES` confirmed persistent messages in a durable
/// queue, each its own write (one log record each, so a damaged record costs few messages).
async fn fill(data: &Path) {
    let mut b = spawn_binary(data, &[]).await;
    let (conn, ch) = channel(&b.url).await;
    ch.confirm_select(Default::default()).await.unwrap();
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let props = BasicProperties::default().with_delivery_mode(2);
    for id in 0..MESSAGES {
        let confirm = ch
            .basic_publish(
                "".into(),
                QUEUE.into(),
                Default::default(),
                &body(id),
                props.clone(),
            )
            .await
            .unwrap();
        let c = tokio::time::timeout(WAIT, confirm).await.unwrap().unwrap();
        assert!(c.is_ack(), "message {id} not confirmed");
    }
    conn.close(200, "bye".into()).await.unwrap();
    stop_binary(&mut b);
}

/// The ids in the queue (drained), or None if the queue is not there.
async fn drain(url: &str) -> Option<BTreeSet<u64>> {
    let (_conn, ch) = channel(url).await;
    ch.queue_declare(
        QUEUE.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .ok()?;
    let mut ids = BTreeSet::new();
    while let Some(m) = ch
        .basic_get(QUEUE.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        assert_eq!(
            m.delivery.data,
            body(u64::from_be_bytes(m.delivery.data[..8].try_into().unwrap()))
        );
        ids.insert(u64::from_be_bytes(m.delivery.data[..8].try_into().unwrap()));
    }
    Some(ids)
}

fn store(data: &Path) -> PathBuf {
    data.join("store")
}

/// The store's files whose names end with `ext`, largest first.
fn files(data: &Path, ext: &str) -> Vec<PathBuf> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(store(data))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(ext))
        .map(|e| (e.metadata().unwrap().len(), e.path()))
        .collect();
    found.sort();
    found.into_iter().rev().map(|(_, p)| p).collect()
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().to_string()
}

/// The store's files that hold data (table files, and logs that are not empty), with their
/// bytes: a refused start must leave them all as they were. (A start that gets as far as the
/// scan, which finds a damaged table file, has already moved the previous run's log into a
/// table file and started a new MANIFEST: that discards nothing.)
fn snapshot(data: &Path) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> = std::fs::read_dir(store(data))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let n = name(p);
            n.ends_with(".sst") || (n.ends_with(".log") && std::fs::metadata(p).unwrap().len() > 0)
        })
        .map(|p| (name(&p), std::fs::read(&p).unwrap()))
        .collect();
    all.sort();
    all
}

/// The broker refuses the store: non-zero exit, an error naming the damage (`names`, each
/// somewhere in stderr) and the way out, and no file touched.
fn assert_refused(data: &Path, names: &[&str]) {
    let before = snapshot(data);
    let (status, stderr) = run_binary_to_exit(data, &[]);
    assert!(!status.success(), "started on a damaged store: {stderr}");
    assert!(stderr.contains("is damaged"), "{stderr}");
    assert!(stderr.contains("--recover-damaged"), "{stderr}");
    for n in names {
        assert!(
            stderr.contains(n),
            "the error does not name {n:?}: {stderr}"
        );
    }
    let after = snapshot(data);
    for (file, bytes) in &before {
        assert!(
            after.iter().any(|(f, b)| f == file && b == bytes),
            "a refused start changed or removed {file}"
        );
    }
}

/// Start with `--recover-damaged`; returns the broker, its log so far (once it listens), and
/// the folder the damaged store was copied to.
async fn salvage(data: &Path) -> (crate::common::Binary, String, PathBuf) {
    let log = data.join("salvage.log");
    let b = spawn_binary_with(data, &["--recover-damaged"], |c| {
        c.env("WARREN_LOG", "warn")
            .stderr(std::fs::File::create(&log).unwrap());
    })
    .await;
    // The port is bound before the store opens: wait for the salvage's last word.
    let deadline = std::time::Instant::now() + WAIT * 4;
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("started from a salvaged store") {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no salvage report: {text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let copies: Vec<PathBuf> = std::fs::read_dir(data)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| name(p).starts_with("damaged-"))
        .collect();
    assert_eq!(copies.len(), 1, "one copy of the damaged store: {copies:?}");
    assert!(text.contains("copied the damaged store aside"), "{text}");
    eprintln!("--- salvage log ---\n{text}---");
    (b, text, copies[0].clone())
}

/// After a salvage the store is sound: a plain restart takes it.
async fn restarts_cleanly(data: &Path, mut b: crate::common::Binary) -> Option<BTreeSet<u64>> {
    stop_binary(&mut b);
    let mut b = spawn_binary(data, &[]).await;
    let ids = drain(&b.url).await;
    stop_binary(&mut b);
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_the_log_is_refused_and_salvaged_with_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    let log = files(data, ".log")[0].clone();
    let mut bytes = std::fs::read(&log).unwrap();
    // Inside the payload of the record nearest the middle (not its length field).
    let at = records(&bytes)
        .into_iter()
        .find(|(start, len)| start + len >= bytes.len() / 2 && *len > 100)
        .map(|(start, _)| start + 40)
        .unwrap();
    bytes[at] ^= 0x10;
    std::fs::write(&log, &bytes).unwrap();
    assert_refused(data, &[&name(&log), "checksum mismatch"]);

    let (b, text, copy) = salvage(data).await;
    assert_eq!(
        std::fs::read(copy.join(name(&log))).unwrap(),
        bytes,
        "the copy holds the damaged log as it was"
    );
    // RocksDB's account: which log, how many bytes dropped; then what is left, queue by queue.
    assert!(text.contains("dropping"), "{text}");
    assert!(
        text.contains(&format!(
            "Log #{}",
            name(&log).trim_end_matches(".log").trim_start_matches('0')
        )),
        "{text}"
    );
    assert!(text.contains("recovered"), "{text}");
    let ids = drain(&b.url)
        .await
        .expect("the queue's definition is before the damage");
    assert!(ids.len() < MESSAGES as usize, "nothing lost? {}", ids.len());
    assert!(ids.len() >= 100, "only {} messages kept", ids.len());
    eprintln!(
        "bit flip at {at} of {}: kept {} of {MESSAGES}",
        bytes.len(),
        ids.len()
    );
    // Drained above: empty after the restart, and no refusal.
    assert_eq!(restarts_cleanly(data, b).await, Some(BTreeSet::new()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_cut_short_is_refused_and_salvaged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    let log = files(data, ".log")[0].clone();
    let len = std::fs::metadata(&log).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert_refused(
        data,
        &[&name(&log), "writes confirmed to clients are missing"],
    );

    let (b, text, copy) = salvage(data).await;
    assert_eq!(
        std::fs::metadata(copy.join(name(&log))).unwrap().len(),
        len / 2
    );
    assert!(
        text.contains("lost: confirmed writes not recovered"),
        "{text}"
    );
    let ids = drain(&b.url).await.expect("queue kept");
    assert!(
        ids.len() > 50 && ids.len() < MESSAGES as usize,
        "kept {}",
        ids.len()
    );
    // What is kept is a prefix: the log was cut, nothing in the middle is missing.
    assert_eq!(ids, (0..ids.len() as u64).collect::<BTreeSet<_>>());
    eprintln!(
        "log cut to {} of {len} bytes: kept {} of {MESSAGES}",
        len / 2,
        ids.len()
    );
    restarts_cleanly(data, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_log_is_refused_and_salvaged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    let logs = files(data, ".log");
    for l in &logs {
        std::fs::remove_file(l).unwrap();
    }
    // RocksDB's own check (track_and_verify_wals) says it first.
    assert_refused(data, &["no WAL files"]);

    let (b, text, copy) = salvage(data).await;
    assert!(
        !copy.join(name(&logs[0])).exists(),
        "the copy is of the store as found"
    );
    assert!(
        text.contains("lost: confirmed writes not recovered"),
        "{text}"
    );
    // The queue was declared in the deleted log too: gone, and the log says what was lost.
    assert_eq!(drain(&b.url).await, None);
    restarts_cleanly(data, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_table_file_is_refused_and_salvaged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    // A start flushes the log into a table file.
    let mut b = spawn_binary(data, &[]).await;
    // Serving (the port is bound before the store opens, and SIGTERM waits for that).
    drop(channel(&b.url).await);
    stop_binary(&mut b);
    let table = files(data, ".sst")[0].clone();
    let mut bytes = std::fs::read(&table).unwrap();
    assert!(
        bytes.len() > 20_000,
        "the messages' table file: {} bytes",
        bytes.len()
    );
    // The first data block starts at offset 0.
    for b in &mut bytes[100..108] {
        *b ^= 0xff;
    }
    std::fs::write(&table, &bytes).unwrap();
    assert_refused(data, &[&name(&table), "checksum mismatch"]);

    let (b, text, copy) = salvage(data).await;
    assert_eq!(std::fs::read(copy.join(name(&table))).unwrap(), bytes);
    assert!(
        text.contains("lost: a damaged table file was set aside whole"),
        "{text}"
    );
    assert!(text.contains(&name(&table)), "{text}");
    assert!(
        text.contains("messages of queue 'kept'"),
        "what the file held: {text}"
    );
    // RocksDB's repair drops a table file whole: the messages were all in it; the queue's
    // definition (another file) is kept.
    let ids = drain(&b.url).await.expect("queue kept");
    eprintln!("damaged table file: kept {} of {MESSAGES}", ids.len());
    assert!(ids.len() < MESSAGES as usize);
    restarts_cleanly(data, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_manifest_is_refused_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    let manifests: Vec<PathBuf> = std::fs::read_dir(store(data))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| name(p).starts_with("MANIFEST-"))
        .collect();
    assert!(!manifests.is_empty());
    for m in &manifests {
        std::fs::remove_file(m).unwrap();
    }
    assert_refused(data, &["MANIFEST", "missing"]);

    let (b, text, copy) = salvage(data).await;
    assert!(copy.join("CURRENT").exists());
    assert!(text.contains("Repaired"), "RocksDB's repair report: {text}");
    // Every column family had a table file, so the log's writes all found theirs.
    let ids = drain(&b.url).await.expect("queue rebuilt");
    assert_eq!(ids, (0..MESSAGES).collect::<BTreeSet<_>>());
    restarts_cleanly(data, b).await;
}

/// The records of a RocksDB log: (start, length with header). A log is 32 KiB blocks of
/// records, each with a 7-byte header (checksum, length, type); a block's last < 7 bytes are
/// padding.
fn records(log: &[u8]) -> Vec<(usize, usize)> {
    const BLOCK: usize = 32 * 1024;
    let mut at = 0;
    let mut out = Vec::new();
    while at + 7 <= log.len() {
        if BLOCK - at % BLOCK < 7 {
            at += BLOCK - at % BLOCK;
            continue;
        }
        let len = u16::from_le_bytes([log[at + 4], log[at + 5]]) as usize;
        if log[at + 6] == 0 && len == 0 {
            break;
        }
        out.push((at, 7 + len));
        at += 7 + len;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_not_damage_and_keeps_every_confirmed_message() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    fill(data).await;
    // A crash while appending a write that was never confirmed: the log ends inside a record.
    // Here, the first half of a copy of the last record, appended.
    let log = files(data, ".log")[0].clone();
    let mut bytes = std::fs::read(&log).unwrap();
    let (at, len) = *records(&bytes).last().unwrap();
    assert!(len > 100, "last record at {at}: {len} bytes");
    let torn = bytes[at..at + len / 2].to_vec();
    bytes.extend_from_slice(&torn);
    std::fs::write(&log, &bytes).unwrap();

    let mut b = spawn_binary(data, &[]).await;
    let ids = drain(&b.url).await.expect("queue kept");
    assert_eq!(ids, (0..MESSAGES).collect::<BTreeSet<_>>());
    stop_binary(&mut b);
    let copies = std::fs::read_dir(data)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| name(&e.path()).starts_with("damaged-"))
        .count();
    assert_eq!(copies, 0);
}

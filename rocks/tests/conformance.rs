//! The RocksDB store against the conformance suite of `warren-storage`, and what only a store
//! on disk has to show: space given back, a folder in use or corrupt refused.

#![allow(clippy::unwrap_used)]

use warren_rocks::RocksStore;
use warren_storage::testing::conformance;
use warren_storage::{Store, StoreError};

#[test]
fn rocks_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    conformance(&|| Box::new(RocksStore::open(&path).unwrap()) as Box<dyn Store>);
}

/// Issue 3 point 5: a drained backlog gives its space back (range deletes and compaction),
/// and a body routed to several queues is stored once.
#[test]
fn space_comes_back_after_a_drained_backlog() {
    use bytes::Bytes;
    use warren_storage::Op;
    let dir = tempfile::tempdir().unwrap();
    let s = RocksStore::open(dir.path()).unwrap();
    let declare = |name: &str| Op::DeclareQueue {
        vhost: "/".into(),
        name: name.into(),
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: Bytes::from_static(&[0, 0, 0, 0]),
    };
    s.write(&[declare("a"), declare("b")], true).unwrap();
    // Bodies that do not compress away: a xorshift stream.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_body = move || {
        let v: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        Bytes::from(v)
    };
    let n = 5000u64;
    for chunk in (1..=n).collect::<Vec<_>>().chunks(500) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|id| Op::Enqueue {
                vhost: "/".into(),
                queues: vec![("a".into(), 0), ("b".into(), 0)].into(),
                id: *id,
                timestamp_ms: 0,
                exchange: "".into(),
                routing_key: "".into(),
                properties: Bytes::from_static(&[0, 0]),
                body: next_body().into(),
            })
            .collect();
        s.write(&ops, true).unwrap();
    }
    s.compact();
    let full = s.sst_bytes();
    // Stored once: one copy of 5000 x 4 KiB is 20.5 MB; two would be 41 MB.
    assert_eq!(s.shared_bodies(), n as usize);
    assert!(
        full > 4096 * n && full < 4096 * n * 3 / 2,
        "{full} bytes for {n} bodies of 4 KiB in two queues"
    );
    // Drain: acks from one queue, a purge of the other.
    let keys: Vec<u64> = (1..=n).collect();
    s.write(
        &[Op::Remove {
            vhost: "/".into(),
            queue: "a".into(),
            keys,
            sizes: Vec::new(),
        }],
        true,
    )
    .unwrap();
    assert_eq!(s.shared_bodies(), n as usize);
    s.write(
        &[Op::Purge {
            vhost: "/".into(),
            queue: "b".into(),
        }],
        true,
    )
    .unwrap();
    assert_eq!(s.shared_bodies(), 0);
    s.compact();
    let drained = s.sst_bytes();
    assert!(
        drained < full / 100,
        "disk usage did not fall: {full} bytes full, {drained} drained"
    );
    eprintln!(
        "SST bytes: {full} with the backlog, {drained} after the drain (folder: {})",
        s.disk_usage()
    );
}

#[test]
fn a_folder_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = RocksStore::open(dir.path()).unwrap();
    match RocksStore::open(dir.path()) {
        Err(StoreError::Locked(p)) => assert_eq!(p, dir.path()),
        other => panic!("expected Locked, got {other:?}"),
    }
}

#[test]
fn a_corrupt_folder_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("CURRENT"), b"garbage\n").unwrap();
    let err = RocksStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { .. } | StoreError::Io(_)),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&dir.path().display().to_string()),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("CURRENT")).unwrap(),
        b"garbage\n"
    );
}

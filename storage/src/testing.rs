//! One conformance suite, run against every store implementation (see the tests at the
//! bottom and in `rocks.rs`). `open` must return a handle on the *same* stored data each time
//! (for RocksDB: close and reopen the folder), so the suite checks what survives a reopen.

// A conformance suite reports failure by panicking, like any test.
#![allow(clippy::unwrap_used)]

use crate::op::{BindingDest, Op};
use crate::Store;
use bytes::Bytes;

fn args() -> Bytes {
    Bytes::from_static(&[0, 0, 0, 0])
}

fn queue(name: &str) -> Op {
    Op::DeclareQueue {
        vhost: "/".into(),
        name: name.into(),
        durable: true,
        exclusive: false,
        auto_delete: false,
        arguments: args(),
    }
}

fn enqueue(queues: &[&str], id: u64, body: &str) -> Op {
    Op::Enqueue {
        vhost: "/".into(),
        queues: queues.iter().map(|q| q.to_string()).collect(),
        id,
        timestamp_ms: 1000 + id,
        exchange: "x".into(),
        routing_key: "k".into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body.as_bytes()),
    }
}

/// (queue, id, body) of every recovered message, in recovery order.
fn messages(ops: &[Op]) -> Vec<(String, u64, String)> {
    ops.iter()
        .filter_map(|op| match op {
            Op::Enqueue {
                queues, id, body, ..
            } => Some((
                queues.join(","),
                *id,
                String::from_utf8_lossy(body).into_owned(),
            )),
            _ => None,
        })
        .collect()
}

fn count(ops: &[Op], f: impl Fn(&Op) -> bool) -> usize {
    ops.iter().filter(|o| f(o)).count()
}

/// Run every case. Panics on the first difference.
pub fn conformance(open: &dyn Fn() -> Box<dyn Store>) {
    definitions_survive(open);
    messages_survive_in_order(open);
}

fn definitions_survive(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(
        &[
            Op::DeclareExchange {
                vhost: "/".into(),
                name: "logs".into(),
                kind: "topic".into(),
                durable: true,
                auto_delete: false,
                internal: true,
                arguments: args(),
            },
            queue("d1"),
            queue("d2"),
            Op::Bind {
                vhost: "/".into(),
                source: "logs".into(),
                destination: BindingDest::Queue("d1".into()),
                routing_key: "a.#".into(),
                arguments: args(),
            },
            Op::Bind {
                vhost: "/".into(),
                source: "logs".into(),
                destination: BindingDest::Queue("d2".into()),
                routing_key: "b".into(),
                arguments: args(),
            },
        ],
        true,
    )
    .unwrap();
    drop(s);
    let s = open();
    let ops = s.recover().unwrap();
    assert!(ops.contains(&Op::DeclareExchange {
        vhost: "/".into(),
        name: "logs".into(),
        kind: "topic".into(),
        durable: true,
        auto_delete: false,
        internal: true,
        arguments: args(),
    }));
    assert!(ops.contains(&queue("d1")) && ops.contains(&queue("d2")));
    assert_eq!(count(&ops, |o| matches!(o, Op::Bind { .. })), 2);
    // Definitions come before bindings, bindings before messages.
    let first_bind = ops
        .iter()
        .position(|o| matches!(o, Op::Bind { .. }))
        .unwrap();
    assert!(ops[..first_bind]
        .iter()
        .all(|o| matches!(o, Op::DeclareExchange { .. } | Op::DeclareQueue { .. })));
    // Deleting a queue takes its bindings; unbinding removes one.
    s.write(
        &[
            Op::DeleteQueue {
                vhost: "/".into(),
                name: "d2".into(),
            },
            Op::Unbind {
                vhost: "/".into(),
                source: "logs".into(),
                destination: BindingDest::Queue("d1".into()),
                routing_key: "a.#".into(),
                arguments: args(),
            },
        ],
        true,
    )
    .unwrap();
    drop(s);
    let s = open();
    let ops = s.recover().unwrap();
    assert!(!ops.contains(&queue("d2")));
    assert_eq!(count(&ops, |o| matches!(o, Op::Bind { .. })), 0);
    // Deleting an exchange takes the bindings it is part of.
    s.write(
        &[
            Op::Bind {
                vhost: "/".into(),
                source: "logs".into(),
                destination: BindingDest::Queue("d1".into()),
                routing_key: "z".into(),
                arguments: args(),
            },
            Op::DeleteExchange {
                vhost: "/".into(),
                name: "logs".into(),
            },
            Op::DeleteQueue {
                vhost: "/".into(),
                name: "d1".into(),
            },
        ],
        true,
    )
    .unwrap();
    drop(s);
    let ops = open().recover().unwrap();
    assert!(ops.is_empty(), "{ops:?}");
}

fn messages_survive_in_order(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(&[queue("m1"), queue("m2")], true).unwrap();
    // Ids arrive out of order across writes; recovery is in id order per queue.
    s.write(
        &[enqueue(&["m1", "m2"], 3, "c"), enqueue(&["m1"], 1, "a")],
        true,
    )
    .unwrap();
    s.write(
        &[enqueue(&["m1"], 2, "b"), enqueue(&["nope"], 4, "lost")],
        false,
    )
    .unwrap();
    s.write(
        &[Op::Remove {
            vhost: "/".into(),
            queue: "m1".into(),
            ids: vec![2],
        }],
        true,
    )
    .unwrap();
    drop(s);
    let s = open();
    let ops = s.recover().unwrap();
    let mut m1: Vec<_> = messages(&ops)
        .into_iter()
        .filter(|(q, _, _)| q == "m1")
        .collect();
    assert_eq!(
        m1.drain(..).map(|(_, id, b)| (id, b)).collect::<Vec<_>>(),
        vec![(1, "a".to_string()), (3, "c".to_string())]
    );
    let m2: Vec<_> = messages(&ops)
        .into_iter()
        .filter(|(q, _, _)| q == "m2")
        .collect();
    assert_eq!(m2, vec![("m2".to_string(), 3, "c".to_string())]);
    assert!(ops.iter().any(|o| matches!(
        o,
        Op::Enqueue {
            timestamp_ms: 1003,
            ..
        }
    )));
    // Purge empties one queue; deleting a queue drops its messages; a queue declared again
    // under the same name starts empty.
    s.write(
        &[
            Op::Purge {
                vhost: "/".into(),
                queue: "m1".into(),
            },
            Op::DeleteQueue {
                vhost: "/".into(),
                name: "m2".into(),
            },
            queue("m2"),
        ],
        true,
    )
    .unwrap();
    drop(s);
    let s = open();
    let ops = s.recover().unwrap();
    assert!(messages(&ops).is_empty(), "{:?}", messages(&ops));
    s.write(
        &[
            Op::DeleteQueue {
                vhost: "/".into(),
                name: "m1".into(),
            },
            Op::DeleteQueue {
                vhost: "/".into(),
                name: "m2".into(),
            },
        ],
        true,
    )
    .unwrap();
}

#[cfg(test)]
mod tests {
    use super::conformance;
    use crate::mem::MemStore;
    use crate::rocks::RocksStore;
    use crate::Store;
    use std::sync::Arc;

    #[test]
    fn mem_store_conforms() {
        let m = Arc::new(MemStore::new());
        conformance(&|| Box::new(m.clone()) as Box<dyn Store>);
    }

    #[test]
    fn rocks_store_conforms() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        conformance(&|| Box::new(RocksStore::open(&path).unwrap()) as Box<dyn Store>);
    }

    #[test]
    fn a_folder_in_use_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = RocksStore::open(dir.path()).unwrap();
        match RocksStore::open(dir.path()) {
            Err(crate::StoreError::Locked(p)) => assert_eq!(p, dir.path()),
            other => panic!("expected Locked, got {other:?}"),
        }
    }

    #[test]
    fn a_corrupt_folder_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("CURRENT"), b"garbage\n").unwrap();
        let err = RocksStore::open(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                crate::StoreError::Corrupt { .. } | crate::StoreError::Io(_)
            ),
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
}

//! One conformance suite, run against every store implementation (see the test at the
//! bottom, and `tests/conformance.rs` in `warren-rocks`). `open` must return a handle on the
//! *same* stored data each time (for RocksDB: close and reopen the folder), so the suite
//! checks what survives a reopen.

// A conformance suite reports failure by panicking, like any test.
#![allow(clippy::unwrap_used)]

use crate::op::{BindingDest, Op};
use crate::{message_key, Store};
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
        queues: queues.iter().map(|q| (crate::Name::from(*q), 0)).collect(),
        id,
        timestamp_ms: 1000 + id,
        exchange: "x".into(),
        routing_key: "k".into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body.as_bytes()).into(),
    }
}

/// (key, body) of every message of a queue, read back in pieces of two.
fn messages(s: &dyn Store, queue: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let got = s.read("/", queue, from, u64::MAX, 2, usize::MAX).unwrap();
        let Some(last) = got.last() else {
            return out;
        };
        from = last.key + 1;
        out.extend(got.iter().map(|m| {
            (
                m.key,
                String::from_utf8_lossy(&m.body.to_bytes()).into_owned(),
            )
        }));
    }
}

fn spill(queue: &str, key: u64, body: &str) -> Op {
    Op::Spill {
        vhost: "/".into(),
        queue: queue.into(),
        key,
        timestamp_ms: 5,
        exchange: "".into(),
        routing_key: queue.into(),
        properties: Bytes::from_static(&[0, 0]),
        body: Bytes::copy_from_slice(body.as_bytes()).into(),
    }
}

fn remove(queue: &str, keys: &[u64]) -> Op {
    Op::Remove {
        vhost: "/".into(),
        queue: queue.into(),
        keys: keys.to_vec(),
        sizes: Vec::new(),
    }
}

fn count(ops: &[Op], f: impl Fn(&Op) -> bool) -> usize {
    ops.iter().filter(|o| f(o)).count()
}

/// Run every case. Panics on the first difference.
pub fn conformance(open: &dyn Fn() -> Box<dyn Store>) {
    definitions_survive(open);
    messages_survive_in_order(open);
    levels_spills_and_ranges(open);
    users_survive(open);
    vhosts_survive(open);
    applied_position_survives(open);
    snapshot_rebuilds_what_a_replica_needs(open);
    snapshot_streams_one_moment_in_groups(open);
}

/// `snapshot` gives ops that rebuild the same definitions and stored messages on an empty
/// store, without the spilled transient messages, and changes nothing.
fn snapshot_rebuilds_what_a_replica_needs(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(
        &[
            queue("sa"),
            queue("sb"),
            enqueue(&["sa"], 1, "one"),
            enqueue(&["sa", "sb"], 2, "two"),
            spill("sa", 3, "spilled"),
            remove("sa", &[1]),
        ],
        true,
    )
    .unwrap();
    let ops = s.snapshot().unwrap();
    // Nothing changed by taking it.
    assert_eq!(messages(&*s, "sa").len(), 2);
    let enqueued: Vec<String> = ops
        .iter()
        .filter_map(|op| match op {
            Op::Enqueue { queues, body, .. } if queues[0].0.starts_with('s') => Some(format!(
                "{}:{}",
                queues[0].0,
                String::from_utf8_lossy(&body.to_bytes())
            )),
            _ => None,
        })
        .collect();
    let mut sorted = enqueued.clone();
    sorted.sort();
    assert_eq!(sorted, ["sa:two", "sb:two"]);
    assert!(ops
        .iter()
        .any(|op| matches!(op, Op::DeclareQueue { name, .. } if name == "sb")));
}

/// `snapshot_to` streams in groups, definitions first; what is written once `taken` is called
/// is not in the snapshot; a sink that says stop hears nothing more.
fn snapshot_streams_one_moment_in_groups(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(&[queue("st")], true).unwrap();
    let n = crate::SNAPSHOT_GROUP_OPS as u64 + 10;
    let ops: Vec<Op> = (1..=n).map(|i| enqueue(&["st"], i, "m")).collect();
    s.write(&ops, true).unwrap();

    struct Sink<'a> {
        store: &'a dyn Store,
        taken_before: Option<usize>,
        groups: Vec<Vec<Op>>,
        stop_after: usize,
    }
    impl crate::SnapshotSink for Sink<'_> {
        fn taken(&mut self) {
            self.taken_before = Some(self.groups.len());
            // Written after the moment: not in the snapshot.
            self.store
                .write(&[enqueue(&["st"], 1_000_000, "late"), queue("late")], true)
                .unwrap();
        }
        fn ops(&mut self, ops: Vec<Op>) -> Result<bool, crate::StoreError> {
            assert!(!ops.is_empty(), "an empty group");
            self.groups.push(ops);
            Ok(self.groups.len() < self.stop_after)
        }
    }
    let mut sink = Sink {
        store: &*s,
        taken_before: None,
        groups: Vec::new(),
        stop_after: usize::MAX,
    };
    s.snapshot_to(&mut sink).unwrap();
    assert_eq!(sink.taken_before, Some(0), "taken is called before any ops");
    assert!(sink.groups.len() >= 3, "{} groups", sink.groups.len());
    assert!(sink.groups[0]
        .iter()
        .all(|op| !matches!(op, Op::Enqueue { .. })));
    let all: Vec<&Op> = sink.groups.iter().flatten().collect();
    let ids: Vec<u64> = all
        .iter()
        .filter_map(|op| match op {
            // The store may hold other tests' queues.
            Op::Enqueue { id, queues, .. } if &*queues[0].0 == "st" => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(ids, (1..=n).collect::<Vec<_>>());
    assert!(!all
        .iter()
        .any(|op| matches!(op, Op::DeclareQueue { name, .. } if name == "late")));
    // The late writes happened.
    assert_eq!(messages(&*s, "st").len() as u64, n + 1);

    let mut sink = Sink {
        store: &*s,
        taken_before: None,
        groups: Vec::new(),
        stop_after: 1,
    };
    s.snapshot_to(&mut sink).unwrap();
    assert_eq!(sink.groups.len(), 1);
}

/// `write_applied` keeps the latest position with its ops; a plain write leaves it as it was;
/// the position is not a definition.
fn applied_position_survives(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    assert_eq!(s.applied().unwrap(), None);
    s.write_applied(&[queue("aq")], b"one", false).unwrap();
    s.write_applied(&[enqueue(&["aq"], 1, "m")], b"two", true)
        .unwrap();
    s.write(&[enqueue(&["aq"], 2, "n")], true).unwrap();
    drop(s);
    let s = open();
    assert_eq!(s.applied().unwrap().as_deref(), Some(&b"two"[..]));
    assert_eq!(messages(&*s, "aq").len(), 2);
    // The position is no definition: recovery lists the queue once and nothing else new.
    let ops = s.recover().unwrap().ops;
    assert_eq!(
        count(
            &ops,
            |op| matches!(op, Op::DeclareQueue { name, .. } if name == "aq")
        ),
        1
    );
}

/// Users come back first (before any definition), the latest `PutUser` of a name winning.
fn users_survive(open: &dyn Fn() -> Box<dyn Store>) {
    let user = |name: &str, hash: &str| Op::PutUser {
        name: name.into(),
        password_hash: hash.into(),
        tags: vec!["administrator".into()],
    };
    let s = open();
    s.write(
        &[user("alice", "h1"), queue("uq"), user("alice", "h2")],
        true,
    )
    .unwrap();
    s.write(&[user("bob", "h3")], true).unwrap();
    drop(s);
    let ops = open().recover().unwrap().ops;
    // In no particular order (the stores keep their own).
    let mut users: Vec<String> = ops
        .iter()
        .filter(|op| matches!(op, Op::PutUser { .. }))
        .map(|op| format!("{op:?}"))
        .collect();
    users.sort();
    let expected = [user("alice", "h2"), user("bob", "h3")].map(|op| format!("{op:?}"));
    assert_eq!(users, expected);
    assert!(matches!(ops.first(), Some(Op::PutUser { .. })));
}

/// Vhosts come back before any exchange or queue (a vhost must exist before what is in it),
/// with their latest metadata; a deleted one does not come back. Permissions likewise: the
/// latest, not the cleared.
fn vhosts_survive(open: &dyn Fn() -> Box<dyn Store>) {
    let vhost = |name: &str, description: &str| Op::PutVhost {
        name: name.into(),
        description: description.into(),
        tags: vec!["t".into()],
    };
    let s = open();
    s.write(
        &[
            vhost("shop", "d1"),
            queue("vq"),
            vhost("shop", "d2"),
            vhost("old", ""),
        ],
        true,
    )
    .unwrap();
    let perm = |user: &str, read: &str| Op::SetPermissions {
        user: user.into(),
        vhost: "shop".into(),
        configure: ".*".into(),
        write: "".into(),
        read: read.into(),
    };
    s.write(
        &[
            perm("ann", "^a"),
            perm("ann", "^b"),
            perm("bob", ".*"),
            Op::DeleteVhost { name: "old".into() },
            Op::ClearPermissions {
                user: "bob".into(),
                vhost: "shop".into(),
            },
        ],
        true,
    )
    .unwrap();
    drop(s);
    let ops = open().recover().unwrap().ops;
    let perms: Vec<String> = ops
        .iter()
        .filter(|op| matches!(op, Op::SetPermissions { .. }))
        .map(|op| format!("{op:?}"))
        .collect();
    assert_eq!(perms, [format!("{:?}", perm("ann", "^b"))]);
    // Topic permissions: by exchange; a clear takes one exchange's.
    let s = open();
    let tp = |exchange: &str, write: &str| Op::SetTopicPermissions {
        user: "ann".into(),
        vhost: "shop".into(),
        exchange: exchange.into(),
        write: write.into(),
        read: ".*".into(),
    };
    s.write(
        &[
            tp("t1", "^a"),
            tp("t2", "^b"),
            tp("t1", "^c"),
            Op::ClearTopicPermissions {
                user: "ann".into(),
                vhost: "shop".into(),
                exchange: "t2".into(),
            },
        ],
        true,
    )
    .unwrap();
    drop(s);
    let ops = open().recover().unwrap().ops;
    let topic: Vec<String> = ops
        .iter()
        .filter(|op| matches!(op, Op::SetTopicPermissions { .. }))
        .map(|op| format!("{op:?}"))
        .collect();
    assert_eq!(topic, [format!("{:?}", tp("t1", "^c"))]);
    // Limits: the latest of each; an empty list clears them.
    let s = open();
    let vl = |n: i64| Op::PutVhostLimits {
        vhost: "shop".into(),
        limits: vec![("max-queues".into(), n)],
    };
    let ul = |user: &str, limits: Vec<(String, i64)>| Op::PutUserLimits {
        user: user.into(),
        limits,
    };
    s.write(
        &[
            vl(1),
            vl(-1),
            ul("ann", vec![("max-channels".into(), 2)]),
            ul("bob", vec![("max-connections".into(), 1)]),
            ul("bob", vec![]),
        ],
        true,
    )
    .unwrap();
    drop(s);
    let ops = open().recover().unwrap().ops;
    let limits: Vec<String> = ops
        .iter()
        .filter(|op| matches!(op, Op::PutVhostLimits { .. } | Op::PutUserLimits { .. }))
        .map(|op| format!("{op:?}"))
        .collect();
    assert_eq!(
        limits,
        [
            format!("{:?}", vl(-1)),
            format!("{:?}", ul("ann", vec![("max-channels".into(), 2)]))
        ]
    );
    let vhosts: Vec<String> = ops
        .iter()
        .filter(|op| matches!(op, Op::PutVhost { .. }))
        .map(|op| format!("{op:?}"))
        .collect();
    assert_eq!(vhosts, [format!("{:?}", vhost("shop", "d2"))]);
    let first_definition = ops
        .iter()
        .position(|op| matches!(op, Op::DeclareQueue { .. } | Op::DeclareExchange { .. }));
    let last_vhost = ops.iter().rposition(|op| matches!(op, Op::PutVhost { .. }));
    assert!(last_vhost < first_definition, "{ops:?}");
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
    let ops = s.recover().unwrap().ops;
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
    let ops = s.recover().unwrap().ops;
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
    let ops = open().recover().unwrap().ops;
    assert!(ops.is_empty(), "{ops:?}");
}

fn messages_survive_in_order(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(&[queue("m1"), queue("m2")], true).unwrap();
    // Ids arrive out of order across writes; a queue reads back in id order.
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
    s.write(&[remove("m1", &[2])], true).unwrap();
    drop(s);
    let s = open();
    let rec = s.recover().unwrap();
    assert_eq!(
        messages(&*s, "m1"),
        vec![(1, "a".to_string()), (3, "c".to_string())]
    );
    assert_eq!(messages(&*s, "m2"), vec![(3, "c".to_string())]);
    assert!(messages(&*s, "nope").is_empty());
    let m1 = rec.queues.iter().find(|q| q.name == "m1").unwrap();
    assert_eq!(
        m1.levels,
        vec![crate::LevelSummary {
            level: 0,
            count: 2,
            bytes: 2,
            first: 1,
            last: 3,
            may_expire: false,
        }]
    );
    let got = s.read("/", "m2", 0, u64::MAX, 10, 10).unwrap();
    assert_eq!(got[0].timestamp_ms, 1003);
    assert_eq!(got[0].exchange, "x");
    assert_eq!(got[0].routing_key, "k");
    // The body shared by m1 and m2 outlives its removal from one of them.
    s.write(&[remove("m1", &[3])], true).unwrap();
    assert_eq!(messages(&*s, "m2"), vec![(3, "c".to_string())]);
    drop(s);
    let s = open();
    s.recover().unwrap();
    assert_eq!(messages(&*s, "m2"), vec![(3, "c".to_string())]);
    assert_eq!(messages(&*s, "m1"), vec![(1, "a".to_string())]);
    // Purge empties one queue; deleting a queue drops its messages; a queue declared again
    // under the same name starts empty.
    s.write(
        &[
            enqueue(&["m1", "m2"], 7, "g"),
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
    let rec = s.recover().unwrap();
    assert!(messages(&*s, "m1").is_empty());
    assert!(messages(&*s, "m2").is_empty());
    assert!(rec.queues.iter().all(|q| q.levels.is_empty()), "{rec:?}");
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

/// Priority levels key apart; spilled messages read back live and are gone after a restart,
/// with the storage of queues that were never durable; ranges and read limits.
fn levels_spills_and_ranges(open: &dyn Fn() -> Box<dyn Store>) {
    let s = open();
    s.write(&[queue("p")], true).unwrap();
    s.write(
        &[
            Op::Enqueue {
                vhost: "/".into(),
                queues: vec![("p".into(), 2)].into(),
                id: 1,
                timestamp_ms: 1,
                exchange: "".into(),
                routing_key: "p".into(),
                properties: args(),
                body: Bytes::from_static(b"high").into(),
            },
            enqueue(&["p"], 2, "low"),
            spill("p", 3, "spilled-low"),
            spill("t", 4, "transient-queue"),
            spill("t", 5, "t2"),
        ],
        true,
    )
    .unwrap();
    assert_eq!(
        messages(&*s, "p"),
        vec![
            (2, "low".to_string()),
            (3, "spilled-low".to_string()),
            (message_key(2, 1), "high".to_string())
        ]
    );
    assert_eq!(messages(&*s, "t").len(), 2);
    // Limits: by count, and by bytes (at least one message).
    assert_eq!(s.read("/", "p", 0, u64::MAX, 1, 1000).unwrap().len(), 1);
    assert_eq!(s.read("/", "p", 0, u64::MAX, 100, 1).unwrap().len(), 1);
    assert_eq!(s.read("/", "p", 0, 2, 100, 1000).unwrap().len(), 1);
    // Point reads, in the order asked, None where there is nothing (4 is another queue's).
    let bodies: Vec<Option<String>> = s
        .read_keys("/", "p", &[message_key(2, 1), 4, 3, 2])
        .unwrap()
        .into_iter()
        .map(|m| m.map(|m| String::from_utf8_lossy(&m.body.to_bytes()).into_owned()))
        .collect();
    assert_eq!(
        bodies,
        vec![
            Some("high".to_string()),
            None,
            Some("spilled-low".to_string()),
            Some("low".to_string())
        ]
    );
    // A range within a level.
    s.write(
        &[Op::RemoveRange {
            vhost: "/".into(),
            queue: "t".into(),
            from: 5,
            to: 5,
            counted: None,
        }],
        false,
    )
    .unwrap();
    assert_eq!(messages(&*s, "t"), vec![(4, "transient-queue".to_string())]);
    drop(s);
    let s = open();
    let rec = s.recover().unwrap();
    assert_eq!(
        messages(&*s, "p"),
        vec![
            (2, "low".to_string()),
            (message_key(2, 1), "high".to_string())
        ]
    );
    assert!(messages(&*s, "t").is_empty());
    let p = rec.queues.iter().find(|q| q.name == "p").unwrap();
    assert_eq!(
        p.levels
            .iter()
            .map(|l| (l.level, l.count))
            .collect::<Vec<_>>(),
        vec![(0, 1), (2, 1)]
    );
    assert!(rec.queues.iter().all(|q| q.name != "t"));
    s.write(
        &[Op::DeleteQueue {
            vhost: "/".into(),
            name: "p".into(),
        }],
        true,
    )
    .unwrap();
}

/// The system allocator under a cap that `allocating_at_most` lowers for a while: a test
/// binary makes it its global allocator to check that hostile input is not allocated for.
pub type CappedSystem = cap::Cap<std::alloc::System>;

/// A `CappedSystem` with no cap yet.
pub const fn capped_system() -> CappedSystem {
    cap::Cap::new(std::alloc::System, usize::MAX)
}

/// Run `f` with at most `bytes` more than now allocatable through `alloc` (the test binary's
/// global allocator); one such run at a time. An allocation past the cap fails, and Rust
/// aborts the test binary on it ("memory allocation of N bytes failed"): the test fails.
pub fn allocating_at_most<T>(alloc: &CappedSystem, bytes: usize, f: impl FnOnce() -> T) -> T {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    struct Uncap<'a>(&'a CappedSystem);
    impl Drop for Uncap<'_> {
        fn drop(&mut self) {
            let _ = self.0.set_limit(usize::MAX);
        }
    }
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let _ = alloc.set_limit(alloc.allocated().saturating_add(bytes));
    let _uncap = Uncap(alloc);
    f()
}

#[cfg(test)]
mod tests {
    use super::conformance;
    use crate::mem::MemStore;
    use crate::Store;
    use std::sync::Arc;

    #[test]
    fn mem_store_conforms() {
        let m = Arc::new(MemStore::new());
        conformance(&|| Box::new(m.clone()) as Box<dyn Store>);
    }
}

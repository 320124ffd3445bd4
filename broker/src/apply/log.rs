//! What the core records of its changes. Two streams, both written only by the apply path:
//!
//! - `writes`, the journal: what the local store must do (the committer makes it durable). It
//!   holds every replicated op, the store effects of the cascades `apply` derives from them
//!   (an auto-delete exchange going with its last binding), and local paging (`Op::Spill`).
//! - `ops`, when recording (the cluster's replication stream; tests): the replicated ops
//!   alone, roots only. Applying them in order to another broker gives the same durable
//!   state; a cascade is derived there again, never shipped, and no spill is ever in it.

use crate::queue::{Queue, QueuedMessage};
use crate::Journal;
use warren_storage::Op;

#[derive(Debug, Default)]
pub(crate) struct Log {
    /// Record store writes (off while recovering, and with no store).
    pub(super) enabled: bool,
    /// Store writes not yet handed to the committer (`Broker::take_journal`).
    pub(super) writes: Journal,
    /// Journal batches taken so far (the one being built is `seq + 1`).
    pub(super) seq: u64,
    /// Replicated root ops since the last `Broker::take_ops`, when recording.
    pub(super) ops: Option<Vec<Op>>,
}

impl Log {
    /// Whether store writes are recorded (a store is attached and recovery is over).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Journal batches taken so far.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether store writes are waiting for the batch being built (`seq + 1`): what was
    /// journaled before now is in that batch then, not only in the last one taken.
    pub(crate) fn pending(&self) -> bool {
        !self.writes.is_empty()
    }

    /// Whether replicated ops are recorded (`Broker::record_ops`).
    pub(crate) fn recording(&self) -> bool {
        self.ops.is_some()
    }

    /// A store write (`op` itself, a cascade's effect, or local paging).
    pub(super) fn write(&mut self, op: Op) {
        if self.enabled {
            self.writes.push(op);
        }
    }

    /// A replicated root op.
    pub(super) fn root(&mut self, op: &Op) {
        if let Some(ops) = &mut self.ops {
            ops.push(op.clone());
        }
    }

    /// Both: a replicated op that is also its own store write.
    pub(super) fn root_and_write(&mut self, op: Op) {
        self.root(&op);
        self.write(op);
    }

    /// A message the store holds left queue `q` (acknowledged, delivered or got without an
    /// ack, dropped): a `Remove`, merged into the previous op when that removes from the same
    /// queue (one op per queue for a run of acks). Replicated only for a message whose
    /// enqueue was (`Queue::keeps`): a transient message the store holds was
    /// spilled there by this broker alone, and a replica that paged out takes the removal of
    /// a message it does not have, by its size, from what it holds on disk.
    pub(super) fn removed(&mut self, q: &Queue, qm: &QueuedMessage) {
        let key = q.store_key(qm);
        let size = qm.msg.body.len() as u64;
        if self.enabled && !merge_removal(self.writes.last_mut(), q, key, size) {
            self.writes.push(removal(q, key, size));
        }
        if !q.keeps(&qm.msg) {
            return;
        }
        if let Some(ops) = &mut self.ops {
            if !merge_removal(ops.last_mut(), q, key, size) {
                ops.push(removal(q, key, size));
            }
        }
    }
}

fn removal(q: &Queue, key: u64, size: u64) -> Op {
    Op::Remove {
        vhost: q.vhost.clone(),
        queue: q.name.clone(),
        keys: vec![key],
        sizes: vec![size],
    }
}

fn merge_removal(last: Option<&mut Op>, q: &Queue, key: u64, size: u64) -> bool {
    if let Some(Op::Remove {
        vhost,
        queue,
        keys,
        sizes,
    }) = last
    {
        // Sizes only while every key has one (a purge's removal has none).
        if *vhost == q.vhost && *queue == q.name && sizes.len() == keys.len() {
            keys.push(key);
            sizes.push(size);
            return true;
        }
    }
    false
}

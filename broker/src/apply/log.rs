//! What the core records of its changes. Two streams, both written only by the apply path:
//!
//! - `writes`, the journal: what the local store must do (the committer makes it durable). It
//!   holds every replicated op, the store effects of the cascades `apply` derives from them
//!   (an auto-delete exchange going with its last binding), and local paging (`Op::Spill`).
//! - `ops`, when recording (the cluster's replication stream; tests): the replicated ops
//!   alone, roots only. Applying them in order to another broker gives the same durable
//!   state; a cascade is derived there again, never shipped, and no spill is ever in it.

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

    /// A store write (`op` itself, a cascade's effect, or local paging).
    pub(super) fn write(&mut self, op: Op) {
        if self.enabled {
            self.writes.push(op);
        }
    }

    /// A removal's store write (`Op::Remove`), merged into the previous write when that
    /// removes from the same queue (one write per queue for a run of acks).
    pub(super) fn write_removal(&mut self, op: Op) {
        if self.enabled && !merge_removal(self.writes.last_mut(), &op) {
            self.writes.push(op);
        }
    }

    /// A replicated root op; a removal merged into the previous root as `write_removal` does.
    pub(super) fn root(&mut self, op: &Op) {
        if let Some(ops) = &mut self.ops {
            if !merge_removal(ops.last_mut(), op) {
                ops.push(op.clone());
            }
        }
    }
}

/// Append removal `op` to `last` when both remove from the same queue and both carry every
/// key's size (a purge's removal has none). Two removals in a row from one queue are one.
fn merge_removal(last: Option<&mut Op>, op: &Op) -> bool {
    let (
        Some(Op::Remove {
            vhost,
            queue,
            keys,
            sizes,
        }),
        Op::Remove {
            vhost: v,
            queue: q,
            keys: k,
            sizes: s,
        },
    ) = (last, op)
    else {
        return false;
    };
    if vhost != v || queue != q || sizes.len() != keys.len() || s.len() != k.len() {
        return false;
    }
    keys.extend_from_slice(k);
    sizes.extend_from_slice(s);
    true
}

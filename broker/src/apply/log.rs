//! What the core records of its changes. Two streams, both written only by the apply path:
//!
//! - `writes`, the journal: what the local store must do (the committer makes it durable). It
//!   holds every replicated op, the store effects of the cascades `apply` derives from them
//!   (an auto-delete exchange going with its last binding), and local paging (`Op::Spill`).
//! - `ops`, when recording (the cluster's replication stream; tests): the replicated ops
//!   alone, roots only. Applying them in order to another broker gives the same durable
//!   state; a cascade is derived there again, never shipped, and no spill is ever in it.

use crate::Journal;
use warren_storage::{Name, Op};

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

    /// A removal (`Op::Remove` of `keys` from `queue`, with their `sizes`): its store write,
    /// and with `root` the replicated root too, each merged into the previous one when that
    /// removes from the same queue (one op per queue for a run of acks). No op is built for
    /// a removal that merges.
    pub(super) fn removal(
        &mut self,
        vhost: &Name,
        queue: &Name,
        keys: &[u64],
        sizes: &[u64],
        root: bool,
    ) {
        let op = || Op::Remove {
            vhost: vhost.clone(),
            queue: queue.clone(),
            keys: keys.to_vec(),
            sizes: sizes.to_vec(),
        };
        if self.enabled && !merge_removal(self.writes.last_mut(), vhost, queue, keys, sizes) {
            self.writes.push(op());
        }
        if let (true, Some(ops)) = (root, &mut self.ops) {
            if !merge_removal(ops.last_mut(), vhost, queue, keys, sizes) {
                ops.push(op());
            }
        }
    }

    /// A replicated root op; a removal merged into the previous root as `removal` does.
    pub(super) fn root(&mut self, op: &Op) {
        let Some(ops) = &mut self.ops else {
            return;
        };
        if let Op::Remove {
            vhost,
            queue,
            keys,
            sizes,
        } = op
        {
            if merge_removal(ops.last_mut(), vhost, queue, keys, sizes) {
                return;
            }
        }
        ops.push(op.clone());
    }
}

/// Append the removal of `keys` (with their `sizes`) from `queue` to `last` when that removes
/// from the same queue and both carry every key's size (a purge's removal has none).
fn merge_removal(last: Option<&mut Op>, vhost: &Name, queue: &Name, k: &[u64], s: &[u64]) -> bool {
    let Some(Op::Remove {
        vhost: v,
        queue: q,
        keys,
        sizes,
    }) = last
    else {
        return false;
    };
    if v != vhost || q != queue || sizes.len() != keys.len() || s.len() != k.len() {
        return false;
    }
    keys.extend_from_slice(k);
    sizes.extend_from_slice(s);
    true
}

//! The state machine openraft drives: committed entries go through the broker's one apply and
//! the same store as on a single node.
//!
//! The leader applied its own changes when it made them (that is how AMQP replies and
//! deliveries come out at once); its entries only release the journals waiting for them (the
//! store write, then the confirms and *-ok replies). Every other entry (on followers, on a
//! node replaying its log after a restart, on a node that was leader in an earlier term) is
//! decoded and applied op by op. Either way the store write carries the applied position in
//! the same atomic write (`Store::write_applied`), and `apply` returns only once it is done:
//! the store never holds a change without the position that covers it, nor a position ahead
//! of what it holds.

use super::types::{Entry, LogId, Snapshot, SnapshotData, SnapshotMeta, StorageError};
use super::types::{StoredMembership, TypeConfig};
use super::Replication;
use crate::commit::Part;
use crate::node::Shared;
use openraft::storage::RaftStateMachine;
use openraft::{AnyError, EntryPayload, RaftSnapshotBuilder, StorageIOError};
use std::sync::Arc;
use tracing::{error, warn};

/// What `Store::applied` holds in a cluster node's store: postcard of this.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Applied {
    pub log_id: Option<LogId>,
    pub membership: StoredMembership,
}

pub struct StateMachine {
    shared: Arc<Shared>,
    rep: Arc<Replication>,
    applied: Applied,
}

fn io_err(e: impl std::fmt::Display) -> StorageError {
    StorageIOError::write_state_machine(AnyError::error(e.to_string())).into()
}

impl StateMachine {
    /// The state machine over `shared`'s broker and store, at the position the store holds.
    pub fn new(shared: Arc<Shared>, rep: Arc<Replication>) -> anyhow::Result<Self> {
        let store = shared
            .store
            .clone()
            .ok_or_else(|| anyhow::anyhow!("a cluster node needs a store"))?;
        let applied = match store.applied()? {
            Some(bytes) => postcard::from_bytes(&bytes).map_err(|e| {
                anyhow::anyhow!(
                    "the store's applied position does not decode ({e}): the store is damaged"
                )
            })?,
            None => Applied::default(),
        };
        Ok(StateMachine {
            shared,
            rep,
            applied,
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = NoSnapshots;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.applied.log_id, self.applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let committer = self
            .shared
            .committer
            .as_ref()
            .ok_or_else(|| io_err("a cluster node needs a store"))?;
        let mut n = 0;
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        {
            // The broker lock, then the proposals' (as `BrokerGuard::flush` takes them): a
            // demotion (which takes both) lands between two applies, never inside one.
            let mut broker = self.shared.broker.lock();
            let mut p = self.rep.state.lock();
            let mut parts: Vec<Part> = Vec::new();
            let mut fx = Vec::new();
            for entry in entries {
                n += 1;
                self.applied.log_id = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => {}
                    EntryPayload::Membership(m) => {
                        self.applied.membership = StoredMembership::new(Some(entry.log_id), m);
                    }
                    EntryPayload::Normal(batch) => {
                        let ours = batch.proposer == self.rep.proposer
                            && p.leading == Some(entry.log_id.leader_id);
                        if ours {
                            // Applied already: release the journals it covers.
                            while p.fifo.front().is_some_and(|f| f.ticket <= batch.ticket) {
                                if let Some(part) = p.fifo.pop_front() {
                                    parts.push(part);
                                }
                            }
                            continue;
                        }
                        if p.leading.is_some() {
                            // A leader applies only its own term's entries once it serves.
                            error!(log_id = %entry.log_id, "an entry this leader did not propose; stepping down");
                            p.diverged = true;
                        }
                        let ops = match warren_storage::op_codec::decode_ops(batch.ops.clone()) {
                            Ok(ops) => ops,
                            Err(e) => {
                                // The leader encoded it: a defect or a damaged log, never
                                // client input. Stop rather than diverge.
                                error!(log_id = %entry.log_id, error = %e, "a replicated entry does not decode");
                                return Err(io_err(format!(
                                    "entry {} does not decode: {e}",
                                    entry.log_id
                                )));
                            }
                        };
                        broker.set_clock(batch.clock_ms);
                        for op in &ops {
                            // Deterministic: the leader applied the same op to the same state,
                            // so an error here was an error there too (and changed nothing).
                            if let Err(e) = broker.apply(op, &mut fx) {
                                warn!(log_id = %entry.log_id, error = %e.text, "a replicated op was refused");
                            }
                        }
                        // Nobody is served here: deliveries and wake-ups have no one to reach.
                        fx.clear();
                        let journal = broker.take_journal();
                        if !journal.is_empty() {
                            parts.push(Part {
                                ticket: broker.journal_seq(),
                                ops: journal,
                                notify: None,
                            });
                        }
                    }
                }
            }
            let applied = postcard::to_stdvec(&self.applied).map_err(io_err)?;
            committer.submit_group(parts, applied, done_tx);
        }
        match done_rx.await {
            Ok(true) => Ok(vec![(); n]),
            _ => {
                error!("the store failed to write applied entries; this node stops replicating");
                Err(io_err("the store failed to write applied entries"))
            }
        }
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        NoSnapshots
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
        Ok(Box::new(std::io::Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        _snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError> {
        error!(snapshot = %meta.snapshot_id, "a snapshot was sent, but this version catches up from the log only");
        Err(io_err("snapshots are not installed by this version"))
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        Ok(None)
    }
}

/// The log is never compacted yet (`SnapshotPolicy::Never`, no purge): a node that missed
/// entries replays them from the leader's log, which keeps all of them.
pub struct NoSnapshots;

impl RaftSnapshotBuilder<TypeConfig> for NoSnapshots {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        Err(io_err("snapshots are not built by this version"))
    }
}

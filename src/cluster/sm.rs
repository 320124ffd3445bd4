//! The state machine openraft drives: committed entries go through the broker's one apply and
//! the same store as on a single node.
//!
//! The leader applied its own changes when it made them (that is how AMQP replies and
//! deliveries come out at once); its entries only release the journals waiting for them (the
//! store write, then the confirms and *-ok replies). Every other entry (on followers, on a
//! node replaying its log after a restart, on a node that was leader in an earlier term) is
//! decoded and applied op by op. Either way the store write carries the applied position in
//! the same atomic write (`Store::write_applied`): the store never holds a change without the
//! position that covers it, nor a position ahead of what it holds (after a crash the node
//! applies again from the position its store has). `apply` waits for the previous apply's
//! write, so two are in flight and the committer can merge them.

// openraft's StorageError is what its traits return (224 bytes): not ours to box.
#![allow(clippy::result_large_err)]

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
    /// Where the last snapshot built or installed is kept (`<data-dir>/raft-snapshot`).
    snapshots: std::path::PathBuf,
    /// Snapshots built by this process (their ids stay unique).
    built: u64,
    /// The last apply's store write, not yet known done.
    writing: Option<tokio::sync::oneshot::Receiver<bool>>,
}

/// A snapshot file: postcard of this.
#[derive(serde::Serialize, serde::Deserialize)]
struct SnapshotFile {
    meta: SnapshotMeta,
    data: Vec<u8>,
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
        let snapshots = shared.config.data_dir.join("raft-snapshot");
        std::fs::create_dir_all(&snapshots)?;
        Ok(StateMachine {
            shared,
            rep,
            applied,
            snapshots,
            built: 0,
            writing: None,
        })
    }
}

impl StateMachine {
    /// Wait for an apply's store write.
    async fn written(
        &mut self,
        write: Option<tokio::sync::oneshot::Receiver<bool>>,
    ) -> Result<(), StorageError> {
        match write {
            None => Ok(()),
            Some(rx) => {
                match rx.await {
                    Ok(true) => Ok(()),
                    _ => {
                        error!("the store failed to write applied entries; this node stops replicating");
                        Err(io_err("the store failed to write applied entries"))
                    }
                }
            }
        }
    }

    /// Wait until every applied entry is in the store.
    async fn settle(&mut self) -> Result<(), StorageError> {
        let w = self.writing.take();
        self.written(w).await
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Builder;

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
        // The previous apply's write, not this one's: two writes in flight let the committer
        // merge consecutive entries into one store write (a message stored by one entry and
        // acknowledged by the next is then never written, as on the leader).
        let previous = self.writing.replace(done_rx);
        self.written(previous).await?;
        Ok(vec![(); n])
    }

    /// Runs between two applies: once the last apply's write is done the store holds exactly
    /// the applied entries, so the snapshot is taken here, whole, and the builder only writes
    /// it out.
    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.built += 1;
        let applied = self.applied.clone();
        let settled = self.settle().await;
        let taken = settled.and_then(|()| {
            let store = self
                .shared
                .store
                .as_ref()
                .ok_or_else(|| io_err("a cluster node needs a store"))?;
            let ops = store.snapshot().map_err(io_err)?;
            warren_storage::op_codec::encode_ops(&ops).map_err(io_err)
        });
        let id = format!(
            "{}-{}-{}",
            applied.log_id.map(|l| l.leader_id.term).unwrap_or(0),
            applied.log_id.map(|l| l.index).unwrap_or(0),
            self.built
        );
        Builder {
            meta: SnapshotMeta {
                last_log_id: applied.log_id,
                last_membership: applied.membership,
                snapshot_id: id,
            },
            taken: Some(taken.map(|b| b.to_vec())),
            dir: self.snapshots.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
        Ok(Box::new(std::io::Cursor::new(Vec::new())))
    }

    /// Replace the state with the snapshot's: in one store write, every queue and exchange the
    /// store holds is deleted and the snapshot's ops written, with the snapshot's position;
    /// then the broker is rebuilt from the store (as after a restart).
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError> {
        self.settle().await?;
        let data = snapshot.into_inner();
        let ops = warren_storage::op_codec::decode_ops(bytes::Bytes::from(data.clone())).map_err(
            |e| {
                io_err(format!(
                    "snapshot {} does not decode: {e}",
                    meta.snapshot_id
                ))
            },
        )?;
        let store = self
            .shared
            .store
            .clone()
            .ok_or_else(|| io_err("a cluster node needs a store"))?;
        let committer = self
            .shared
            .committer
            .as_ref()
            .ok_or_else(|| io_err("a cluster node needs a store"))?;
        let applied = Applied {
            log_id: meta.last_log_id,
            membership: meta.last_membership.clone(),
        };
        {
            let mut broker = self.shared.broker.lock();
            if !committer.barrier() {
                return Err(io_err("the store failed a write"));
            }
            let mut write: Vec<warren_storage::Op> = Vec::new();
            for op in store.snapshot().map_err(io_err)? {
                match op {
                    warren_storage::Op::DeclareQueue { vhost, name, .. } => {
                        write.push(warren_storage::Op::DeleteQueue { vhost, name })
                    }
                    warren_storage::Op::DeclareExchange { vhost, name, .. } => {
                        write.push(warren_storage::Op::DeleteExchange { vhost, name })
                    }
                    _ => {}
                }
            }
            write.extend(ops);
            let position = postcard::to_stdvec(&applied).map_err(io_err)?;
            let written = committer.write_group(
                vec![Part {
                    ticket: broker.journal_seq(),
                    ops: write.into_iter().collect(),
                    notify: None,
                }],
                position,
            );
            if written {
                self.shared.rebuild_broker(&mut broker).map_err(|e| {
                    io_err(format!(
                        "rebuilding from snapshot {}: {e}",
                        meta.snapshot_id
                    ))
                })?;
            } else {
                return Err(io_err("the store failed to write a snapshot"));
            }
        }
        self.applied = applied;
        write_snapshot(&self.snapshots, meta, data).map_err(io_err)?;
        tracing::info!(snapshot = %meta.snapshot_id, "installed a snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        let path = self.snapshots.join("current");
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(e)),
        };
        let f: SnapshotFile = postcard::from_bytes(&bytes)
            .map_err(|e| io_err(format!("{} does not decode: {e}", path.display())))?;
        Ok(Some(Snapshot {
            meta: f.meta,
            snapshot: Box::new(std::io::Cursor::new(f.data)),
        }))
    }
}

/// Keep `data` as the current snapshot: written beside, fsynced, renamed over `current`.
fn write_snapshot(
    dir: &std::path::Path,
    meta: &SnapshotMeta,
    data: Vec<u8>,
) -> std::io::Result<()> {
    use std::io::Write;
    let bytes = postcard::to_stdvec(&SnapshotFile {
        meta: meta.clone(),
        data,
    })
    .map_err(std::io::Error::other)?;
    let tmp = dir.join("current.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join("current"))?;
    std::fs::File::open(dir)?.sync_all()
}

/// Writes out the snapshot `get_snapshot_builder` took.
pub struct Builder {
    meta: SnapshotMeta,
    taken: Option<Result<Vec<u8>, StorageError>>,
    dir: std::path::PathBuf,
}

impl RaftSnapshotBuilder<TypeConfig> for Builder {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        let data = self
            .taken
            .take()
            .unwrap_or_else(|| Err(io_err("the snapshot was built already")))?;
        let (dir, meta, copy) = (self.dir.clone(), self.meta.clone(), data.clone());
        tokio::task::spawn_blocking(move || write_snapshot(&dir, &meta, copy))
            .await
            .map_err(io_err)?
            .map_err(io_err)?;
        tracing::info!(snapshot = %self.meta.snapshot_id, bytes = data.len(), "snapshot built");
        Ok(Snapshot {
            meta: self.meta.clone(),
            snapshot: Box::new(std::io::Cursor::new(data)),
        })
    }
}

//! The state machine openraft drives: committed entries go through the broker's one apply and
//! the same store as on a single node.
//!
//! The leader applied its own changes when it made them (that is how AMQP replies and
//! deliveries come out at once); its entries only release the journals waiting for them (the
//! store write, then the confirms and *-ok replies). Every other entry (on followers, on a
//! node replaying its log after a restart, on a node that was leader in an earlier term) is
//! decoded and applied op by op; entries of message ops alone are held up to `DEFER` and
//! applied together, skipping the messages enqueued and acknowledged within them
//! (`Deferred`). Either way the store write carries the applied position in
//! the same atomic write (`Store::write_applied`): the store never holds a change without the
//! position that covers it, nor a position ahead of what it holds (after a crash the node
//! applies again from the position its store has). Confirms and replies go at apply time
//! (committed is what they promise); the store writes trail behind, many in flight, lingering
//! in the committer so that consecutive applies merge (`commit::LINGER`), and a snapshot waits
//! for all of them.
//!
//! Snapshots are files (`snapshot`): built by streaming the store (`Store::snapshot_to`) from
//! one moment between two applies while applies go on, sent and received as files, installed
//! group by group. An install takes several store writes, so it is marked first (`installing`
//! beside the snapshot): a node that stops part way installs the same snapshot again when it
//! starts, before anything else, so it never runs on half of one. The received file is
//! `incoming` until installed and only then `current`: `current` is never ahead of the store
//! (a node restarted with it ahead would tell openraft of a snapshot its state lacks).

// openraft's StorageError is what its traits return (224 bytes): not ours to box.
#![allow(clippy::result_large_err)]

use super::snapshot;
use super::types::{Entry, LogId, Snapshot, SnapshotData, SnapshotMeta, StorageError};
use super::types::{StoredMembership, TypeConfig};
use super::Replication;
use crate::commit::{Done, Part};
use crate::node::Shared;
use openraft::storage::RaftStateMachine;
use openraft::{AnyError, EntryPayload, RaftSnapshotBuilder, StorageIOError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tracing::{error, info, warn};

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
    /// Applies' store writes not yet known done, oldest first. Many may be in flight: the
    /// committer lets a cluster node's writes linger to merge them (`commit::LINGER`).
    writing: std::collections::VecDeque<tokio::sync::oneshot::Receiver<bool>>,
    /// Held while `current` is replaced (a build finishing and an install must not cross).
    files: Arc<parking_lot::Mutex<()>>,
}

/// Applies whose store writes may be in flight at once.
const WRITES_IN_FLIGHT: usize = 1024;

/// How long a follower holds the message ops of the entries it applies before applying them
/// to its broker (`Deferred`).
pub const DEFER: std::time::Duration = std::time::Duration::from_millis(100);

/// Deferred ops, and bytes of the bodies they enqueue, applied at once whatever their age (a
/// bound on the memory they hold).
const DEFER_OPS: usize = 200_000;
const DEFER_BYTES: u64 = 64 << 20;

/// A follower's entries made only of message ops (`Enqueue`, `Remove`), applied to its broker
/// up to `DEFER` later, all at once: a message is enqueued by one entry and its ack removes it
/// a Raft round later, so most messages of the deferred entries are enqueued and removed
/// within them, and those the follower skips altogether (`commit::mark_acked`, as the
/// committer drops them from a store write): the broker never holds them, nothing is written.
/// Applying every message and its removal one by one was a third of a follower's work.
///
/// The entries are applied as far as openraft knows (their apply returned); the broker and
/// the store catch up when the deferred ops are applied: before any entry of another kind
/// (definitions, membership, a barrier: so a node promoted has applied everything), before a
/// snapshot is built or installed, once the oldest is `DEFER` old (at the next apply, or by
/// the node's timer, `flush_deferred`), and at promotion. The store's applied position only
/// ever covers what the store holds: a node that stops with ops deferred applies those entries
/// again from its log when it starts. Under the broker lock (taken first) and the proposals'.
#[derive(Default)]
pub struct Deferred {
    ops: Vec<warren_storage::Op>,
    /// The leader's clock of each op's entry (`Batch::clock_ms`).
    clocks: Vec<u64>,
    /// When the oldest was deferred.
    since: Option<std::time::Instant>,
    /// Body bytes the deferred ops enqueue.
    bytes: u64,
    /// The store position (`Applied`, encoded) after the last deferred entry.
    applied: Vec<u8>,
    scratch: crate::commit::CancelScratch,
}

impl Deferred {
    fn push(&mut self, ops: Vec<warren_storage::Op>, clock_ms: u64, applied: Vec<u8>) {
        self.since.get_or_insert_with(std::time::Instant::now);
        self.clocks.extend(std::iter::repeat_n(clock_ms, ops.len()));
        for op in &ops {
            if let warren_storage::Op::Enqueue { body, .. } = op {
                self.bytes += body.len() as u64;
            }
        }
        self.ops.extend(ops);
        self.applied = applied;
    }

    /// Whether the deferred ops must be applied now.
    pub fn due(&self) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= DEFER)
            || self.ops.len() >= DEFER_OPS
            || self.bytes >= DEFER_BYTES
    }

    /// Apply the deferred ops to `broker` (skipping the messages they enqueue and remove):
    /// the store write that follows (None when nothing was written to it) and the store
    /// position it brings the store to. None if nothing is deferred.
    pub fn apply(&mut self, broker: &mut crate::broker::Broker) -> Option<(Option<Part>, Vec<u8>)> {
        if self.ops.is_empty() {
            return None;
        }
        let skipped = crate::commit::mark_acked(&mut self.ops, &mut self.scratch) > 0;
        let mut fx = Vec::new();
        let mut clock = None;
        for (i, op) in self.ops.drain(..).enumerate() {
            let at = self.clocks.get(i).copied().unwrap_or(0);
            if skipped && self.scratch.cancel.get(i).copied().unwrap_or(false) {
                if let warren_storage::Op::Enqueue { id, .. } = &op {
                    broker.message_id_seen(*id);
                }
                continue;
            }
            if clock != Some(at) {
                broker.set_clock(at);
                clock = Some(at);
            }
            // Deterministic, as in `apply`.
            if let Err(e) = broker.apply(&op, &mut fx) {
                warn!(error = %e.text, "a replicated op was refused");
            }
            // Nobody is served here.
            fx.clear();
        }
        self.clocks.clear();
        self.since = None;
        self.bytes = 0;
        let journal = broker.take_journal();
        let part = (!journal.is_empty()).then(|| Part {
            ticket: broker.journal_seq(),
            ops: journal,
            notify: None,
        });
        Some((part, std::mem::take(&mut self.applied)))
    }
}

/// Apply what is deferred (if anything) before what comes next: its store write joins `parts`.
/// The position it brings the store to is superseded by the entry applied next.
/// `committed` goes up to the journal batch it took (only ever on a node not serving: one
/// serving defers nothing).
fn flush_into(
    broker: &mut crate::broker::Broker,
    deferred: &mut Deferred,
    parts: &mut Vec<Part>,
    committed: &mut u64,
) {
    if let Some((part, _)) = deferred.apply(broker) {
        parts.extend(part);
        *committed = (*committed).max(broker.journal_seq());
    }
}

impl Deferred {
    /// Apply what is deferred (see `apply`) and submit its store write; the receiver of that
    /// write's outcome (None: nothing was deferred).
    pub fn write(
        &mut self,
        broker: &mut crate::broker::Broker,
        committer: &crate::commit::Committer,
    ) -> Option<tokio::sync::oneshot::Receiver<bool>> {
        let (part, at) = self.apply(broker)?;
        let (done, rx) = tokio::sync::oneshot::channel();
        committer.submit_group(part.into_iter().collect(), at, done);
        Some(rx)
    }
}

/// Whether an entry's ops may be deferred (see `Deferred`).
fn deferrable(ops: &[warren_storage::Op]) -> bool {
    !ops.is_empty()
        && ops.iter().all(|op| {
            matches!(
                op,
                warren_storage::Op::Enqueue { .. } | warren_storage::Op::Remove { .. }
            )
        })
}

/// The snapshot this node keeps (and sends), in `<data-dir>/raft-snapshot`.
const CURRENT: &str = "current";
/// Present while an install is part way (see the module doc).
const INSTALLING: &str = "installing";
/// A received snapshot being installed: it becomes `current` once installed, so `current` is
/// never ahead of the store (a node stopped part way installs `incoming` again at start, or
/// `current` if it stopped after the rename).
const INCOMING: &str = "incoming";
/// The files whose presence shows a node holds (or is installing) a snapshot.
pub const SNAPSHOT_FILES: [&str; 3] = [CURRENT, INSTALLING, INCOMING];
/// Prefixes of files being built or received (removed at start: never complete).
pub const BUILDING: &str = "building-";
pub const RECEIVING: &str = "receiving-";

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
        for entry in std::fs::read_dir(&snapshots)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(BUILDING) || name.starts_with(RECEIVING) {
                std::fs::remove_file(entry.path())?;
            }
        }
        let mut sm = StateMachine {
            shared,
            rep,
            applied,
            snapshots,
            built: 0,
            writing: Default::default(),
            files: Default::default(),
        };
        let incoming = sm.snapshots.join(INCOMING);
        if sm.snapshots.join(INSTALLING).exists() {
            // Stopped part way through an install: the store holds part of it. Again, whole.
            warn!("the last snapshot install did not finish: installing it again");
            let current = if incoming.exists() {
                incoming
            } else {
                sm.snapshots.join(CURRENT)
            };
            let meta = sm.install_file(&current).map_err(|e| {
                anyhow::anyhow!(
                    "{} marks an unfinished snapshot install, and installing {} again failed: \
                     {e}; the store holds part of a snapshot (remove this node from the cluster, \
                     wipe its data folder and add it again)",
                    sm.snapshots.join(INSTALLING).display(),
                    current.display()
                )
            })?;
            sm.applied = Applied {
                log_id: meta.last_log_id,
                membership: meta.last_membership.clone(),
            };
        } else if incoming.exists() {
            // Received, never begun: the store is as it was.
            std::fs::remove_file(&incoming)?;
        }
        Ok(sm)
    }

    /// Replace the store's replicated content with the snapshot file at `path` (marked
    /// `installing` until done), then rebuild the broker from the store, and make the file the
    /// current snapshot. Blocking; the caller holds `files`.
    fn install_file(&self, path: &Path) -> Result<SnapshotMeta, StorageError> {
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
        let file = std::fs::File::open(path).map_err(io_err)?;
        let (meta, mut reader) = snapshot::Reader::open(file, path).map_err(io_err)?;
        let marker = self.snapshots.join(INSTALLING);
        std::fs::write(&marker, meta.snapshot_id.as_bytes()).map_err(io_err)?;
        snapshot::sync_dir(&self.snapshots).map_err(io_err)?;
        let position = postcard::to_stdvec(&Applied {
            log_id: meta.last_log_id,
            membership: meta.last_membership.clone(),
        })
        .map_err(io_err)?;
        let mut broker = self.shared.broker.lock();
        if !committer.barrier() {
            return Err(io_err("the store failed a write"));
        }
        // What the store holds goes first: every queue (with its bindings and messages),
        // exchange and user; the snapshot then puts back what it holds.
        let mut pending = Vec::new();
        store
            .snapshot_to(&mut Definitions(&mut pending))
            .map_err(io_err)?;
        let mut groups = 0usize;
        while let Some(group) = reader.group().map_err(io_err)? {
            if !pending.is_empty() {
                store.write(&pending, false).map_err(io_err)?;
            }
            pending = group;
            groups += 1;
        }
        // The last write carries the position and is synced: the ones before it are then on
        // disk too (one log, written in order).
        store
            .write_applied(&pending, &position, true)
            .map_err(io_err)?;
        self.shared.rebuild_broker(&mut broker).map_err(|e| {
            io_err(format!(
                "rebuilding from snapshot {}: {e}",
                meta.snapshot_id
            ))
        })?;
        drop(broker);
        let current = self.snapshots.join(CURRENT);
        if path != current {
            std::fs::rename(path, &current).map_err(io_err)?;
            snapshot::sync_dir(&self.snapshots).map_err(io_err)?;
        }
        std::fs::remove_file(&marker).map_err(io_err)?;
        snapshot::sync_dir(&self.snapshots).map_err(io_err)?;
        info!(snapshot = %meta.snapshot_id, groups, "installed a snapshot");
        Ok(meta)
    }
}

/// Collects the deletions of what a store holds (its first group: the definitions).
struct Definitions<'a>(&'a mut Vec<warren_storage::Op>);

impl warren_storage::SnapshotSink for Definitions<'_> {
    fn taken(&mut self) {}

    fn ops(&mut self, ops: Vec<warren_storage::Op>) -> Result<bool, warren_storage::StoreError> {
        use warren_storage::Op;
        for op in ops {
            match op {
                Op::DeclareQueue { vhost, name, .. } => {
                    self.0.push(Op::DeleteQueue { vhost, name })
                }
                Op::DeclareExchange { vhost, name, .. } => {
                    self.0.push(Op::DeleteExchange { vhost, name })
                }
                // A user deleted since (and so not in the snapshot) must go too.
                Op::PutUser { name, .. } => self.0.push(Op::DeleteUser { name }),
                // Likewise a vhost (its queues and exchanges are deleted above).
                Op::PutVhost { name, .. } => self.0.push(Op::DeleteVhost { name }),
                Op::SetPermissions { user, vhost, .. } => {
                    self.0.push(Op::ClearPermissions { user, vhost })
                }
                Op::PutVhostLimits { vhost, .. } => self.0.push(Op::PutVhostLimits {
                    vhost,
                    limits: Vec::new(),
                }),
                Op::PutUserLimits { user, .. } => self.0.push(Op::PutUserLimits {
                    user,
                    limits: Vec::new(),
                }),
                Op::SetTopicPermissions {
                    user,
                    vhost,
                    exchange,
                    ..
                } => self.0.push(Op::ClearTopicPermissions {
                    user,
                    vhost,
                    exchange,
                }),
                Op::Enqueue { .. } => return Ok(false),
                _ => {}
            }
        }
        Ok(true)
    }
}

/// Streams a store's snapshot into a snapshot file (on a blocking thread).
struct FileSink {
    writer: Option<snapshot::Writer>,
    taken: Option<tokio::sync::oneshot::Sender<()>>,
}

impl warren_storage::SnapshotSink for FileSink {
    fn taken(&mut self) {
        if let Some(t) = self.taken.take() {
            let _ = t.send(());
        }
    }

    fn ops(&mut self, ops: Vec<warren_storage::Op>) -> Result<bool, warren_storage::StoreError> {
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| warren_storage::StoreError::Io("the snapshot file is closed".into()))?;
        w.group(&ops)
            .map_err(|e| warren_storage::StoreError::Io(e.to_string()))?;
        Ok(true)
    }
}

/// Make `path` the current snapshot unless the current one is as recent (an install may have
/// put a newer one there meanwhile). Returns whether it did.
fn make_current(dir: &Path, path: &Path, meta: &SnapshotMeta) -> std::io::Result<bool> {
    let current = dir.join(CURRENT);
    if let Ok(Some(have)) = snapshot::read_meta(&current) {
        if have.last_log_id > meta.last_log_id {
            std::fs::remove_file(path)?;
            return Ok(false);
        }
    }
    std::fs::rename(path, &current)?;
    snapshot::sync_dir(dir)?;
    Ok(true)
}

/// The current snapshot (None: none yet).
fn open_current(dir: &Path) -> Result<Option<Snapshot>, StorageError> {
    let path = dir.join(CURRENT);
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    let reread = file.try_clone().map_err(io_err)?;
    let (meta, _) = snapshot::Reader::open(reread, &path).map_err(io_err)?;
    // The reader moved the shared offset: the transfer reads from the start.
    let mut file = file;
    std::io::Seek::rewind(&mut file).map_err(io_err)?;
    Ok(Some(Snapshot {
        meta,
        snapshot: Box::new(SnapshotData {
            file,
            received: None,
        }),
    }))
}

impl StateMachine {
    /// Wait for an apply's store write.
    async fn written(rx: tokio::sync::oneshot::Receiver<bool>) -> Result<(), StorageError> {
        match rx.await {
            Ok(true) => Ok(()),
            _ => Err(Self::write_failed()),
        }
    }

    fn write_failed() -> StorageError {
        error!("the store failed to write applied entries; this node stops replicating");
        io_err("the store failed to write applied entries")
    }

    /// Forget the writes known done (an error if one failed), and wait for the oldest while
    /// more than `keep` are in flight.
    async fn reap(&mut self, keep: usize) -> Result<(), StorageError> {
        while let Some(front) = self.writing.front_mut() {
            match front.try_recv() {
                Ok(true) => {
                    self.writing.pop_front();
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                    if self.writing.len() <= keep =>
                {
                    break;
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    if let Some(rx) = self.writing.pop_front() {
                        Self::written(rx).await?;
                    }
                }
                _ => return Err(Self::write_failed()),
            }
        }
        Ok(())
    }

    /// Wait until every applied entry is in the store: what is deferred is applied first, and
    /// a write is submitted after every write before it (the deferred ops' timer writes too)
    /// to wait for.
    async fn settle(&mut self) -> Result<(), StorageError> {
        let committer = self
            .shared
            .committer
            .as_ref()
            .ok_or_else(|| io_err("a cluster node needs a store"))?;
        {
            let mut broker = self.shared.broker.lock();
            let rx = match self.rep.deferred.lock().write(&mut broker, committer) {
                Some(rx) => rx,
                None => {
                    // Nothing deferred: the store is to be at the applied position.
                    let at = postcard::to_stdvec(&self.applied).map_err(io_err)?;
                    let (done, rx) = tokio::sync::oneshot::channel();
                    committer.submit_group(Vec::new(), at, done);
                    rx
                }
            };
            self.writing.push_back(rx);
        }
        // Lingering writes go now rather than at their deadline.
        committer.hurry();
        self.reap(0).await
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
        let mut written = None;
        {
            // The broker lock, then the proposals' (as `BrokerGuard::flush` takes them): a
            // demotion (which takes both) lands between two applies, never inside one.
            let mut broker = self.shared.broker.lock();
            let mut p = self.rep.state.lock();
            let mut deferred = self.rep.deferred.lock();
            let mut parts: Vec<Part> = Vec::new();
            let mut fx = Vec::new();
            let mut committed = 0;
            // The store position the write of `parts` brings the store to: `self.applied`
            // while `at_applied` (the last entry was not deferred), else `store_at` (None: this
            // apply changed nothing the store holds yet, all it had was deferred).
            let mut store_at: Option<Vec<u8>> = None;
            let mut at_applied = false;
            for entry in entries {
                n += 1;
                let before = self.applied.log_id;
                self.applied.log_id = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => {
                        flush_into(&mut broker, &mut deferred, &mut parts, &mut committed);
                    }
                    EntryPayload::Membership(m) => {
                        flush_into(&mut broker, &mut deferred, &mut parts, &mut committed);
                        self.applied.membership = StoredMembership::new(Some(entry.log_id), m);
                    }
                    EntryPayload::Normal(batch) => {
                        if p.barrier_applied(entry.log_id.leader_id, batch.proposer) {
                            // This node's barrier: everything before it is applied now.
                            flush_into(&mut broker, &mut deferred, &mut parts, &mut committed);
                        } else if p.is_ours(entry.log_id.leader_id, batch.proposer) {
                            // Applied already: release the journals it covers.
                            flush_into(&mut broker, &mut deferred, &mut parts, &mut committed);
                            committed = committed.max(batch.ticket);
                            while p.fifo.front().is_some_and(|f| f.ticket <= batch.ticket) {
                                if let Some(part) = p.fifo.pop_front() {
                                    parts.push(part);
                                }
                            }
                        } else {
                            if p.leading.is_some() {
                                // A leader applies only its own term's entries once it serves.
                                error!(log_id = %entry.log_id, "an entry this leader did not propose; stepping down");
                                p.diverged = true;
                            }
                            let ops = match warren_storage::op_codec::decode_ops(batch.ops.clone())
                            {
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
                            if p.leading.is_none() && deferrable(&ops) {
                                if at_applied {
                                    // The entries before this one are the store's position.
                                    let prior = Applied {
                                        log_id: before,
                                        membership: self.applied.membership.clone(),
                                    };
                                    store_at = Some(postcard::to_stdvec(&prior).map_err(io_err)?);
                                    at_applied = false;
                                }
                                let at = postcard::to_stdvec(&self.applied).map_err(io_err)?;
                                deferred.push(ops, batch.clock_ms, at);
                                continue;
                            }
                            flush_into(&mut broker, &mut deferred, &mut parts, &mut committed);
                            broker.set_clock(batch.clock_ms);
                            for op in &ops {
                                // Deterministic: the leader applied the same op to the same
                                // state, so an error here was an error there too (and changed
                                // nothing).
                                if let Err(e) = broker.apply(op, &mut fx) {
                                    warn!(log_id = %entry.log_id, error = %e.text, "a replicated op was refused");
                                }
                            }
                            // Nobody is served here: deliveries and wake-ups have no one to
                            // reach.
                            fx.clear();
                            let journal = broker.take_journal();
                            // Never on a leader serving (its journal numbers run ahead of
                            // what is committed: they hold deliveries back).
                            committed = committed.max(broker.journal_seq());
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
                // Not deferred: the store is to be at this entry.
                at_applied = true;
            }
            if deferred.due() {
                if let Some((part, at)) = deferred.apply(&mut broker) {
                    parts.extend(part);
                    store_at = Some(at);
                    at_applied = false;
                    committed = committed.max(broker.journal_seq());
                }
            }
            if at_applied {
                store_at = Some(postcard::to_stdvec(&self.applied).map_err(io_err)?);
            }
            // Committed means confirmed: a majority has these entries in its fsynced Raft log,
            // and this node's store catches up from it after a crash. Each requester hears now,
            // not after the store write (which may linger: `commit::LINGER`).
            for part in parts.iter_mut() {
                if let Some(n) = part.notify.take() {
                    let _ = n.send(Done {
                        ticket: part.ticket,
                        ok: true,
                        deposed: false,
                    });
                }
            }
            if let Some(at) = store_at {
                let (done_tx, done_rx) = tokio::sync::oneshot::channel();
                committer.submit_group(parts, at, done_tx);
                written = Some(done_rx);
            } else if !parts.is_empty() {
                // Parts come only with an entry applied (which sets `store_at`).
                error!("store writes without a position to write them at; stopping");
                return Err(io_err("store writes without a store position"));
            }
            drop(deferred);
            drop(p);
            // Deliveries of the messages these entries enqueued may go now (a majority has
            // them; the local write above need not be done first).
            self.rep.committed_upto(committed, &self.shared.outboxes);
        }
        // Writes in flight let the committer merge consecutive applies into one store write (a
        // message stored by one entry and acknowledged by a later one is then never written).
        // Bounded, so that a store slower than the log holds back applying.
        if let Some(rx) = written {
            self.writing.push_back(rx);
        }
        self.reap(WRITES_IN_FLIGHT).await?;
        Ok(vec![(); n])
    }

    /// Runs between two applies: once the last apply's write is done the store holds exactly
    /// the applied entries. The store's snapshot moment is fixed here (`Store::snapshot_to`
    /// calls `taken`), and the file is written on a blocking thread while applies go on.
    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.built += 1;
        let applied = self.applied.clone();
        let id = format!(
            "{}-{}-{}",
            applied.log_id.map(|l| l.leader_id.term).unwrap_or(0),
            applied.log_id.map(|l| l.index).unwrap_or(0),
            self.built
        );
        let meta = SnapshotMeta {
            last_log_id: applied.log_id,
            last_membership: applied.membership,
            snapshot_id: id.clone(),
        };
        let path = self.snapshots.join(format!("{BUILDING}{id}"));
        let mut builder = Builder {
            meta: meta.clone(),
            path: path.clone(),
            dir: self.snapshots.clone(),
            files: self.files.clone(),
            writing: None,
            failed: None,
        };
        if let Err(e) = self.settle().await {
            builder.failed = Some(e);
            return builder;
        }
        let Some(store) = self.shared.store.clone() else {
            builder.failed = Some(io_err("a cluster node needs a store"));
            return builder;
        };
        let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
        let writing = tokio::task::spawn_blocking(move || -> Result<(), String> {
            let writer = snapshot::Writer::create(&path, &meta).map_err(|e| e.to_string())?;
            let mut sink = FileSink {
                writer: Some(writer),
                taken: Some(taken_tx),
            };
            let streamed = store.snapshot_to(&mut sink);
            let writer = sink.writer.take();
            let result = streamed
                .map_err(|e| e.to_string())
                .and_then(|()| match writer {
                    Some(w) => w.finish().map_err(|e| e.to_string()),
                    None => Err("the snapshot file is closed".into()),
                })
                // openraft purges the log behind a snapshot once it is built, and the store
                // writes without a log of its own (`OpenOptions::unlogged`): what it holds up
                // to the snapshot's position must be on disk first, or a crash would leave it
                // needing entries that are gone.
                .and_then(|()| store.persist().map_err(|e| e.to_string()));
            if result.is_err() {
                let _ = std::fs::remove_file(&path);
            }
            result
        });
        // Until the store's moment is fixed, no apply may write (a failure before it shows
        // in `writing`).
        let _ = taken_rx.await;
        builder.writing = Some(writing);
        builder
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
        // Snapshots arrive whole through `net` (openraft's chunked transfer is not used).
        let path = self
            .snapshots
            .join(format!("{RECEIVING}{:016x}", rand::random::<u64>()));
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_err)?;
        Ok(Box::new(SnapshotData {
            file,
            received: Some(super::types::Received::new(path)),
        }))
    }

    /// Replace the state with the snapshot's (`install_file`): the received file is kept as
    /// `incoming` first, so an install cut short is done again from it at start, and becomes
    /// the current snapshot once installed.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError> {
        self.settle().await?;
        let SnapshotData { file, received } = *snapshot;
        drop(file);
        let path = received
            .as_ref()
            .and_then(|r| r.path())
            .map(Path::to_path_buf)
            .ok_or_else(|| io_err("a snapshot to install must be a received file"))?;
        let checked = snapshot::verify(&path).map_err(io_err)?;
        if checked.snapshot_id != meta.snapshot_id || checked.last_log_id != meta.last_log_id {
            return Err(io_err(format!(
                "the received snapshot file holds snapshot {} at {:?}, not {} at {:?}",
                checked.snapshot_id, checked.last_log_id, meta.snapshot_id, meta.last_log_id
            )));
        }
        let installed = tokio::task::block_in_place(|| {
            let _files = self.files.lock();
            let incoming = self.snapshots.join(INCOMING);
            std::fs::rename(&path, &incoming).map_err(io_err)?;
            if let Some(r) = received {
                let _ = r.keep();
            }
            snapshot::sync_dir(&self.snapshots).map_err(io_err)?;
            self.install_file(&incoming)
        })?;
        self.applied = Applied {
            log_id: installed.last_log_id,
            membership: installed.last_membership.clone(),
        };
        info!(snapshot = %meta.snapshot_id, "installed a snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        open_current(&self.snapshots)
    }
}

/// Finishes the snapshot `get_snapshot_builder` began: waits for its file, makes it current.
pub struct Builder {
    meta: SnapshotMeta,
    path: PathBuf,
    dir: PathBuf,
    files: Arc<parking_lot::Mutex<()>>,
    writing: Option<tokio::task::JoinHandle<Result<(), String>>>,
    failed: Option<StorageError>,
}

impl RaftSnapshotBuilder<TypeConfig> for Builder {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        let writing = self
            .writing
            .take()
            .ok_or_else(|| io_err("the snapshot was built already"))?;
        writing.await.map_err(io_err)?.map_err(io_err)?;
        let (dir, path, meta, files) = (
            self.dir.clone(),
            self.path.clone(),
            self.meta.clone(),
            self.files.clone(),
        );
        let made = tokio::task::spawn_blocking(move || {
            let _files = files.lock();
            make_current(&dir, &path, &meta)
        })
        .await
        .map_err(io_err)?
        .map_err(io_err)?;
        let size = std::fs::metadata(self.dir.join(CURRENT))
            .map(|m| m.len())
            .unwrap_or(0);
        info!(snapshot = %self.meta.snapshot_id, bytes = size, current = made, "snapshot built");
        // The current one (this, or a newer one installed meanwhile).
        open_current(&self.dir)?.ok_or_else(|| io_err("the snapshot file is gone"))
    }
}

#[cfg(test)]
mod tests {
    use super::Deferred;
    use crate::broker::Broker;
    use bytes::Bytes;
    use warren_storage::Op;

    fn enqueue(id: u64) -> Op {
        Op::Enqueue {
            vhost: "/".into(),
            queues: vec![("q".into(), 0)].into(),
            id,
            timestamp_ms: 1,
            exchange: "".into(),
            routing_key: "q".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from(vec![b'x'; 10]).into(),
        }
    }

    fn remove(ids: &[u64]) -> Op {
        Op::Remove {
            vhost: "/".into(),
            queue: "q".into(),
            keys: ids
                .iter()
                .map(|id| warren_storage::message_key(0, *id))
                .collect(),
            sizes: vec![10; ids.len()],
        }
    }

    /// A follower's deferred entries: the messages enqueued and acknowledged within them never
    /// reach its broker or its store; the others do, in order, and message ids go on after
    /// the skipped ones. The store position is the last deferred entry's.
    #[test]
    fn deferred_entries_skip_the_messages_acknowledged_within_them() {
        let mut b = Broker::new();
        b.enable_journal();
        let mut fx = Vec::new();
        b.apply(
            &Op::DeclareQueue {
                vhost: "/".into(),
                name: "q".into(),
                durable: true,
                exclusive: false,
                auto_delete: false,
                arguments: Bytes::from_static(&[0, 0, 0, 0]),
            },
            &mut fx,
        )
        .unwrap();
        b.apply(&enqueue(1), &mut fx).unwrap();
        b.take_journal();
        let mut d = Deferred::default();
        assert!(
            d.apply(&mut b).is_none(),
            "nothing deferred, nothing applied"
        );
        // Three entries: 2 and 3 enqueued, then acks of 1 (applied before) and 2, then 4.
        d.push(vec![enqueue(2), enqueue(3)], 5, vec![1]);
        d.push(vec![remove(&[1, 2])], 6, vec![2]);
        d.push(vec![enqueue(4)], 7, vec![3]);
        assert!(!d.due(), "due before DEFER");
        assert_eq!(b.queue_info("/", "q").unwrap().message_count, 1);
        let (part, at) = d.apply(&mut b).unwrap();
        assert_eq!(at, vec![3]);
        assert_eq!(b.queue_info("/", "q").unwrap().message_count, 2);
        let written: Vec<String> = part
            .unwrap()
            .ops
            .iter()
            .map(|op| match op {
                Op::Enqueue { id, .. } => format!("enqueue {id}"),
                Op::Remove { keys, .. } => format!(
                    "remove {:?}",
                    keys.iter()
                        .map(|k| warren_storage::key_id(*k))
                        .collect::<Vec<_>>()
                ),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(written, ["enqueue 3", "remove [1]", "enqueue 4"]);
        assert!(d.apply(&mut b).is_none(), "applied once");
        d.push(vec![enqueue(9), remove(&[9])], 8, vec![4]);
        let (part, at) = d.apply(&mut b).unwrap();
        assert!(
            part.is_none(),
            "a message enqueued and removed is not written"
        );
        assert_eq!(at, vec![4]);
        assert_eq!(b.queue_info("/", "q").unwrap().message_count, 2);
        // Promoted, this broker gives the next message an id after the skipped one.
        let properties =
            amq_protocol::protocol::basic::AMQPProperties::default().with_delivery_mode(2);
        let msg = crate::broker::Message {
            exchange: "".into(),
            routing_key: "q".into(),
            raw_properties: warren_protocol::codec::encode_properties(&properties),
            properties,
            body: Bytes::from_static(b"next").into(),
            expiration: None,
        };
        b.publish("/", std::sync::Arc::new(msg), &mut fx).unwrap();
        let ids: Vec<u64> = b
            .take_journal()
            .iter()
            .filter_map(|op| match op {
                Op::Enqueue { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(ids, [10]);
    }
}

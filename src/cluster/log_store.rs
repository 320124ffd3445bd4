//! openraft's log storage (`RaftLogStorage` and `RaftLogReader`) on the bytes-only RocksDB log
//! `warren_rocks::raft_log::RaftLogDb` (`<data-dir>/raft/`).
//!
//! On disk:
//!
//! - each entry is `FORMAT` (one byte) then the postcard encoding of the openraft `Entry`,
//!   keyed by its index; a value that does not decode (or names another index than its key) is
//!   a `StorageError`, never a panic;
//! - meta `vote`, `committed` and `last_purged_id` hold the same versioned postcard encoding of
//!   the `Vote`, the `Option<LogId>` last committed and the full `LogId` last purged (written in
//!   the purge's own write, see `RaftLogDb::purge_with_meta`);
//! - other meta keys (node identity, cluster id) are JSON, through `get_meta_json` and
//!   `put_meta_json`.
//!
//! Reads: the newest entries (up to `TAIL_BYTES` of their encodings) are also kept in memory as
//! appended, and reads within them are served from there: openraft reads every entry back right
//! after it was appended, once per follower to send it and once to apply it, and reading and
//! decoding a megabyte entry from RocksDB three times was a measurable part of a leader's work.
//!
//! Durability: `append` writes the entries without waiting for the disk (they are readable as
//! soon as it returns) and hands the engine's callback to the `warren-raftlog` thread, which
//! coalesces every pending callback into one fsync of the write-ahead log and only then
//! completes them. The vote is written synced (on a blocking thread) before `save_vote` returns.
//! The committed id, truncations and purges are written without a sync: RocksDB has one
//! write-ahead log, so the next synced write (an append's fsync, a vote) makes them durable, and
//! never a later write without an earlier one.

// openraft's `StorageError` (224 bytes) is what its storage traits return: the helpers here
// return it too rather than convert at every call.
#![allow(clippy::result_large_err)]

use crate::cluster::types::{Entry, LogId, NodeId, StorageError, TypeConfig, Vote};
use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{AnyError, ErrorSubject, ErrorVerb, OptionalSend, StorageIOError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::VecDeque;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use warren_rocks::raft_log::RaftLogDb;
use warren_storage::StoreError;

/// The version byte in front of every postcard value this store writes.
const FORMAT: u8 = 1;
/// What `limited_get_log_entries` reads at most (encoded bytes; at least one entry).
const READ_BUDGET: usize = 4 << 20;
/// The newest entries kept in memory (bytes of their encodings; at least the last one).
const TAIL_BYTES: usize = 16 << 20;
/// The largest `LogStore::scratch` kept after an append.
const SCRATCH_KEEP: usize = 16 << 20;

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const LAST_PURGED_ID: &[u8] = b"last_purged_id";

/// The Raft log of this node (see the module doc). Clones share the one database and the one
/// sync thread; the last clone dropped stops the thread (after its pending syncs) and closes the
/// database.
pub struct LogStore {
    inner: Arc<Inner>,
    /// The last committed index + 1, or 0 when none is known (`committed_index`).
    committed: Arc<AtomicU64>,
    /// The buffer `append` encodes entries into, kept between appends: a fresh one of a few
    /// hundred KiB per append came from memory the allocator had given back to the kernel,
    /// which faulted in and zeroed it page by page (a few % of each node's CPU under load).
    scratch: Vec<u8>,
}

impl Clone for LogStore {
    fn clone(&self) -> Self {
        LogStore {
            inner: self.inner.clone(),
            committed: self.committed.clone(),
            scratch: Vec::new(),
        }
    }
}

impl Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("db", &self.inner.db)
            .field("committed_index", &self.committed_index())
            .finish()
    }
}

struct Inner {
    db: Arc<RaftLogDb>,
    path: std::path::PathBuf,
    syncer: Option<Syncer>,
    tail: parking_lot::Mutex<Tail>,
}

/// The newest entries as appended, with consecutive indexes, and their encoded sizes (see the
/// module doc). Empty after a start: it fills as entries are appended.
#[derive(Default)]
struct Tail {
    entries: VecDeque<(Entry, usize)>,
    bytes: usize,
}

impl Tail {
    fn push(&mut self, entry: Entry, size: usize) {
        let follows = self
            .entries
            .back()
            .is_none_or(|(e, _)| e.log_id.index + 1 == entry.log_id.index);
        if !follows {
            // Not next to what is kept (the engine truncated or rewound): start over.
            self.entries.clear();
            self.bytes = 0;
        }
        self.entries.push_back((entry, size));
        self.bytes += size;
        while self.bytes > TAIL_BYTES && self.entries.len() > 1 {
            if let Some((_, size)) = self.entries.pop_front() {
                self.bytes -= size;
            }
        }
    }

    /// Entries from index `from` up to `to` (exclusive) and `max_bytes` (at least one), if
    /// `from` is kept here (what the tail holds is all the log has from its first index on).
    fn read(&self, from: u64, to: u64, max_bytes: usize) -> Option<Vec<Entry>> {
        let first = self.entries.front()?.0.log_id.index;
        let skip = usize::try_from(from.checked_sub(first)?).ok()?;
        if skip >= self.entries.len() {
            return None;
        }
        let mut out = Vec::new();
        let mut bytes = 0;
        for (e, size) in self.entries.iter().skip(skip) {
            if e.log_id.index >= to || (!out.is_empty() && bytes + size > max_bytes) {
                break;
            }
            bytes += size;
            out.push(e.clone());
        }
        Some(out)
    }

    /// Forget entries from index `index` on.
    fn truncate(&mut self, index: u64) {
        while let Some((e, size)) = self.entries.back() {
            if e.log_id.index < index {
                break;
            }
            self.bytes -= size;
            self.entries.pop_back();
        }
    }

    /// Forget entries up to index `index`.
    fn purge(&mut self, index: u64) {
        while let Some((e, size)) = self.entries.front() {
            if e.log_id.index > index {
                break;
            }
            self.bytes -= size;
            self.entries.pop_front();
        }
    }
}

/// The `warren-raftlog` thread and the channel of callbacks waiting for its next fsync.
struct Syncer {
    tx: mpsc::Sender<LogFlushed<TypeConfig>>,
    thread: std::thread::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(Syncer { tx, thread }) = self.syncer.take() {
            // The thread ends once the channel is closed and drained; joining it releases its
            // handle on the database before ours goes (a reopen finds the folder unlocked).
            drop(tx);
            if thread.join().is_err() {
                tracing::error!("the raft log sync thread panicked");
            }
        }
    }
}

impl LogStore {
    /// Open (or create) the log in `dir` and start its sync thread.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let db = Arc::new(RaftLogDb::open(dir)?);
        let corrupt = |detail: String| StoreError::Corrupt {
            path: dir.to_path_buf(),
            detail,
        };
        let committed = match db.get_meta(COMMITTED)? {
            Some(bytes) => decode::<Option<LogId>>(&bytes)
                .map_err(|e| corrupt(format!("the committed log id: {e}")))?,
            None => None,
        };
        let (tx, rx) = mpsc::channel();
        let thread_db = db.clone();
        let thread = std::thread::Builder::new()
            .name("warren-raftlog".into())
            .spawn(move || sync_loop(&thread_db, &rx))
            .map_err(|e| StoreError::Io(format!("starting the raft log sync thread: {e}")))?;
        Ok(LogStore {
            inner: Arc::new(Inner {
                db,
                path: dir.to_path_buf(),
                syncer: Some(Syncer { tx, thread }),
                tail: Default::default(),
            }),
            committed: Arc::new(AtomicU64::new(committed_value(committed))),
            scratch: Vec::new(),
        })
    }

    fn db(&self) -> &RaftLogDb {
        &self.inner.db
    }

    /// The index of the last committed entry this node knows of (as last saved by the engine),
    /// without a lock or a read of the disk: for status reports.
    pub fn committed_index(&self) -> Option<u64> {
        match self.committed.load(Ordering::Acquire) {
            0 => None,
            n => Some(n - 1),
        }
    }

    /// A JSON value stored with `put_meta_json` (node identity, cluster id).
    pub fn get_meta_json<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StoreError> {
        match self.db().get_meta(key.as_bytes())? {
            Some(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| StoreError::Corrupt {
                        path: self.inner.path.clone(),
                        detail: format!("raft log meta {key}: {e}"),
                    })
            }
            None => Ok(None),
        }
    }

    /// Store a small JSON value under `key`; with `sync`, return only once it is on disk. Blocks
    /// on the disk: call it at startup or from a blocking thread.
    pub fn put_meta_json<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        sync: bool,
    ) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(value)
            .map_err(|e| StoreError::Io(format!("encoding raft log meta {key}: {e}")))?;
        self.db().put_meta(key.as_bytes(), &bytes, sync)
    }

    /// Entries in `from..to`, starting at the first one present at or after `from`, ending at a
    /// gap or after `max_bytes` of encoded entries (at least one).
    fn read_entries(
        &self,
        from: u64,
        to: u64,
        max_bytes: usize,
    ) -> Result<Vec<Entry>, StorageError> {
        if from >= to {
            return Ok(Vec::new());
        }
        if let Some(entries) = self.inner.tail.lock().read(from, to, max_bytes) {
            return Ok(entries);
        }
        let db = self.db();
        let mut raw = db.read(from, to, max_bytes).map_err(read_logs)?;
        if raw.is_empty() {
            // The log may start after `from` (purged, or never written below its first entry).
            if let Some(first) = db.first().map_err(read_logs)? {
                if first > from && first < to {
                    raw = db.read(first, to, max_bytes).map_err(read_logs)?;
                }
            }
        }
        raw.iter()
            .map(|(index, bytes)| decode_entry(*index, bytes))
            .collect()
    }

    /// The log's first and last ids (`RaftLogStorage::get_log_state`).
    fn log_state(&self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id = self.last_purged_id()?;
        let last = match self.db().last().map_err(read_logs)? {
            Some((index, bytes)) => Some(decode_entry(index, &bytes)?.log_id),
            None => None,
        };
        // Nothing is left at or below the last purged index, so an entry is always above it.
        let last_log_id = match (last, last_purged_log_id) {
            (Some(l), Some(p)) if l.index <= p.index => Some(p),
            (Some(l), _) => Some(l),
            (None, p) => p,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    /// The id of the last entry of the log (or the last purged one when it holds none): from
    /// the tail when it holds entries, else read (pre-votes compare it).
    pub fn last_log_id(&self) -> Result<Option<LogId>, String> {
        if let Some((e, _)) = self.inner.tail.lock().entries.back() {
            return Ok(Some(e.log_id));
        }
        self.log_state()
            .map(|state| state.last_log_id)
            .map_err(|e| e.to_string())
    }

    fn last_purged_id(&self) -> Result<Option<LogId>, StorageError> {
        match self.db().get_meta(LAST_PURGED_ID).map_err(read_logs)? {
            Some(bytes) => decode::<LogId>(&bytes)
                .map(Some)
                .map_err(|e| corrupt_logs(format!("the last purged log id: {e}"))),
            None => Ok(None),
        }
    }
}

fn committed_value(committed: Option<LogId>) -> u64 {
    committed.map_or(0, |c| c.index.saturating_add(1))
}

/// The `warren-raftlog` thread: wait for a callback, take every other one pending, make all
/// appended so far durable with one fsync, then complete them. After a failed fsync every later
/// callback fails too: what the page cache lost is not brought back by a later fsync that works.
fn sync_loop(db: &RaftLogDb, rx: &mpsc::Receiver<LogFlushed<TypeConfig>>) {
    let mut failed: Option<String> = None;
    while let Ok(first) = rx.recv() {
        let mut pending = vec![first];
        pending.extend(rx.try_iter());
        let result = match &failed {
            Some(e) => Err(e.clone()),
            None => db.sync().map_err(|e| e.to_string()),
        };
        if let (Err(e), None) = (&result, &failed) {
            tracing::error!(
                "the Raft log cannot be made durable ({e}): no later append is reported \
                 durable, and this node stops replicating (the others go on while they are a \
                 majority); free space or mend the disk, then restart it: it catches up"
            );
            failed = Some(e.clone());
        }
        for callback in pending {
            callback.log_io_completed(result.clone().map_err(io::Error::other));
        }
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    let mut buf = Vec::with_capacity(64);
    buf.push(FORMAT);
    postcard::to_extend(value, buf)
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match bytes.split_first() {
        Some((&FORMAT, rest)) => match postcard::take_from_bytes::<T>(rest) {
            Ok((value, [])) => Ok(value),
            Ok((_, extra)) => Err(format!("{} bytes past the value", extra.len())),
            Err(e) => Err(e.to_string()),
        },
        Some((version, _)) => Err(format!("unknown format version {version}")),
        None => Err("empty value".to_string()),
    }
}

fn decode_entry(index: u64, bytes: &[u8]) -> Result<Entry, StorageError> {
    let entry: Entry = decode(bytes).map_err(|e| {
        StorageIOError::read_log_at_index(index, AnyError::error(format!("entry {index}: {e}")))
    })?;
    if entry.log_id.index != index {
        return Err(StorageIOError::read_log_at_index(
            index,
            AnyError::error(format!(
                "the entry stored at {index} is entry {}",
                entry.log_id.index
            )),
        )
        .into());
    }
    Ok(entry)
}

fn io_error(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: &StoreError) -> StorageError {
    StorageIOError::new(subject, verb, AnyError::new(e)).into()
}

fn read_logs(e: StoreError) -> StorageError {
    io_error(ErrorSubject::Logs, ErrorVerb::Read, &e)
}

fn write_logs(e: StoreError) -> StorageError {
    io_error(ErrorSubject::Logs, ErrorVerb::Write, &e)
}

fn delete_logs(e: StoreError) -> StorageError {
    io_error(ErrorSubject::Logs, ErrorVerb::Delete, &e)
}

fn corrupt_logs(detail: String) -> StorageError {
    StorageIOError::read_logs(AnyError::error(detail)).into()
}

/// `[start, end)` of a range of indexes.
fn bounds(range: &impl RangeBounds<u64>) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let (start, end) = bounds(&range);
        self.read_entries(start, end, usize::MAX)
    }

    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry>, StorageError> {
        self.read_entries(start, end, READ_BUDGET)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        self.log_state()
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        let bytes = encode(vote).map_err(|e| StorageIOError::write_vote(AnyError::new(&e)))?;
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.db.put_meta(VOTE, &bytes, true))
            .await
            .map_err(|e| StorageIOError::write_vote(AnyError::new(&e)))?
            .map_err(|e| io_error(ErrorSubject::Vote, ErrorVerb::Write, &e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        match self
            .db()
            .get_meta(VOTE)
            .map_err(|e| io_error(ErrorSubject::Vote, ErrorVerb::Read, &e))?
        {
            Some(bytes) => decode::<Vote>(&bytes).map(Some).map_err(|e| {
                StorageIOError::read_vote(AnyError::error(format!("the vote: {e}"))).into()
            }),
            None => Ok(None),
        }
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        let bytes = encode(&committed).map_err(|e| StorageIOError::write(AnyError::new(&e)))?;
        self.db()
            .put_meta(COMMITTED, &bytes, false)
            .map_err(|e| io_error(ErrorSubject::Store, ErrorVerb::Write, &e))?;
        self.committed
            .store(committed_value(committed), Ordering::Release);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        match self
            .db()
            .get_meta(COMMITTED)
            .map_err(|e| io_error(ErrorSubject::Store, ErrorVerb::Read, &e))?
        {
            Some(bytes) => decode::<Option<LogId>>(&bytes).map_err(|e| {
                StorageIOError::read(AnyError::error(format!("the committed log id: {e}"))).into()
            }),
            None => Ok(None),
        }
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        // Every entry's encoding, one after the other in `scratch`: `ends[i]` is where entry
        // i's ends.
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.reserve(
            entries
                .iter()
                .map(|e| super::types::entry_size_hint(e) + 1)
                .sum(),
        );
        let mut ends = Vec::with_capacity(entries.len());
        for e in &entries {
            buf.push(FORMAT);
            buf = postcard::to_extend(e, buf)
                .map_err(|err| StorageIOError::write_log_entry(e.log_id, AnyError::new(&err)))?;
            ends.push(buf.len());
        }
        let mut start = 0;
        let refs: Vec<(u64, &[u8])> = entries
            .iter()
            .zip(&ends)
            .map(|(e, &end)| {
                let bytes = &buf[start..end];
                start = end;
                (e.log_id.index, bytes)
            })
            .collect();
        if let Err(e) = self.db().append(&refs) {
            tracing::error!(
                "the Raft log cannot be written ({e}): this node stops replicating (the others \
                 go on while they are a majority); free space or mend the disk, then restart \
                 it: it catches up"
            );
            callback.log_io_completed(Err(io::Error::other(e.to_string())));
            return Err(write_logs(e));
        }
        {
            let mut tail = self.inner.tail.lock();
            for (e, (_, bytes)) in entries.into_iter().zip(&refs) {
                tail.push(e, bytes.len());
            }
        }
        drop(refs);
        // Kept unless one unusually large append grew it far past the usual.
        if buf.capacity() <= SCRATCH_KEEP {
            self.scratch = buf;
        }
        let Some(syncer) = &self.inner.syncer else {
            callback.log_io_completed(Err(io::Error::other("the raft log is closing")));
            return Err(
                StorageIOError::write_logs(AnyError::error("the raft log is closing")).into(),
            );
        };
        if let Err(mpsc::SendError(callback)) = syncer.tx.send(callback) {
            callback.log_io_completed(Err(io::Error::other("the raft log sync thread is gone")));
            return Err(StorageIOError::write_logs(AnyError::error(
                "the raft log sync thread is gone",
            ))
            .into());
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.inner.tail.lock().truncate(log_id.index);
        self.db().truncate(log_id.index).map_err(delete_logs)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let bytes = encode(&log_id).map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        self.inner.tail.lock().purge(log_id.index);
        self.db()
            .purge_with_meta(log_id.index, LAST_PURGED_ID, &bytes)
            .map_err(delete_logs)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::cluster::types::{bytes_of, data_of};
    use crate::cluster::types::{Batch, Snapshot, SnapshotData, SnapshotMeta, StoredMembership};
    use openraft::storage::{RaftLogStorageExt, RaftStateMachine};
    use openraft::testing::{StoreBuilder, Suite};
    use openraft::{EntryPayload, RaftSnapshotBuilder};
    use serde::Deserialize;
    use tempfile::TempDir;

    /// What the test state machine holds (and its snapshots carry, as JSON).
    #[derive(Debug, Clone, Default, Serialize, Deserialize)]
    struct SmState {
        applied: Option<LogId>,
        membership: StoredMembership,
    }

    #[derive(Default)]
    struct SmInner {
        state: SmState,
        snapshot: Option<(SnapshotMeta, Vec<u8>)>,
        built: u64,
    }

    /// A minimal in-memory state machine for openraft's suite.
    #[derive(Clone, Default)]
    struct MemSm(Arc<parking_lot::Mutex<SmInner>>);

    impl RaftSnapshotBuilder<TypeConfig> for MemSm {
        async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
            let mut sm = self.0.lock();
            let data = serde_json::to_vec(&sm.state)
                .map_err(|e| StorageIOError::write_snapshot(None, AnyError::new(&e)))?;
            sm.built += 1;
            let meta = SnapshotMeta {
                last_log_id: sm.state.applied,
                last_membership: sm.state.membership.clone(),
                snapshot_id: format!("snapshot-{}", sm.built),
            };
            sm.snapshot = Some((meta.clone(), data.clone()));
            Ok(Snapshot {
                meta,
                snapshot: Box::new(data_of(&data)),
            })
        }
    }

    impl RaftStateMachine<TypeConfig> for MemSm {
        type SnapshotBuilder = Self;

        async fn applied_state(
            &mut self,
        ) -> Result<(Option<LogId>, StoredMembership), StorageError> {
            let sm = self.0.lock();
            Ok((sm.state.applied, sm.state.membership.clone()))
        }

        async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError>
        where
            I: IntoIterator<Item = Entry> + OptionalSend,
            I::IntoIter: OptionalSend,
        {
            let mut sm = self.0.lock();
            let mut replies = Vec::new();
            for entry in entries {
                sm.state.applied = Some(entry.log_id);
                if let EntryPayload::Membership(m) = &entry.payload {
                    sm.state.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                }
                replies.push(());
            }
            Ok(replies)
        }

        async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
            self.clone()
        }

        async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
            Ok(Box::new(data_of(b"")))
        }

        async fn install_snapshot(
            &mut self,
            meta: &SnapshotMeta,
            snapshot: Box<SnapshotData>,
        ) -> Result<(), StorageError> {
            let data = bytes_of(*snapshot);
            let state: SmState = serde_json::from_slice(&data).map_err(|e| {
                StorageIOError::read_snapshot(Some(meta.signature()), AnyError::new(&e))
            })?;
            let mut sm = self.0.lock();
            sm.state = state;
            sm.snapshot = Some((meta.clone(), data));
            Ok(())
        }

        async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
            let sm = self.0.lock();
            Ok(sm.snapshot.as_ref().map(|(meta, data)| Snapshot {
                meta: meta.clone(),
                snapshot: Box::new(data_of(data)),
            }))
        }
    }

    /// A fresh log store in a temporary folder (kept alive by the guard) and a fresh state
    /// machine, for each of the suite's tests.
    struct Builder;

    impl StoreBuilder<TypeConfig, LogStore, MemSm, TempDir> for Builder {
        async fn build(&self) -> Result<(TempDir, LogStore, MemSm), StorageError> {
            let dir = tempfile::tempdir().unwrap();
            let store = LogStore::open(dir.path()).unwrap();
            Ok((dir, store, MemSm::default()))
        }
    }

    #[test]
    fn openraft_storage_suite() {
        // The suite makes a runtime of its own for each test: this test has none.
        Suite::test_all(Builder).unwrap();
    }

    fn log_id(term: u64, index: u64) -> LogId {
        openraft::testing::log_id(term, 1, index)
    }

    fn normal(term: u64, index: u64, ops: Vec<u8>) -> Entry {
        Entry {
            log_id: log_id(term, index),
            payload: EntryPayload::Normal(Batch {
                proposer: 7,
                ticket: index,
                clock_ms: 1000 + index,
                ops: ops.into(),
            }),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn entries_vote_committed_and_purge_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let entries: Vec<Entry> = (1..=20)
            .map(|i| normal(2, i, format!("ops {i}").into_bytes()))
            .collect();
        {
            let mut store = LogStore::open(dir.path()).unwrap();
            assert_eq!(store.committed_index(), None);
            store.blocking_append(entries.clone()).await.unwrap();
            // Appends in flight together share syncs; each callback still comes.
            let appends: Vec<_> = (21..=30)
                .map(|i| {
                    let mut s = store.clone();
                    tokio::spawn(async move { s.blocking_append([normal(2, i, vec![])]).await })
                })
                .collect();
            for a in appends {
                a.await.unwrap().unwrap();
            }
            assert_eq!(store.try_get_log_entries(1..).await.unwrap().len(), 30);
            store.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
            store.save_committed(Some(log_id(2, 15))).await.unwrap();
            assert_eq!(store.committed_index(), Some(15));
            store.purge(log_id(2, 5)).await.unwrap();
            store.truncate(log_id(2, 19)).await.unwrap();
            store
                .put_meta_json("cluster_id", &"abc".to_string(), true)
                .unwrap();
            // A last append after the unsynced purge and truncate: its fsync covers them.
            store
                .blocking_append([normal(3, 19, vec![9])])
                .await
                .unwrap();
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.committed_index(), Some(15));
        assert_eq!(store.read_committed().await.unwrap(), Some(log_id(2, 15)));
        assert_eq!(
            store.read_vote().await.unwrap(),
            Some(Vote::new_committed(2, 1))
        );
        assert_eq!(
            store.get_log_state().await.unwrap(),
            LogState {
                last_purged_log_id: Some(log_id(2, 5)),
                last_log_id: Some(log_id(3, 19)),
            }
        );
        let mut want = entries[5..18].to_vec();
        want.push(normal(3, 19, vec![9]));
        assert_eq!(store.try_get_log_entries(..).await.unwrap(), want);
        assert_eq!(store.try_get_log_entries(8..10).await.unwrap(), want[2..4]);
        assert_eq!(
            store.get_meta_json::<String>("cluster_id").unwrap(),
            Some("abc".to_string())
        );
        assert_eq!(store.get_meta_json::<String>("node_id").unwrap(), None);
    }

    #[tokio::test]
    async fn limited_reads_stop_at_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(dir.path()).unwrap();
        let big: Vec<Entry> = (1..=10)
            .map(|i| normal(1, i, vec![i as u8; 1 << 20]))
            .collect();
        store.blocking_append(big.clone()).await.unwrap();
        // Four 1 MiB entries and their headers are past 4 MiB: three fit.
        assert_eq!(
            store.limited_get_log_entries(1, 11).await.unwrap(),
            big[..3]
        );
        assert_eq!(
            store.limited_get_log_entries(10, 11).await.unwrap(),
            big[9..]
        );
        assert_eq!(store.try_get_log_entries(1..11).await.unwrap(), big);
    }

    #[tokio::test]
    async fn damaged_values_are_errors_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut store = LogStore::open(dir.path()).unwrap();
            store
                .blocking_append((1..=3).map(|i| normal(1, i, vec![1])))
                .await
                .unwrap();
        }
        {
            let db = RaftLogDb::open(dir.path()).unwrap();
            let mut other_version = encode(&normal(1, 4, vec![1])).unwrap();
            other_version[0] = 2;
            let misplaced = encode(&normal(1, 9, vec![1])).unwrap();
            db.append(&[
                (2, &[FORMAT, 0xff, 0xff][..]),
                (4, other_version.as_slice()),
                (5, misplaced.as_slice()),
                (6, &[][..]),
            ])
            .unwrap();
            db.put_meta(VOTE, &[FORMAT], false).unwrap();
            db.put_meta(LAST_PURGED_ID, b"junk", false).unwrap();
        }
        let mut store = LogStore::open(dir.path()).unwrap();
        assert_eq!(store.try_get_log_entries(1..2).await.unwrap().len(), 1);
        assert_eq!(store.try_get_log_entries(3..4).await.unwrap().len(), 1);
        for index in [2, 4, 5, 6] {
            assert!(
                store.try_get_log_entries(index..=index).await.is_err(),
                "entry {index}"
            );
        }
        assert!(store.read_vote().await.is_err());
        assert!(store.get_log_state().await.is_err());
    }
}

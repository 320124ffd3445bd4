//! Warren's RocksDB store: [`RocksStore`] implements `warren_storage::Store` (and passes its
//! conformance suite, `tests/conformance.rs`).
//!
//! The RocksDB store. Column families: `meta` (definitions), `messages` (every queue's
//! messages, keyed by the queue, then `message_key(level, id)` big-endian, so a queue's keys
//! are contiguous and iterate in delivery order within a priority level), and `shared`
//! (bodies routed to several queues, by id).
//!
//! Why one keyspace for all queues and not a column family per queue (the first design): a
//! column family costs RocksDB an OPTIONS-file rewrite of *every* column family's options, with
//! an fsync, on each creation (O(n) per queue.declare, O(n^2) for n queues: measured 300 ms per
//! declare at 2,000 queues) and about 95 KB of memory each at rest (190 MB at 2,000 queues).
//! With one keyspace a durable queue costs nothing until it holds messages; purge and delete
//! are range deletes over the queue's prefix (compaction reclaims the space), and messages of
//! queues whose definition is gone (a crash between the two, or a non-durable queue's spills)
//! are removed at recovery.
//!
//! A message routed to several stored queues is written once, under its id in `shared`; each
//! queue's entry is a one-byte reference. How many references a shared body has is not stored:
//! recovery counts them, and the store keeps the count in memory for the live ids only (the
//! last reference removed deletes the body). A queue that is deep in memory spills messages
//! without the write-ahead log (`Op::Spill`); they are deleted at recovery.
//!
//! Tuning, and why (the options themselves are in `open`):
//! - One LRU block cache shared by every column family, and one write-buffer manager capping all
//!   memtables together (memory follows the data in flight, not the number of queues).
//! - `messages` gets a larger write buffer (8 MiB): it takes every message write; a message
//!   acked before its memtable is flushed never reaches an SST file. Block cache 16 MiB and
//!   memtables 24 MiB in all keep the store's share of a deep queue's memory near 40 MB (the
//!   S5 benchmark: 1,000,000 messages waiting then drained, peak RSS in the README; smaller
//!   budgets than these did not change S2's rate).
//! - Level compaction (the default), helped where it does not merge: a queue's keys only grow,
//!   so each flushed file covers a key range no other file touches and level compaction moves
//!   it down instead of merging it; `maintenance` merges runs of small files and compacts the
//!   ranges of deleted and purged queues (whose table files are dropped at once when they hold
//!   nothing else).
//! - At most `open::max_open_files()` table files open (from the descriptor limit).
//! - Sync writes are RocksDB's WAL fsync; the committer batches many ops into one write, so one
//!   fsync serves every connection waiting at that moment.
//! - Damage is refused at open, not skipped (see `open`); `--recover-damaged` runs `salvage`.
//! - A write that fails because of a background error RocksDB does not resume from (a file it
//!   could not open, say, at the descriptor limit) stops the database for good; `maintenance`
//!   reopens it in-process once files can be written again.

mod maintenance;
pub mod open;
pub mod raft_log;
mod salvage;

use bytes::Bytes;
use open::{lock, map_err, Mode, Tuning, SENTINEL};
use rocksdb::{
    DBWithThreadMode, Direction, IteratorMode, MultiThreaded, ReadOptions, WriteBatch, WriteOptions,
};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use warren_storage::codec::{
    decode_entity_key, entity_key, split_topic_permission_name, topic_permission_name, BindingKey,
    ExchangeRecord, LimitsRecord, MessageEntry, MessageRecord, PermissionRecord, QueueRecord,
    TopicPermissionRecord, UserRecord, VhostRecord, BINDING_PREFIX, EXCHANGE_PREFIX,
    PERMISSION_PREFIX, QUEUE_PREFIX, SHARED_TAG, TOPIC_PERMISSION_PREFIX, USER_LIMITS_PREFIX,
    USER_PREFIX, VHOST_LIMITS_PREFIX, VHOST_PREFIX,
};
use warren_storage::op::{BindingDest, Op};
use warren_storage::{key_id, QueueSummary, Recovered, Store, StoreError, StoredMessage};

type Db = DBWithThreadMode<MultiThreaded>;

const META: &str = "meta";
const MESSAGES: &str = "messages";
const SHARED: &str = "shared";

/// How to open a store.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// A store that fails the checks at open is salvaged instead of refused: its files are
    /// copied to `damaged-<unix time>/` beside it, RocksDB's repair keeps what it can read, and
    /// what was lost is logged.
    pub recover_damaged: bool,
    /// Write without RocksDB's write-ahead log: for a cluster node, whose Raft log is the
    /// durable record of every change and whose writes carry their applied position
    /// (`Store::write_applied`). A crash loses the writes not yet flushed to table files, and
    /// the node applies them again from its Raft log; so the log must be kept until
    /// `Store::persist` has made them durable. A synced write flushes instead of fsyncing a
    /// log. This saves each message's second copy and checksum on every node.
    pub unlogged: bool,
}

pub struct RocksStore {
    inner: Arc<Inner>,
    /// The background threads (`maintenance`), joined on drop.
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// The store's state, shared with its background threads.
pub(crate) struct Inner {
    path: PathBuf,
    /// The last sequence number in the store as opened (before anything is written).
    recovered_seq: u64,
    tuning: Tuning,
    /// None only while a reopen after a failed write has not succeeded yet. Lock order:
    /// `writing`, then `db`, then `health`.
    db: RwLock<Option<Db>>,
    /// References to each shared body still stored (ids with none are not here).
    refs: Mutex<HashMap<u64, u32>>,
    /// Held across every write, so that the sequence number read just after a logged write is
    /// that write's (the committer is the only writer anyway: this costs nothing).
    writing: Mutex<()>,
    /// The sequence number of the last write that went to the log (under `writing`).
    last_logged: AtomicU64,
    /// The highest sequence number known fsynced: what `WARREN-CONFIRMED` records.
    confirmed: AtomicU64,
    /// What the scan at open found, until the first write makes it stale: recovery reads
    /// every key once, at open, so that damage found there can be refused or salvaged before
    /// anything starts.
    recovered: Mutex<Option<Recovered>>,
    /// Whether the database stopped taking writes after an error (see `maintenance`).
    health: Mutex<maintenance::Health>,
    jobs: maintenance::Jobs,
    /// Messages of queues without a definition that the last scan dropped:
    /// (vhost, queue, messages). Normal for non-durable queues' spills; reported by salvage.
    orphans: Mutex<Vec<(String, String, u64)>>,
    /// Write batches handed to RocksDB so far (a store write is one, unless a logged store
    /// switches between logged ops and spills).
    batches: AtomicU64,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

/// The database, borrowed for one operation (from `Inner::db`'s read lock).
struct View<'a> {
    db: &'a Db,
    inner: &'a Inner,
}

/// The key prefix of a queue's messages: `m`, then vhost and name, length-prefixed (so no
/// queue's prefix is a prefix of another's).
fn queue_prefix(vhost: &str, name: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(9 + vhost.len() + name.len() + 8);
    put_queue_prefix(&mut p, vhost, name);
    p
}

fn put_queue_prefix(p: &mut Vec<u8>, vhost: &str, name: &str) {
    p.push(b'm');
    p.extend_from_slice(&(vhost.len() as u32).to_be_bytes());
    p.extend_from_slice(vhost.as_bytes());
    p.extend_from_slice(&(name.len() as u32).to_be_bytes());
    p.extend_from_slice(name.as_bytes());
}

/// A message's key written into `buf` (reused across a batch: no allocation per message).
fn message_key_in<'a>(buf: &'a mut Vec<u8>, vhost: &str, name: &str, key: u64) -> &'a [u8] {
    buf.clear();
    put_queue_prefix(buf, vhost, name);
    buf.extend_from_slice(&key.to_be_bytes());
    buf
}

/// A message's key: its queue's prefix, then its key in the queue.
fn message_key_bytes(prefix: &[u8], key: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 8);
    k.extend_from_slice(prefix);
    k.extend_from_slice(&key.to_be_bytes());
    k
}

impl RocksStore {
    /// Open (or create) the store in `path`. Fails with [`StoreError::Locked`] if another
    /// process has it open, and with [`StoreError::Corrupt`] if it is damaged (see `open`) or
    /// not a readable store; nothing is discarded in either case.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, &OpenOptions::default())
    }

    /// Open with options: with `recover_damaged`, a store refused by [`RocksStore::open`]
    /// is salvaged (see [`OpenOptions`]) rather than refused.
    pub fn open_with(path: &Path, options: &OpenOptions) -> Result<Self, StoreError> {
        match Self::open_checked(path, Tuning::new(options.unlogged), Mode::Strict) {
            Ok(store) => {
                if options.recover_damaged {
                    tracing::warn!(path = %path.display(), "asked to recover a damaged store, but nothing is damaged: started as usual");
                }
                Ok(store)
            }
            Err(e @ StoreError::Corrupt { .. }) if options.recover_damaged => {
                salvage::salvage(path, e, options.unlogged)
            }
            Err(e) => Err(e),
        }
    }

    /// Open, refuse a store that lost confirmed writes, give every column family its table
    /// file, and scan everything (recovery's reads: damaged table blocks fail here).
    fn open_checked(path: &Path, tuning: Tuning, mode: Mode) -> Result<Self, StoreError> {
        if mode == Mode::Strict && path.join("CURRENT").exists() {
            // Read-only first: RocksDB's own checks, then Warren's, before anything is written.
            let started = std::time::Instant::now();
            let look = open::open_db(path, &tuning, Mode::Check)?;
            open::check_watermark(path, look.latest_sequence_number())?;
            tracing::debug!(took = ?started.elapsed(), "checked the store read-only");
        }
        let db = open::open_db(path, &tuning, mode)?;
        let recovered = db.latest_sequence_number();
        open::ensure_sentinels(&db).map_err(|e| map_err(path, e))?;
        let seq = db.latest_sequence_number();
        let inner = Arc::new(Inner {
            path: path.to_path_buf(),
            recovered_seq: recovered,
            tuning,
            db: RwLock::new(Some(db)),
            refs: Mutex::new(HashMap::new()),
            writing: Mutex::new(()),
            last_logged: AtomicU64::new(seq),
            confirmed: AtomicU64::new(seq),
            recovered: Mutex::new(None),
            health: Mutex::new(Default::default()),
            jobs: Default::default(),
            orphans: Mutex::new(Vec::new()),
            batches: AtomicU64::new(0),
        });
        let scanned = {
            let _w = lock(&inner.writing);
            inner.with_view(|v| v.recover_all())?
        };
        *lock(&inner.recovered) = Some(scanned);
        let threads = maintenance::start(&inner);
        Ok(RocksStore { inner, threads })
    }

    /// Bytes on disk (SST files and logs), for reports and tests.
    pub fn disk_usage(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            std::fs::read_dir(p)
                .map(|rd| {
                    rd.filter_map(Result::ok)
                        .map(|e| match e.metadata() {
                            Ok(m) if m.is_dir() => walk(&e.path()),
                            Ok(m) => m.len(),
                            Err(_) => 0,
                        })
                        .sum()
                })
                .unwrap_or(0)
        }
        walk(&self.inner.path)
    }

    /// Bodies stored once for several queues that are still referred to.
    pub fn shared_bodies(&self) -> usize {
        lock(&self.inner.refs).len()
    }

    /// Bytes in SST files, across all column families (what compaction gives back).
    pub fn sst_bytes(&self) -> u64 {
        self.inner
            .with_view(|v| {
                Ok([META, MESSAGES, SHARED]
                    .iter()
                    .filter_map(|cf| v.db.cf_handle(cf))
                    .filter_map(|h| {
                        v.db.property_int_value_cf(&h, "rocksdb.total-sst-files-size")
                            .ok()
                            .flatten()
                    })
                    .sum())
            })
            .unwrap_or(0)
    }

    /// Table files of each column family (name, file count), for reports and tests.
    pub fn table_files(&self) -> Vec<(String, usize)> {
        self.inner
            .with_view(|v| {
                let files = v.db.live_files().map_err(|e| v.err(e))?;
                Ok([META, MESSAGES, SHARED]
                    .iter()
                    .map(|cf| {
                        let n = files.iter().filter(|f| f.column_family_name == *cf).count();
                        (cf.to_string(), n)
                    })
                    .collect())
            })
            .unwrap_or_default()
    }

    /// How many table files RocksDB may keep open (see [`open::max_open_files`]).
    pub fn max_open_files(&self) -> i32 {
        self.inner.tuning.max_open_files
    }

    /// Compact everything now (space comes back after a drained backlog).
    pub fn compact(&self) {
        let _ = self.inner.with_view(|v| {
            let _c = lock(&self.inner.jobs.compacting);
            for cf in [META, MESSAGES, SHARED] {
                if let Some(h) = v.db.cf_handle(cf) {
                    v.db.compact_range_cf(&h, None::<&[u8]>, None::<&[u8]>);
                }
            }
            Ok(())
        });
    }

    /// Merge runs of small table files now (what the background thread does twice a
    /// second); returns how many runs were merged.
    pub fn merge_small_files(&self) -> usize {
        self.inner
            .with_view(|v| {
                let _c = lock(&self.inner.jobs.compacting);
                Ok(maintenance::merge_small_files(v.db))
            })
            .unwrap_or(0)
    }
}

impl Drop for RocksStore {
    /// Stop the background threads (the last one records the final watermark) before the
    /// database closes with the last handle on `inner`.
    fn drop(&mut self) {
        maintenance::stop(&self.inner, std::mem::take(&mut self.threads));
    }
}

impl Inner {
    /// Run `f` on the open database (an error while a reopen is pending).
    fn with_view<T>(
        &self,
        f: impl FnOnce(&View<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let guard = self.db.read().unwrap_or_else(|e| e.into_inner());
        let Some(db) = guard.as_ref() else {
            return Err(StoreError::Io(format!(
                "{}: the store is closed after a failed write and not reopened yet: {}",
                self.path.display(),
                lock(&self.health).describe()
            )));
        };
        f(&View { db, inner: self })
    }
}

impl View<'_> {
    fn err(&self, e: rocksdb::Error) -> StoreError {
        map_err(&self.inner.path, e)
    }

    fn meta(&self) -> Result<std::sync::Arc<rocksdb::BoundColumnFamily<'_>>, StoreError> {
        self.db
            .cf_handle(META)
            .ok_or_else(|| StoreError::Io("meta column family missing".into()))
    }

    fn messages(&self) -> Result<std::sync::Arc<rocksdb::BoundColumnFamily<'_>>, StoreError> {
        self.db
            .cf_handle(MESSAGES)
            .ok_or_else(|| StoreError::Io("messages column family missing".into()))
    }

    fn shared(&self) -> Result<std::sync::Arc<rocksdb::BoundColumnFamily<'_>>, StoreError> {
        self.db
            .cf_handle(SHARED)
            .ok_or_else(|| StoreError::Io("shared column family missing".into()))
    }

    fn refs(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u32>> {
        lock(&self.inner.refs)
    }

    /// One reference to shared body `id` went; the last one deletes the body.
    fn unref(
        &self,
        refs: &mut HashMap<u64, u32>,
        id: u64,
        batch: &mut WriteBatch,
    ) -> Result<(), StoreError> {
        if let Some(n) = refs.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                refs.remove(&id);
                batch.delete_cf(&self.shared()?, id.to_be_bytes());
            }
        }
        Ok(())
    }

    /// Drop the references held by the entries of the queue with key prefix `prefix` and keys
    /// in `from..=to`: those stored, less those this write removed already, and those this
    /// write put (`pending`: the write is still one batch, see `Pending`).
    fn unref_range(
        &self,
        prefix: &[u8],
        from: u64,
        to: u64,
        batch: &mut WriteBatch,
        pending: &Pending,
    ) -> Result<(), StoreError> {
        let mut refs = self.refs();
        if refs.is_empty() {
            return Ok(());
        }
        let mut ids = BTreeSet::new();
        let start = message_key_bytes(prefix, from);
        let h = self.messages()?;
        for item in self
            .db
            .iterator_cf(&h, IteratorMode::From(&start, Direction::Forward))
        {
            let (k, _) = item.map_err(|e| self.err(e))?;
            if k.len() != prefix.len() + 8 || !k.starts_with(prefix) {
                break;
            }
            let key = self.message_key(&k[prefix.len()..])?;
            if key > to {
                break;
            }
            if !pending.removed(&k) {
                ids.insert(key_id(key));
            }
        }
        let end = message_key_bytes(prefix, to);
        for k in pending.put.range(start..=end) {
            ids.insert(key_id(self.message_key(&k[prefix.len()..])?));
        }
        for id in ids {
            self.unref(&mut refs, id, batch)?;
        }
        Ok(())
    }

    fn message_key(&self, k: &[u8]) -> Result<u64, StoreError> {
        <[u8; 8]>::try_from(k)
            .map(u64::from_be_bytes)
            .map_err(|_| self.corrupt("bad message key".into()))
    }

    /// The body of shared message `id`.
    fn shared_record(&self, id: u64) -> Result<MessageRecord, StoreError> {
        let v = self
            .db
            .get_cf(&self.shared()?, id.to_be_bytes())
            .map_err(|e| self.err(e))?
            .ok_or_else(|| self.corrupt(format!("shared message {id} missing")))?;
        MessageRecord::decode(Bytes::from(v)).map_err(|e| self.corrupt(e.to_string()))
    }

    fn meta_entities(&self, prefix: u8) -> Result<Vec<(u8, String, String, Bytes)>, StoreError> {
        let meta = self.meta()?;
        let mut out = Vec::new();
        for item in self.db.prefix_iterator_cf(&meta, [prefix]) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            if k.first() != Some(&prefix) {
                break;
            }
            let (p, vhost, name) = decode_entity_key(Bytes::copy_from_slice(&k))
                .map_err(|e| self.corrupt(e.to_string()))?;
            out.push((p, vhost, name, Bytes::copy_from_slice(&v)));
        }
        Ok(out)
    }

    fn corrupt(&self, detail: String) -> StoreError {
        StoreError::Corrupt {
            path: self.inner.path.clone(),
            detail,
        }
    }

    fn bindings_matching(
        &self,
        vhost: &str,
        matches: impl Fn(&BindingKey) -> bool,
    ) -> Result<Vec<Bytes>, StoreError> {
        let meta = self.meta()?;
        let mut keys = Vec::new();
        for item in self.db.prefix_iterator_cf(&meta, [BINDING_PREFIX]) {
            let (k, _) = item.map_err(|e| self.err(e))?;
            if k.first() != Some(&BINDING_PREFIX) {
                break;
            }
            let key = Bytes::copy_from_slice(&k);
            let b = BindingKey::decode(key.clone()).map_err(|e| self.corrupt(e.to_string()))?;
            if b.vhost == vhost && matches(&b) {
                keys.push(key);
            }
        }
        Ok(keys)
    }

    /// A logged write. Callers hold `Inner::writing`: the sequence number read after it is
    /// this write's.
    fn commit(&self, batch: WriteBatch, sync: bool) -> Result<(), StoreError> {
        if self.inner.tuning.unlogged {
            self.commit_unlogged(batch)?;
            self.inner
                .last_logged
                .store(self.db.latest_sequence_number(), Ordering::Release);
            if sync {
                self.persist()?;
            }
            return Ok(());
        }
        let mut opts = WriteOptions::default();
        opts.set_sync(sync);
        self.inner.batches.fetch_add(1, Ordering::Relaxed);
        self.db.write_opt(batch, &opts).map_err(|e| self.err(e))?;
        let seq = self.db.latest_sequence_number();
        self.inner.last_logged.store(seq, Ordering::Release);
        if sync {
            self.inner.confirmed.fetch_max(seq, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Make every write so far durable: fsync the log, or (unlogged) flush every column
    /// family's memtable to table files, all at one point (`atomic_flush`). Writes may go on
    /// meanwhile (they go to new memtables). An unlogged flush holds `Jobs::compacting`, as
    /// the compaction thread does: a flush forced now must not meet `reclaim` dropping files.
    fn persist(&self) -> Result<(), StoreError> {
        let seq = self.db.latest_sequence_number();
        if self.inner.tuning.unlogged {
            let _c = lock(&self.inner.jobs.compacting);
            let (meta, messages, shared) = (self.meta()?, self.messages()?, self.shared()?);
            let mut wait = rocksdb::FlushOptions::default();
            wait.set_wait(true);
            self.db
                .flush_cfs_opt(&[&meta, &messages, &shared], &wait)
                .map_err(|e| self.err(e))?;
        } else {
            self.db.flush_wal(true).map_err(|e| self.err(e))?;
        }
        self.inner.confirmed.fetch_max(seq, Ordering::AcqRel);
        Ok(())
    }

    fn commit_unlogged(&self, batch: WriteBatch) -> Result<(), StoreError> {
        let mut opts = WriteOptions::default();
        opts.disable_wal(true);
        self.inner.batches.fetch_add(1, Ordering::Relaxed);
        self.db.write_opt(batch, &opts).map_err(|e| self.err(e))
    }

    /// Count the references to shared bodies again from what is stored (after a failed write
    /// left the in-memory counts unsure).
    fn recount_refs(&self) -> Result<(), StoreError> {
        let shared = self.shared()?;
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for item in self.db.iterator_cf(&shared, IteratorMode::Start) {
            let (k, _) = item.map_err(|e| self.err(e))?;
            if *k == *SENTINEL {
                continue;
            }
            counts.insert(self.message_key(&k)?, 0);
        }
        let messages = self.messages()?;
        for item in self.db.iterator_cf(&messages, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            if v.len() == 1 && v[0] == SHARED_TAG && k.len() >= 8 {
                let key = self.message_key(&k[k.len() - 8..])?;
                if let Some(n) = counts.get_mut(&key_id(key)) {
                    *n += 1;
                }
            }
        }
        counts.retain(|_, n| *n > 0);
        *self.refs() = counts;
        Ok(())
    }
}

/// The two batches of one `write`: logged (write-ahead log) and unlogged (spills). Ops are
/// applied in order, so switching from one kind to the other writes what came before first.
struct Batches {
    logged: WriteBatch,
    unlogged: WriteBatch,
    /// A logged batch was written unsynced (the final sync must cover it).
    logged_written: bool,
    /// Key ranges (inclusive) deleted by this write whose table files may be dropped once it
    /// is synced: ranges nothing later in the same write put keys into again.
    reclaim: Vec<(Vec<u8>, Vec<u8>)>,
    pending: Pending,
}

/// The queue entries referring to shared (fan-out) bodies that this write put or removed so
/// far, by full message key. A range removal (purge, queue deletion, `RemoveRange`) drops the
/// references of the entries in its range: those stored (read from the store) and those still
/// pending in this write's batch, which a read does not see. Before, the range removal wrote
/// what was pending first: in an unlogged store (a cluster node) that split one write in two,
/// and a memtable flush between them followed by a crash left the first part on disk without
/// the applied position, so the node applied that entry a second time (a duplicate in its
/// queue). Entries that refer to no shared body need no record: dropping them drops nothing.
#[derive(Default)]
struct Pending {
    /// Shared-body entries put by this write (and not removed since).
    put: BTreeSet<Vec<u8>>,
    /// Shared-body entries removed one by one by this write (stored or put by it).
    removed: HashSet<Vec<u8>>,
    /// Key ranges (inclusive) removed by this write.
    ranges: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Pending {
    fn put(&mut self, key: &[u8]) {
        self.removed.remove(key);
        self.put.insert(key.to_vec());
    }

    /// Always recorded as removed, also when this write put it: a logged store commits part
    /// of a write when it switches between logged ops and spills, so a put of this write may
    /// be stored already.
    fn remove(&mut self, key: &[u8]) {
        self.put.remove(key);
        self.removed.insert(key.to_vec());
    }

    fn remove_range(&mut self, from: Vec<u8>, to: Vec<u8>) {
        let inside: Vec<Vec<u8>> = self.put.range(from.clone()..=to.clone()).cloned().collect();
        for k in inside {
            self.put.remove(&k);
        }
        self.ranges.push((from, to));
    }

    /// Whether this write already removed the stored entry `key` (its references are dropped).
    fn removed(&self, key: &[u8]) -> bool {
        self.removed.contains(key)
            || self
                .ranges
                .iter()
                .any(|(from, to)| &from[..] <= key && key <= &to[..])
    }
}

impl Batches {
    fn logged(&mut self, store: &View<'_>) -> Result<&mut WriteBatch, StoreError> {
        if !self.unlogged.is_empty() {
            store.commit_unlogged(std::mem::take(&mut self.unlogged))?;
        }
        Ok(&mut self.logged)
    }

    fn unlogged(&mut self, store: &View<'_>) -> Result<&mut WriteBatch, StoreError> {
        if store.inner.tuning.unlogged {
            // Nothing is logged: one batch, so that the write (with its applied position) is
            // one atomic write, which a flush cannot split.
            return Ok(&mut self.logged);
        }
        if !self.logged.is_empty() {
            store.commit(std::mem::take(&mut self.logged), false)?;
            self.logged_written = true;
        }
        Ok(&mut self.unlogged)
    }

    fn finish(mut self, store: &View<'_>, sync: bool) -> Result<(), StoreError> {
        if !self.unlogged.is_empty() {
            store.commit_unlogged(std::mem::take(&mut self.unlogged))?;
        }
        if !self.logged.is_empty() {
            store.commit(std::mem::take(&mut self.logged), sync)?;
        } else if sync && self.logged_written {
            if store.inner.tuning.unlogged {
                store.persist()?;
            } else {
                store.db.flush_wal(true).map_err(|e| store.err(e))?;
                // Everything logged so far is on disk; spills written since were not logged.
                let logged = store.inner.last_logged.load(Ordering::Acquire);
                store.inner.confirmed.fetch_max(logged, Ordering::AcqRel);
            }
        }
        Ok(())
    }
}

/// A key written by a later op of the same write: a range deleted earlier in it must keep its
/// table files (`View::reclaim`).
fn keep_out_of_reclaim(reclaim: &mut Vec<(Vec<u8>, Vec<u8>)>, key: &[u8]) {
    if !reclaim.is_empty() {
        reclaim.retain(|(from, to)| !(&from[..] <= key && key <= &to[..]));
    }
}

/// A queue's scan at recovery: its key prefix, whether it is declared, and (key, body size,
/// carries an expiration) of each message.
type Scan = (Vec<u8>, bool, Vec<(u64, u64, bool)>);

/// The meta key of `Store::write_applied`'s position. Recovery reads definitions by their
/// prefixes (X, Q, B, U), so it never sees this one.
const APPLIED_KEY: &[u8] = b"R:applied";

impl Store for RocksStore {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        self.write_with(ops, None, sync)
    }

    fn write_applied(&self, ops: &[Op], applied: &[u8], sync: bool) -> Result<(), StoreError> {
        self.write_with(ops, Some(applied), sync)
    }

    fn snapshot_to(&self, sink: &mut dyn warren_storage::SnapshotSink) -> Result<(), StoreError> {
        self.inner.with_view(|v| {
            // A RocksDB snapshot, taken between two writes: read out after the writer may go
            // on, without holding anything but the files it needs.
            let snap = {
                let _w = lock(&self.inner.writing);
                v.db.snapshot()
            };
            sink.taken();
            v.stream_snapshot(&snap, sink)
        })
    }

    fn persist(&self) -> Result<(), StoreError> {
        self.inner.with_view(|v| v.persist())
    }

    fn applied(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.with_view(|v| {
            let meta = v.meta()?;
            v.db.get_cf(&meta, APPLIED_KEY).map_err(|e| v.err(e))
        })
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        RocksStore::recover_store(self)
    }

    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        RocksStore::read_store(self, vhost, queue, from, to, max_count, max_bytes)
    }
}

impl RocksStore {
    fn write_with(&self, ops: &[Op], applied: Option<&[u8]>, sync: bool) -> Result<(), StoreError> {
        // The scan made at open no longer describes the store.
        lock(&self.inner.recovered).take();
        let _w = lock(&self.inner.writing);
        self.inner.with_view(|v| {
            let shares = !v.refs().is_empty()
                || ops
                    .iter()
                    .any(|op| matches!(op, Op::Enqueue { queues, .. } if queues.len() > 1));
            let result = v.write_ops(ops, applied, sync);
            if let Err(e) = &result {
                if shares {
                    // The reference counts were changed while the batch was built; what
                    // reached the disk is the truth: count again (a count left too low would
                    // delete a body that a queue still refers to).
                    if let Err(e) = v.recount_refs() {
                        tracing::error!(error = %e, "recounting shared message references failed");
                    }
                }
                maintenance::after_failed_write(v, e);
            }
            result
        })
    }

    fn recover_store(&self) -> Result<Recovered, StoreError> {
        if let Some(scanned) = lock(&self.inner.recovered).take() {
            return Ok(scanned);
        }
        let _w = lock(&self.inner.writing);
        self.inner.with_view(|v| v.recover_all())
    }

    #[allow(clippy::too_many_arguments)]
    fn read_store(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        self.inner
            .with_view(|v| v.read_range(vhost, queue, from, to, max_count, max_bytes))
    }
}

impl View<'_> {
    fn write_ops(&self, ops: &[Op], applied: Option<&[u8]>, sync: bool) -> Result<(), StoreError> {
        let meta = self.meta()?;
        let messages = self.messages()?;
        let shared = self.shared()?;
        let mut b = Batches {
            logged: WriteBatch::default(),
            unlogged: WriteBatch::default(),
            logged_written: false,
            reclaim: Vec::new(),
            pending: Pending::default(),
        };
        // Bindings put earlier in this batch (a later delete in the batch must see them too).
        let mut added: Vec<BindingKey> = Vec::new();
        // Keys and values are built in these and copied by the batch: no allocation per message.
        let mut key_buf = Vec::new();
        let mut value_buf = Vec::new();
        for op in ops {
            match op {
                Op::DeclareExchange {
                    vhost,
                    name,
                    kind,
                    durable,
                    auto_delete,
                    internal,
                    arguments,
                } => {
                    let rec = ExchangeRecord {
                        kind: kind.clone(),
                        durable: *durable,
                        auto_delete: *auto_delete,
                        internal: *internal,
                        arguments: arguments.clone(),
                    };
                    b.logged(self)?.put_cf(
                        &meta,
                        entity_key(EXCHANGE_PREFIX, vhost, name),
                        rec.encode(),
                    );
                }
                Op::DeleteExchange { vhost, name } => {
                    let batch = b.logged(self)?;
                    batch.delete_cf(&meta, entity_key(EXCHANGE_PREFIX, vhost, name));
                    let dest = BindingDest::Exchange(name.clone());
                    let hit = |b: &BindingKey| {
                        b.vhost == *vhost && (b.source == *name || b.destination == dest)
                    };
                    for k in self.bindings_matching(vhost, hit)? {
                        batch.delete_cf(&meta, k);
                    }
                    for b in added.iter().filter(|b| hit(b)) {
                        batch.delete_cf(&meta, b.encode());
                    }
                }
                Op::DeclareQueue {
                    vhost,
                    name,
                    durable,
                    exclusive,
                    auto_delete,
                    arguments,
                } => {
                    let rec = QueueRecord {
                        durable: *durable,
                        exclusive: *exclusive,
                        auto_delete: *auto_delete,
                        arguments: arguments.clone(),
                    };
                    b.logged(self)?.put_cf(
                        &meta,
                        entity_key(QUEUE_PREFIX, vhost, name),
                        rec.encode(),
                    );
                }
                Op::DeleteQueue { vhost, name } => {
                    self.remove_range(&mut b, &queue_prefix(vhost, name), 0, u64::MAX)?;
                    let batch = b.logged(self)?;
                    batch.delete_cf(&meta, entity_key(QUEUE_PREFIX, vhost, name));
                    let dest = BindingDest::Queue(name.clone());
                    for k in self.bindings_matching(vhost, |b| b.destination == dest)? {
                        batch.delete_cf(&meta, k);
                    }
                    for b in added
                        .iter()
                        .filter(|b| b.vhost == *vhost && b.destination == dest)
                    {
                        batch.delete_cf(&meta, b.encode());
                    }
                }
                Op::Bind {
                    vhost,
                    source,
                    destination,
                    routing_key,
                    arguments,
                } => {
                    let key = BindingKey {
                        vhost: vhost.clone(),
                        source: source.clone(),
                        destination: destination.clone(),
                        routing_key: routing_key.clone(),
                        arguments: arguments.clone(),
                    };
                    b.logged(self)?.put_cf(&meta, key.encode(), []);
                    added.push(key);
                }
                Op::Unbind {
                    vhost,
                    source,
                    destination,
                    routing_key,
                    arguments,
                } => {
                    let key = BindingKey {
                        vhost: vhost.clone(),
                        source: source.clone(),
                        destination: destination.clone(),
                        routing_key: routing_key.clone(),
                        arguments: arguments.clone(),
                    };
                    b.logged(self)?.delete_cf(&meta, key.encode());
                }
                Op::Enqueue {
                    vhost, queues, id, ..
                } => {
                    op.message_value_into(&mut value_buf);
                    let value = &value_buf;
                    // Writes pending spills first; then the logged batch and the reclaim list
                    // are borrowed apart.
                    b.logged(self)?;
                    let (batch, reclaim, pending) = (&mut b.logged, &mut b.reclaim, &mut b.pending);
                    if let [(q, level)] = &queues[..] {
                        let key = warren_storage::message_key(*level, *id);
                        let k = message_key_in(&mut key_buf, vhost, q, key);
                        keep_out_of_reclaim(reclaim, k);
                        batch.put_cf(&messages, k, value);
                    } else if queues.len() > 1 {
                        batch.put_cf(&shared, id.to_be_bytes(), value);
                        for (q, level) in queues {
                            let key = warren_storage::message_key(*level, *id);
                            let k = message_key_in(&mut key_buf, vhost, q, key);
                            keep_out_of_reclaim(reclaim, k);
                            batch.put_cf(&messages, k, [SHARED_TAG]);
                            pending.put(k);
                        }
                        self.refs().insert(*id, queues.len() as u32);
                    }
                }
                Op::Remove {
                    vhost, queue, keys, ..
                } => {
                    b.logged(self)?;
                    let (batch, pending) = (&mut b.logged, &mut b.pending);
                    let mut refs = self.refs();
                    for k in keys {
                        let key = message_key_in(&mut key_buf, vhost, queue, *k);
                        batch.delete_cf(&messages, key);
                        if !refs.is_empty() {
                            if refs.contains_key(&key_id(*k)) {
                                pending.remove(key);
                            }
                            self.unref(&mut refs, key_id(*k), batch)?;
                        }
                    }
                }
                Op::Purge { vhost, queue } => {
                    self.remove_range(&mut b, &queue_prefix(vhost, queue), 0, u64::MAX)?;
                }
                Op::RemoveRange {
                    vhost,
                    queue,
                    from,
                    to,
                    ..
                } => {
                    self.remove_range(&mut b, &queue_prefix(vhost, queue), *from, *to)?;
                }
                Op::Spill {
                    vhost, queue, key, ..
                } => {
                    let k = message_key_in(&mut key_buf, vhost, queue, *key);
                    keep_out_of_reclaim(&mut b.reclaim, k);
                    let mut refs = self.refs();
                    let batch = b.unlogged(self)?;
                    // A body stored for other queues already: refer to it.
                    if let Some(n) = refs.get_mut(&key_id(*key)) {
                        *n += 1;
                        batch.put_cf(&messages, k, [SHARED_TAG]);
                        b.pending.put(k);
                    } else {
                        op.message_value_into(&mut value_buf);
                        batch.put_cf(&messages, k, &value_buf);
                    }
                }
                Op::PutUser {
                    name,
                    password_hash,
                    tags,
                } => {
                    let rec = UserRecord {
                        password_hash: password_hash.clone(),
                        tags: tags.clone(),
                    };
                    b.logged(self)?
                        .put_cf(&meta, entity_key(USER_PREFIX, "", name), rec.encode());
                }
                Op::DeleteUser { name } => {
                    b.logged(self)?
                        .delete_cf(&meta, entity_key(USER_PREFIX, "", name));
                }
                Op::PutVhost {
                    name,
                    description,
                    tags,
                } => {
                    let rec = VhostRecord {
                        description: description.clone(),
                        tags: tags.clone(),
                    };
                    b.logged(self)?
                        .put_cf(&meta, entity_key(VHOST_PREFIX, "", name), rec.encode());
                }
                // The vhost's queues and exchanges come as ops of their own (the apply's
                // cascade): only the record goes here.
                Op::DeleteVhost { name } => {
                    b.logged(self)?
                        .delete_cf(&meta, entity_key(VHOST_PREFIX, "", name));
                }
                Op::SetPermissions {
                    user,
                    vhost,
                    configure,
                    write,
                    read,
                } => {
                    let rec = PermissionRecord {
                        configure: configure.clone(),
                        write: write.clone(),
                        read: read.clone(),
                    };
                    b.logged(self)?.put_cf(
                        &meta,
                        entity_key(PERMISSION_PREFIX, vhost, user),
                        rec.encode(),
                    );
                }
                Op::ClearPermissions { user, vhost } => {
                    b.logged(self)?
                        .delete_cf(&meta, entity_key(PERMISSION_PREFIX, vhost, user));
                }
                Op::PutVhostLimits {
                    vhost: name,
                    limits,
                }
                | Op::PutUserLimits { user: name, limits } => {
                    let prefix = if matches!(op, Op::PutVhostLimits { .. }) {
                        VHOST_LIMITS_PREFIX
                    } else {
                        USER_LIMITS_PREFIX
                    };
                    let key = entity_key(prefix, "", name);
                    let batch = b.logged(self)?;
                    if limits.is_empty() {
                        batch.delete_cf(&meta, key);
                    } else {
                        let rec = LimitsRecord {
                            limits: limits.clone(),
                        };
                        batch.put_cf(&meta, key, rec.encode());
                    }
                }
                Op::SetTopicPermissions {
                    user,
                    vhost,
                    exchange,
                    write,
                    read,
                } => {
                    let rec = TopicPermissionRecord {
                        write: write.clone(),
                        read: read.clone(),
                    };
                    let name = topic_permission_name(user, exchange);
                    b.logged(self)?.put_cf(
                        &meta,
                        entity_key(TOPIC_PERMISSION_PREFIX, vhost, &name),
                        rec.encode(),
                    );
                }
                Op::ClearTopicPermissions {
                    user,
                    vhost,
                    exchange,
                } => {
                    // One exchange's, or (exchange "") all of the user's in the vhost.
                    let mut gone = Vec::new();
                    if exchange.is_empty() {
                        for (_, v, name, _) in self.meta_entities(TOPIC_PERMISSION_PREFIX)? {
                            if v == *vhost
                                && split_topic_permission_name(&name)
                                    .is_some_and(|(u, _)| u == user)
                            {
                                gone.push(entity_key(TOPIC_PERMISSION_PREFIX, vhost, &name));
                            }
                        }
                    } else {
                        let name = topic_permission_name(user, exchange);
                        gone.push(entity_key(TOPIC_PERMISSION_PREFIX, vhost, &name));
                    }
                    let batch = b.logged(self)?;
                    for k in gone {
                        batch.delete_cf(&meta, k);
                    }
                }
            }
        }
        if let Some(a) = applied {
            // In the logged batch that ends the write: the position is on disk with (never
            // before) what it covers.
            b.logged(self)?.put_cf(&meta, APPLIED_KEY, a);
        }
        let reclaim = std::mem::take(&mut b.reclaim);
        b.finish(self, sync)?;
        if !reclaim.is_empty() {
            self.reclaim(reclaim, sync);
        }
        Ok(())
    }

    /// Give back the space of key ranges this write deleted: table files holding nothing but
    /// keys in a range are dropped now (no I/O); the rest is compacted in the background.
    ///
    /// Why dropping files is safe here: the write's range tombstones are synced (a crash
    /// cannot bring the files' keys back; an unsynced write only queues the compaction), no
    /// later op of the write put keys into the range (see `keep_out_of_reclaim`), and no other
    /// write runs meanwhile (`Inner::writing`). The tombstones themselves are still in the
    /// memtable: only a flush right now could put them in a file, and only the compaction
    /// thread forces one (`compact_range` flushes a memtable that overlaps its range), so
    /// files are dropped only while it is idle (`Jobs::compacting`). RocksDB never drops
    /// level-0 files this way.
    fn reclaim(&self, ranges: Vec<(Vec<u8>, Vec<u8>)>, synced: bool) {
        if synced {
            if let (Ok(_idle), Ok(messages)) =
                (self.inner.jobs.compacting.try_lock(), self.messages())
            {
                for (from, to) in &ranges {
                    if let Err(e) = self.db.delete_file_in_range_cf(&messages, from, to) {
                        tracing::debug!(error = %e, "dropping the table files of a deleted range");
                    }
                }
            }
        }
        self.inner.jobs.compact_later(ranges);
    }

    fn recover_all(&self) -> Result<Recovered, StoreError> {
        let mut ops = Vec::new();
        for (_, _, name, v) in self.meta_entities(USER_PREFIX)? {
            let u = UserRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_user(&name, &u));
        }
        for (_, _, name, v) in self.meta_entities(VHOST_PREFIX)? {
            let x = VhostRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_vhost(&name, &x));
        }
        for (_, vhost, user, v) in self.meta_entities(PERMISSION_PREFIX)? {
            let p = PermissionRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::set_permissions(&vhost, &user, &p));
        }
        for (_, _, name, v) in self.meta_entities(VHOST_LIMITS_PREFIX)? {
            let l = LimitsRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_vhost_limits(&name, &l));
        }
        for (_, _, name, v) in self.meta_entities(USER_LIMITS_PREFIX)? {
            let l = LimitsRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_user_limits(&name, &l));
        }
        for (_, vhost, name, v) in self.meta_entities(TOPIC_PERMISSION_PREFIX)? {
            let p = TopicPermissionRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            let (user, exchange) = split_topic_permission_name(&name)
                .ok_or_else(|| self.corrupt(format!("topic permission key {name:?}")))?;
            ops.push(warren_storage::op::set_topic_permissions(
                &vhost, user, exchange, &p,
            ));
        }
        for (_, vhost, name, v) in self.meta_entities(EXCHANGE_PREFIX)? {
            let x = ExchangeRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::declare_exchange(&vhost, &name, &x));
        }
        let queues = self.meta_entities(QUEUE_PREFIX)?;
        let mut known = std::collections::HashSet::new();
        for (_, vhost, name, v) in &queues {
            let q = QueueRecord::decode(v.clone()).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::declare_queue(vhost, name, &q));
            known.insert(queue_prefix(vhost, name));
        }
        let meta = self.meta()?;
        for item in self.db.prefix_iterator_cf(&meta, [BINDING_PREFIX]) {
            let (k, _) = item.map_err(|e| self.err(e))?;
            if k.first() != Some(&BINDING_PREFIX) {
                break;
            }
            let b = BindingKey::decode(Bytes::copy_from_slice(&k))
                .map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::bind(&b));
        }
        // Shared bodies: their sizes, then the references the queues hold.
        let shared = self.shared()?;
        // id -> (references, body size, carries an expiration)
        let mut sizes: HashMap<u64, (u32, u64, bool)> = HashMap::new();
        for item in self.db.iterator_cf(&shared, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            if *k == *SENTINEL {
                continue;
            }
            let id = self.message_key(&k)?;
            let m = MessageRecord::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?;
            let expires = warren_storage::has_expiration(&m.properties);
            sizes.insert(id, (0, m.body.len() as u64, expires));
        }
        // One pass over every queue's messages, queue by queue (keys sort by queue).
        let messages = self.messages()?;
        let mut summaries = Vec::new();
        let mut current: Option<Scan> = None;
        let mut cleanup = WriteBatch::default();
        // Prefixes of queues without a definition, and how many messages each had.
        let mut orphan_prefixes: Vec<(Vec<u8>, u64)> = Vec::new();
        let finish =
            |cur: Option<Scan>, summaries: &mut Vec<QueueSummary>| -> Result<(), StoreError> {
                if let Some((prefix, true, entries)) = cur {
                    let (_, vhost, name) = decode_entity_key(Bytes::from(prefix))
                        .map_err(|e| self.corrupt(e.to_string()))?;
                    summaries.push(QueueSummary {
                        vhost,
                        name,
                        levels: warren_storage::mem::summarize(entries.into_iter()),
                    });
                }
                Ok(())
            };
        for item in self.db.iterator_cf(&messages, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            if *k == *SENTINEL {
                continue;
            }
            if k.len() < 8 {
                return Err(self.corrupt("bad message key".into()));
            }
            let (prefix, key) = k.split_at(k.len() - 8);
            let key = self.message_key(key)?;
            if current.as_ref().map(|c| &c.0[..]) != Some(prefix) {
                finish(current.take(), &mut summaries)?;
                let live = known.contains(prefix);
                if !live {
                    // Messages of a queue whose definition is gone (a non-durable queue's
                    // spills, or a crash between a delete's two steps).
                    orphan_prefixes.push((prefix.to_vec(), 0));
                }
                current = Some((prefix.to_vec(), live, Vec::new()));
            }
            let Some((_, live, entries)) = current.as_mut() else {
                continue;
            };
            if !*live {
                if let Some((_, n)) = orphan_prefixes.last_mut() {
                    *n += 1;
                }
                continue;
            }
            match MessageEntry::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?
            {
                MessageEntry::Whole(m) => entries.push((
                    key,
                    m.body.len() as u64,
                    warren_storage::has_expiration(&m.properties),
                )),
                MessageEntry::Shared => match sizes.get_mut(&key_id(key)) {
                    Some((n, size, expires)) => {
                        *n += 1;
                        entries.push((key, *size, *expires));
                    }
                    None => {
                        // Nothing to deliver: say so and drop the dangling reference.
                        tracing::error!(
                            id = key_id(key),
                            "a queue refers to a shared message body that is missing; dropped"
                        );
                        cleanup.delete_cf(&messages, &k);
                    }
                },
                MessageEntry::Spilled(_) => cleanup.delete_cf(&messages, &k),
            }
        }
        finish(current.take(), &mut summaries)?;
        let mut reclaim = Vec::new();
        let mut orphans = Vec::new();
        for (prefix, n) in &orphan_prefixes {
            if let Ok((_, vhost, name)) = decode_entity_key(Bytes::copy_from_slice(prefix)) {
                orphans.push((vhost, name, *n));
            }
            reclaim.push((
                message_key_bytes(prefix, 0),
                message_key_bytes(prefix, u64::MAX),
            ));
            cleanup.delete_range_cf(
                &messages,
                message_key_bytes(prefix, 0),
                message_key_bytes(prefix, u64::MAX),
            );
            cleanup.delete_cf(&messages, message_key_bytes(prefix, u64::MAX));
        }
        // Bodies nothing refers to any more go.
        let mut refs = self.refs();
        refs.clear();
        for (id, (n, _, _)) in sizes {
            if n == 0 {
                cleanup.delete_cf(&shared, id.to_be_bytes());
            } else {
                refs.insert(id, n);
            }
        }
        drop(refs);
        if !cleanup.is_empty() {
            self.commit(cleanup, true)?;
        }
        if !reclaim.is_empty() {
            self.reclaim(reclaim, true);
        }
        *lock(&self.inner.orphans) = orphans;
        Ok(Recovered {
            ops,
            queues: summaries,
        })
    }

    /// See `Store::snapshot_to`: everything read from `snap`.
    fn stream_snapshot(
        &self,
        snap: &rocksdb::SnapshotWithThreadMode<'_, Db>,
        sink: &mut dyn warren_storage::SnapshotSink,
    ) -> Result<(), StoreError> {
        let meta = self.meta()?;
        let entities = |prefix: u8| -> Result<Vec<(String, String, Bytes)>, StoreError> {
            let mut out = Vec::new();
            for item in snap.iterator_cf(&meta, IteratorMode::From(&[prefix], Direction::Forward)) {
                let (k, v) = item.map_err(|e| self.err(e))?;
                if k.first() != Some(&prefix) {
                    break;
                }
                let (_, vhost, name) = decode_entity_key(Bytes::copy_from_slice(&k))
                    .map_err(|e| self.corrupt(e.to_string()))?;
                out.push((vhost, name, Bytes::copy_from_slice(&v)));
            }
            Ok(out)
        };
        let mut ops = Vec::new();
        for (_, name, v) in entities(USER_PREFIX)? {
            let u = UserRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_user(&name, &u));
        }
        for (_, name, v) in entities(VHOST_PREFIX)? {
            let x = VhostRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_vhost(&name, &x));
        }
        for (vhost, user, v) in entities(PERMISSION_PREFIX)? {
            let p = PermissionRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::set_permissions(&vhost, &user, &p));
        }
        for (_, name, v) in entities(VHOST_LIMITS_PREFIX)? {
            let l = LimitsRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_vhost_limits(&name, &l));
        }
        for (_, name, v) in entities(USER_LIMITS_PREFIX)? {
            let l = LimitsRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::put_user_limits(&name, &l));
        }
        for (vhost, name, v) in entities(TOPIC_PERMISSION_PREFIX)? {
            let p = TopicPermissionRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            let (user, exchange) = split_topic_permission_name(&name)
                .ok_or_else(|| self.corrupt(format!("topic permission key {name:?}")))?;
            ops.push(warren_storage::op::set_topic_permissions(
                &vhost, user, exchange, &p,
            ));
        }
        for (vhost, name, v) in entities(EXCHANGE_PREFIX)? {
            let x = ExchangeRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::declare_exchange(&vhost, &name, &x));
        }
        let mut queues: HashMap<Vec<u8>, (String, String)> = HashMap::new();
        for (vhost, name, v) in entities(QUEUE_PREFIX)? {
            let q = QueueRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::declare_queue(&vhost, &name, &q));
            queues.insert(queue_prefix(&vhost, &name), (vhost, name));
        }
        for item in snap.iterator_cf(
            &meta,
            IteratorMode::From(&[BINDING_PREFIX], Direction::Forward),
        ) {
            let (k, _) = item.map_err(|e| self.err(e))?;
            if k.first() != Some(&BINDING_PREFIX) {
                break;
            }
            let b = BindingKey::decode(Bytes::copy_from_slice(&k))
                .map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(warren_storage::op::bind(&b));
        }
        if !sink.ops(std::mem::take(&mut ops))? {
            return Ok(());
        }
        let (messages, shared) = (self.messages()?, self.shared()?);
        let mut bytes = 0;
        for item in snap.iterator_cf(&messages, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            if *k == *SENTINEL {
                continue;
            }
            if k.len() < 8 {
                return Err(self.corrupt("bad message key".into()));
            }
            let (prefix, key) = k.split_at(k.len() - 8);
            let Some((vhost, name)) = queues.get(prefix) else {
                continue;
            };
            let key = self.message_key(key)?;
            let m = match MessageEntry::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?
            {
                MessageEntry::Whole(m) => m,
                MessageEntry::Shared => {
                    let id = key_id(key);
                    let v = snap
                        .get_cf(&shared, id.to_be_bytes())
                        .map_err(|e| self.err(e))?
                        .ok_or_else(|| self.corrupt(format!("shared message {id} missing")))?;
                    MessageRecord::decode(Bytes::from(v))
                        .map_err(|e| self.corrupt(e.to_string()))?
                }
                MessageEntry::Spilled(_) => continue,
            };
            bytes += m.body.len();
            ops.push(Op::Enqueue {
                vhost: vhost.as_str().into(),
                queues: std::iter::once((name.as_str().into(), warren_storage::key_level(key)))
                    .collect(),
                id: key_id(key),
                timestamp_ms: m.timestamp_ms,
                exchange: m.exchange.as_str().into(),
                routing_key: m.routing_key.as_str().into(),
                properties: m.properties,
                body: m.body,
            });
            if ops.len() >= warren_storage::SNAPSHOT_GROUP_OPS
                || bytes >= warren_storage::SNAPSHOT_GROUP_BYTES
            {
                bytes = 0;
                if !sink.ops(std::mem::take(&mut ops))? {
                    return Ok(());
                }
            }
        }
        if !ops.is_empty() {
            sink.ops(ops)?;
        }
        Ok(())
    }

    fn read_range(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let mut out = Vec::new();
        let prefix = queue_prefix(vhost, queue);
        let h = self.messages()?;
        let mut opts = ReadOptions::default();
        if to < u64::MAX {
            opts.set_iterate_upper_bound(message_key_bytes(&prefix, to + 1));
        }
        let start = message_key_bytes(&prefix, from);
        let mut bytes = 0;
        for item in
            self.db
                .iterator_cf_opt(&h, opts, IteratorMode::From(&start, Direction::Forward))
        {
            if out.len() >= max_count || (bytes >= max_bytes && !out.is_empty()) {
                break;
            }
            let (k, v) = item.map_err(|e| self.err(e))?;
            if k.len() != prefix.len() + 8 || !k.starts_with(&prefix) {
                break;
            }
            let key = self.message_key(&k[prefix.len()..])?;
            let m = match MessageEntry::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?
            {
                MessageEntry::Whole(m) | MessageEntry::Spilled(m) => m,
                MessageEntry::Shared => self.shared_record(key_id(key))?,
            };
            bytes += m.body.len();
            out.push(StoredMessage {
                key,
                timestamp_ms: m.timestamp_ms,
                exchange: m.exchange,
                routing_key: m.routing_key,
                properties: m.properties,
                body: m.body,
            });
        }
        Ok(out)
    }
}

impl View<'_> {
    /// Delete the messages of the queue with key prefix `prefix` and keys in `from..=to` (a
    /// range tombstone: compaction reclaims the space), dropping the shared bodies they refer
    /// to.
    fn remove_range(
        &self,
        b: &mut Batches,
        prefix: &[u8],
        from: u64,
        to: u64,
    ) -> Result<(), StoreError> {
        if from > to {
            // An empty range (a replicated op is decoded, not trusted): nothing to remove, and
            // the key ranges below would be inverted.
            return Ok(());
        }
        let messages = self.messages()?;
        b.logged(self)?;
        self.unref_range(prefix, from, to, &mut b.logged, &b.pending)?;
        b.pending.remove_range(
            message_key_bytes(prefix, from),
            message_key_bytes(prefix, to),
        );
        let batch = &mut b.logged;
        if to == u64::MAX {
            batch.delete_range_cf(
                &messages,
                message_key_bytes(prefix, from),
                message_key_bytes(prefix, u64::MAX),
            );
            batch.delete_cf(&messages, message_key_bytes(prefix, u64::MAX));
        } else {
            batch.delete_range_cf(
                &messages,
                message_key_bytes(prefix, from),
                message_key_bytes(prefix, to + 1),
            );
        }
        b.reclaim.push((
            message_key_bytes(prefix, from),
            message_key_bytes(prefix, to),
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn declare(name: &str) -> Op {
        Op::DeclareQueue {
            vhost: "/".into(),
            name: name.into(),
            durable: true,
            exclusive: false,
            auto_delete: false,
            arguments: Bytes::from_static(&[0, 0, 0, 0]),
        }
    }

    fn fanned(id: u64) -> Op {
        Op::Enqueue {
            vhost: "/".into(),
            queues: vec![("a".into(), 0), ("b".into(), 0)].into(),
            id,
            timestamp_ms: 0,
            exchange: "".into(),
            routing_key: "".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"shared").into(),
        }
    }

    /// Reference counts that went wrong (a write that failed after they were changed) are
    /// counted again from the disk, and a reference whose body is missing does not stop
    /// start-up: it is dropped, loudly.
    #[test]
    fn reference_counts_come_from_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        s.write(&[declare("a"), declare("b"), fanned(1), fanned(2)], true)
            .unwrap();
        s.inner
            .with_view(|v| {
                // As if a Remove had failed after lowering the count.
                v.refs().insert(1, 1);
                v.recount_refs()?;
                assert_eq!(v.refs().get(&1), Some(&2));
                // A body gone while references remain (what a too-low count would have caused).
                v.db.delete_cf(&v.shared()?, 2u64.to_be_bytes()).unwrap();
                Ok(())
            })
            .unwrap();
        drop(s);
        let s = RocksStore::open(dir.path()).unwrap();
        let rec = s.recover().unwrap();
        let a = rec.queues.iter().find(|q| q.name == "a").unwrap();
        assert_eq!(a.levels.iter().map(|l| l.count).sum::<u64>(), 1);
        let got = s.read("/", "b", 0, u64::MAX, 10, usize::MAX).unwrap();
        assert_eq!(got.iter().map(|m| m.key).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.shared_bodies(), 1);
    }

    fn spill(queue: &str, key: u64) -> Op {
        Op::Spill {
            vhost: "/".into(),
            queue: queue.into(),
            key,
            timestamp_ms: 0,
            exchange: "".into(),
            routing_key: "".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"spilled").into(),
        }
    }
    fn remove(queue: &str, key: u64) -> Op {
        Op::Remove {
            vhost: "/".into(),
            queue: queue.into(),
            keys: vec![key],
            sizes: vec![],
        }
    }
    fn purge(queue: &str) -> Op {
        Op::Purge {
            vhost: "/".into(),
            queue: queue.into(),
        }
    }

    /// A store in a fresh folder, logged or not.
    fn open_fresh(unlogged: bool) -> (tempfile::TempDir, RocksStore) {
        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            unlogged,
            ..Default::default()
        };
        let s = RocksStore::open_with(dir.path(), &opts).unwrap();
        (dir, s)
    }

    /// A range removal among entries of shared bodies is part of its write's one batch (in an
    /// unlogged store, a write split in two could lose its applied position to a crash between
    /// the parts: a cluster node then applied the entry again), and drops each reference once:
    /// stored ones, ones put earlier in the same write, none that the write removed already.
    #[test]
    fn a_range_removal_among_shared_bodies_is_one_batch_and_drops_each_reference_once() {
        for unlogged in [true, false] {
            let (_dir, s) = open_fresh(unlogged);
            s.write_applied(
                &[declare("a"), declare("b"), fanned(1), fanned(2)],
                b"1",
                true,
            )
            .unwrap();
            let before = s.inner.batches.load(Ordering::Relaxed);
            s.write_applied(&[fanned(3), remove("a", 1), purge("a")], b"2", false)
                .unwrap();
            assert_eq!(
                s.inner.batches.load(Ordering::Relaxed) - before,
                1,
                "unlogged {unlogged}: the write went in more than one batch"
            );
            let counted = s
                .inner
                .with_view(|v| {
                    let counted = v.refs().clone();
                    v.recount_refs()?;
                    assert_eq!(
                        *v.refs(),
                        counted,
                        "unlogged {unlogged}: counts off the disk's"
                    );
                    Ok(counted)
                })
                .unwrap();
            // Queue b alone refers to each body now.
            assert_eq!(counted, HashMap::from([(1, 1), (2, 1), (3, 1)]));
            assert_eq!(s.shared_bodies(), 3);
            let b = s.read("/", "b", 0, u64::MAX, 10, usize::MAX).unwrap();
            assert_eq!(b.iter().map(|m| m.key).collect::<Vec<_>>(), vec![1, 2, 3]);
            assert!(s
                .read("/", "a", 0, u64::MAX, 10, usize::MAX)
                .unwrap()
                .is_empty());
            // A second purge, of b, in one write with a new fan-out: every body goes.
            s.write_applied(&[fanned(4), purge("b"), purge("a")], b"3", false)
                .unwrap();
            assert_eq!(s.shared_bodies(), 0, "unlogged {unlogged}");
            assert!(s.inner.with_view(|v| Ok(v.refs().is_empty())).unwrap());
        }
    }

    /// A logged store commits part of a write when it switches between logged ops and spills:
    /// an entry put and removed in the same write may be stored by then, and a range removal
    /// after it must not drop its reference a second time (the body would go while another
    /// queue still refers to it). Both orders the broker writes: a spill between the fan-out
    /// and its removal, and a spill of a shared body removed before a purge's range.
    #[test]
    fn an_entry_put_and_removed_in_one_write_is_unreferenced_once_whatever_was_committed() {
        for unlogged in [false, true] {
            let (_dir, s) = open_fresh(unlogged);
            s.write_applied(&[declare("a"), declare("b"), declare("c")], b"1", true)
                .unwrap();
            // A fan-out to a and b, a spill elsewhere, then a's entry removed and a purged.
            s.write_applied(
                &[fanned(5), spill("c", 90), remove("a", 5), purge("a")],
                b"2",
                false,
            )
            .unwrap();
            // A spill of that shared body into c, removed, then c purged.
            s.write_applied(&[spill("c", 5), remove("c", 5), purge("c")], b"3", false)
                .unwrap();
            let counted = s.inner.with_view(|v| Ok(v.refs().clone())).unwrap();
            assert_eq!(counted, HashMap::from([(5, 1)]), "unlogged {unlogged}");
            assert_eq!(s.shared_bodies(), 1, "unlogged {unlogged}");
            let b = s.read("/", "b", 0, u64::MAX, 10, usize::MAX).unwrap();
            assert_eq!(b.iter().map(|m| m.key).collect::<Vec<_>>(), vec![5]);
        }
    }

    fn enqueue(queue: &str, id: u64, body: Bytes) -> Op {
        Op::Enqueue {
            vhost: "/".into(),
            queues: vec![(queue.into(), 0)].into(),
            id,
            timestamp_ms: 0,
            exchange: "".into(),
            routing_key: "".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: body.into(),
        }
    }

    /// Bodies that do not compress away: a xorshift stream.
    fn random_body(seed: u64, len: usize) -> Bytes {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        Bytes::from(
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect::<Vec<u8>>(),
        )
    }

    fn messages_files(s: &RocksStore) -> usize {
        s.table_files()
            .into_iter()
            .find(|(cf, _)| cf == MESSAGES)
            .map_or(0, |(_, n)| n)
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        // Generous: background compactions are slow on a loaded 2-core machine (CI runs other
        // test binaries beside this one).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// A deleted queue's space comes back without a manual compaction: its table files are
    /// dropped or compacted in the background, and a queue stored beside it keeps every message.
    #[test]
    fn a_deleted_queues_table_files_are_reclaimed() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        s.write(&[declare("big"), declare("other")], true).unwrap();
        // 24 MiB in batches: a few memtable flushes.
        for chunk in 0..48u64 {
            let ops: Vec<Op> = (0..128)
                .map(|i| {
                    let id = chunk * 128 + i + 1;
                    enqueue("big", id, random_body(id, 4096))
                })
                .collect();
            s.write(&ops, true).unwrap();
        }
        s.write(&[enqueue("other", 1_000_000, random_body(7, 4096))], true)
            .unwrap();
        s.compact();
        let full = s.sst_bytes();
        assert!(full > 20 << 20, "{full} bytes stored");
        s.write(
            &[Op::DeleteQueue {
                vhost: "/".into(),
                name: "big".into(),
            }],
            true,
        )
        .unwrap();
        wait_for("the deleted queue's space did not come back", || {
            s.sst_bytes() < full / 100
        });
        let got = s.read("/", "other", 0, u64::MAX, 10, usize::MAX).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].body,
            warren_storage::op::Body::from(random_body(7, 4096))
        );
        assert!(s
            .read("/", "big", 0, u64::MAX, 10, usize::MAX)
            .unwrap()
            .is_empty());
        eprintln!(
            "SST bytes: {full} with the queue, {} after its delete",
            s.sst_bytes()
        );
        drop(s);
        let s = RocksStore::open(dir.path()).unwrap();
        let rec = s.recover().unwrap();
        assert_eq!(rec.queues.len(), 1);
        assert_eq!(rec.queues[0].name, "other");
    }

    /// One queue's keys only grow, so each flush is a file no other touches and level
    /// compaction moves it down whole; with compressible bodies each is tiny. Such runs are
    /// merged (here on demand; the background thread does it twice a second), and nothing is lost.
    #[test]
    fn runs_of_small_table_files_are_merged() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        s.write(&[declare("q")], true).unwrap();
        let zeros = Bytes::from(vec![0u8; 128 * 1024]);
        let n = 2048u64;
        let mut most = 0;
        for chunk in 0..n / 32 {
            let ops: Vec<Op> = (0..32)
                .map(|i| enqueue("q", chunk * 32 + i + 1, zeros.clone()))
                .collect();
            s.write(&ops, true).unwrap();
            most = most.max(messages_files(&s));
        }
        // Level 0 is level compaction's business (up to 3 files wait for a 4th there).
        let below_level_0 = || {
            s.inner
                .with_view(|v| v.db.live_files().map_err(|e| v.err(e)))
                .unwrap()
                .iter()
                .filter(|f| f.column_family_name == MESSAGES && f.level > 0)
                .count()
        };
        // Every file here is small and the queue's keys are one range: once merged, fewer than
        // a run's worth stay below level 0, in whatever levels compaction left them.
        let runs = || {
            let files = s
                .inner
                .with_view(|v| v.db.live_files().map_err(|e| v.err(e)))
                .unwrap();
            maintenance::small_file_runs(&files).len()
        };
        wait_for("small files not merged", || {
            s.merge_small_files();
            runs() == 0 && below_level_0() < maintenance::MERGE_RUN
        });
        eprintln!(
            "messages table files: at most {most} while writing, {} after merging ({} below level 0)",
            messages_files(&s),
            below_level_0()
        );
        let mut from = 0;
        let mut seen = 0;
        loop {
            let got = s.read("/", "q", from, u64::MAX, 512, usize::MAX).unwrap();
            let Some(last) = got.last() else { break };
            from = last.key + 1;
            seen += got.len() as u64;
        }
        assert_eq!(seen, n);
    }

    /// The store writes down what it fsynced, and refuses a store that ends before it.
    #[test]
    fn a_store_that_lost_confirmed_writes_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = RocksStore::open(dir.path()).unwrap();
        s.write(&[declare("a")], true).unwrap();
        drop(s);
        let confirmed = open::read_watermark(dir.path()).unwrap();
        // As if a later confirmed write had been lost with the end of the log.
        open::write_watermark(dir.path(), confirmed + 5).unwrap();
        match RocksStore::open(dir.path()) {
            Err(StoreError::Corrupt { detail, .. }) => {
                assert!(
                    detail.contains("writes confirmed to clients are missing"),
                    "{detail}"
                )
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
        open::write_watermark(dir.path(), confirmed).unwrap();
        RocksStore::open(dir.path()).unwrap();
    }
    /// A cluster node's store writes without a log (`OpenOptions::unlogged`): what a crash
    /// leaves on disk is exactly the state at the last `persist` (the messages with the applied
    /// position that covers them, never one without the other), and a clean close keeps all.
    #[test]
    fn an_unlogged_store_keeps_on_disk_what_persist_made_durable() {
        fn copy_dir(from: &Path, to: &Path) {
            std::fs::create_dir_all(to).unwrap();
            for e in std::fs::read_dir(from).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_file() {
                    std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
                }
            }
        }
        fn count(s: &RocksStore, queue: &str) -> u64 {
            let rec = s.recover().unwrap();
            let q = rec.queues.iter().find(|q| q.name == queue).unwrap();
            q.levels.iter().map(|l| l.count).sum()
        }
        let unlogged = OpenOptions {
            unlogged: true,
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let s = RocksStore::open_with(&path, &unlogged).unwrap();
        let first: Vec<Op> = std::iter::once(declare("q"))
            .chain((1..=100).map(|i| enqueue("q", i, random_body(i, 1000))))
            .collect();
        s.write_applied(&first, b"100", false).unwrap();
        s.persist().unwrap();
        let second: Vec<Op> = (101..=150)
            .map(|i| enqueue("q", i, random_body(i, 1000)))
            .collect();
        s.write_applied(&second, b"150", false).unwrap();
        // Nothing of the second write is in a file, not even in a log (RocksDB still starts
        // a log file with a record of its predecessor: a few bytes, no message of 1,000).
        let logs: u64 = open::log_files(&path).iter().map(|(_, n)| n).sum();
        assert!(logs < 1000, "an unlogged store wrote {logs} bytes of log");
        // The files as they are now: what a SIGKILL would leave.
        let crashed = dir.path().join("crashed");
        copy_dir(&path, &crashed);
        drop(s);
        let c = RocksStore::open_with(&crashed, &unlogged).unwrap();
        assert_eq!(c.applied().unwrap().as_deref(), Some(&b"100"[..]));
        assert_eq!(count(&c, "q"), 100);
        drop(c);
        // Closed cleanly: everything.
        let s = RocksStore::open_with(&path, &unlogged).unwrap();
        assert_eq!(s.applied().unwrap().as_deref(), Some(&b"150"[..]));
        assert_eq!(count(&s, "q"), 150);
        // A synced write is durable at once, as `persist` makes it.
        s.write_applied(&[enqueue("q", 151, random_body(151, 10))], b"151", true)
            .unwrap();
        let synced = dir.path().join("synced");
        copy_dir(&path, &synced);
        drop(s);
        let c = RocksStore::open_with(&synced, &unlogged).unwrap();
        assert_eq!(c.applied().unwrap().as_deref(), Some(&b"151"[..]));
        assert_eq!(count(&c, "q"), 151);
    }
}

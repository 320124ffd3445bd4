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
//! Tuning, and why:
//! - One LRU block cache shared by every column family, and one write-buffer manager capping all
//!   memtables together (memory follows the data in flight, not the number of queues).
//! - `messages` gets a larger write buffer (8 MiB): it takes every message write; a message
//!   acked before its memtable is flushed never reaches an SST file. Block cache 16 MiB and
//!   memtables 24 MiB in all keep the store's share of a deep queue's memory near 40 MB (the
//!   S5 benchmark: 1,000,000 messages waiting then drained, peak RSS in the README; smaller
//!   budgets than these did not change S2's rate).
//! - Level compaction (the default): queues are appended at the tail and deleted at the head;
//!   level compaction reclaims the deleted ranges steadily.
//! - Sync writes are RocksDB's WAL fsync; the committer batches many ops into one write, so one
//!   fsync serves every connection waiting at that moment.

use crate::codec::{
    decode_entity_key, entity_key, BindingKey, ExchangeRecord, MessageEntry, MessageRecord,
    QueueRecord, UserRecord, BINDING_PREFIX, EXCHANGE_PREFIX, QUEUE_PREFIX, SHARED_TAG,
    USER_PREFIX,
};
use crate::op::{BindingDest, Op};
use crate::{key_id, QueueSummary, Recovered, Store, StoreError, StoredMessage};
use bytes::Bytes;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBWithThreadMode, Direction, IteratorMode,
    MultiThreaded, Options, ReadOptions, WriteBatch, WriteBufferManager, WriteOptions,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

type Db = DBWithThreadMode<MultiThreaded>;

const META: &str = "meta";
const MESSAGES: &str = "messages";
const SHARED: &str = "shared";

/// Memory the store may use for block cache and memtables (each), across all queues.
const BLOCK_CACHE_BYTES: usize = 16 * 1024 * 1024;
const MEMTABLE_BUDGET_BYTES: usize = 24 * 1024 * 1024;
const CF_WRITE_BUFFER_BYTES: usize = 4 * 1024 * 1024;
const MESSAGES_WRITE_BUFFER_BYTES: usize = 8 * 1024 * 1024;

pub struct RocksStore {
    db: Db,
    path: PathBuf,
    /// References to each shared body still stored (ids with none are not here).
    refs: Mutex<HashMap<u64, u32>>,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.path)
            .finish()
    }
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

fn map_err(path: &Path, e: rocksdb::Error) -> StoreError {
    let text = e.to_string();
    if text.contains("lock") && (text.contains("LOCK") || text.contains("Resource temporarily")) {
        StoreError::Locked(path.to_path_buf())
    } else if text.contains("No space left") || text.contains("ENOSPC") {
        StoreError::NoSpace(text)
    } else if text.contains("Corruption") || text.contains("corrupt") {
        StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: text,
        }
    } else {
        StoreError::Io(format!("{}: {text}", path.display()))
    }
}

impl RocksStore {
    /// Open (or create) the store in `path`. Fails with [`StoreError::Locked`] if another
    /// process has it open, and with [`StoreError::Corrupt`] if it is not a readable store;
    /// nothing is discarded in either case.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(path)
            .map_err(|e| StoreError::Io(format!("{}: {e}", path.display())))?;
        let cache = Cache::new_lru_cache(BLOCK_CACHE_BYTES);
        let manager = WriteBufferManager::new_write_buffer_manager_with_cache(
            MEMTABLE_BUDGET_BYTES,
            false,
            cache.clone(),
        );
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(&cache);
        let mut cf_opts = Options::default();
        cf_opts.set_write_buffer_size(CF_WRITE_BUFFER_BYTES);
        cf_opts.set_max_write_buffer_number(2);
        cf_opts.set_block_based_table_factory(&table);
        cf_opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        let mut db_opts = cf_opts.clone();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_write_buffer_manager(&manager);
        // Bound the WAL so idle queues' memtables get flushed rather than pinning old logs.
        db_opts.set_max_total_wal_size(128 * 1024 * 1024);
        db_opts.set_keep_log_file_num(4);
        let existing = match Db::list_cf(&db_opts, path) {
            Ok(cfs) => cfs,
            Err(e) => {
                // A folder without a database yet is fine; anything else is not.
                if path.join("CURRENT").exists() {
                    return Err(map_err(path, e));
                }
                vec!["default".to_string()]
            }
        };
        if let Some(old) = existing.iter().find(|n| n.starts_with("q.")) {
            return Err(StoreError::Corrupt {
                path: path.to_path_buf(),
                detail: format!(
                    "column family {old} is from an older Warren layout (a column family per \
                     queue); this version keeps all queues in `messages` and does not convert"
                ),
            });
        }
        let mut names: Vec<String> = existing;
        for wanted in [META, MESSAGES, SHARED] {
            if !names.iter().any(|n| n == wanted) {
                names.push(wanted.to_string());
            }
        }
        let mut messages_opts = cf_opts.clone();
        messages_opts.set_write_buffer_size(MESSAGES_WRITE_BUFFER_BYTES);
        let descriptors = names.iter().map(|n| {
            let opts = if n == MESSAGES {
                messages_opts.clone()
            } else {
                cf_opts.clone()
            };
            ColumnFamilyDescriptor::new(n, opts)
        });
        let db =
            Db::open_cf_descriptors(&db_opts, path, descriptors).map_err(|e| map_err(path, e))?;
        Ok(RocksStore {
            db,
            path: path.to_path_buf(),
            refs: Mutex::new(HashMap::new()),
        })
    }

    fn err(&self, e: rocksdb::Error) -> StoreError {
        map_err(&self.path, e)
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
        self.refs.lock().unwrap_or_else(|e| e.into_inner())
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
    /// in `from..=to`. Reads the stored keys, so the caller writes what is pending first.
    fn unref_range(
        &self,
        prefix: &[u8],
        from: u64,
        to: u64,
        batch: &mut WriteBatch,
    ) -> Result<(), StoreError> {
        let mut refs = self.refs();
        if refs.is_empty() {
            return Ok(());
        }
        let mut ids = Vec::new();
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
            ids.push(key_id(key));
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
            path: self.path.clone(),
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

    fn commit(&self, batch: WriteBatch, sync: bool) -> Result<(), StoreError> {
        let mut opts = WriteOptions::default();
        opts.set_sync(sync);
        self.db.write_opt(batch, &opts).map_err(|e| self.err(e))
    }

    fn commit_unlogged(&self, batch: WriteBatch) -> Result<(), StoreError> {
        let mut opts = WriteOptions::default();
        opts.disable_wal(true);
        self.db.write_opt(batch, &opts).map_err(|e| self.err(e))
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
        walk(&self.path)
    }

    /// Count the references to shared bodies again from what is stored (after a failed write
    /// left the in-memory counts unsure).
    fn recount_refs(&self) -> Result<(), StoreError> {
        let shared = self.shared()?;
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for item in self.db.iterator_cf(&shared, IteratorMode::Start) {
            let (k, _) = item.map_err(|e| self.err(e))?;
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

    /// Bodies stored once for several queues that are still referred to.
    pub fn shared_bodies(&self) -> usize {
        self.refs().len()
    }

    /// Bytes in SST files, across all column families (what compaction gives back).
    pub fn sst_bytes(&self) -> u64 {
        let Ok(cfs) = Db::list_cf(&Options::default(), &self.path) else {
            return 0;
        };
        cfs.iter()
            .filter_map(|cf| self.db.cf_handle(cf))
            .filter_map(|h| {
                self.db
                    .property_int_value_cf(&h, "rocksdb.total-sst-files-size")
                    .ok()
                    .flatten()
            })
            .sum()
    }

    /// Compact everything now (space comes back after a drained backlog).
    pub fn compact(&self) {
        if let Ok(cfs) = Db::list_cf(&Options::default(), &self.path) {
            for cf in cfs {
                if let Some(h) = self.db.cf_handle(&cf) {
                    self.db.compact_range_cf(&h, None::<&[u8]>, None::<&[u8]>);
                }
            }
        }
    }
}

/// The two batches of one `write`: logged (write-ahead log) and unlogged (spills). Ops are
/// applied in order, so switching from one kind to the other writes what came before first.
struct Batches {
    logged: WriteBatch,
    unlogged: WriteBatch,
    /// A logged batch was written unsynced (the final sync must cover it).
    logged_written: bool,
}

impl Batches {
    fn logged(&mut self, store: &RocksStore) -> Result<&mut WriteBatch, StoreError> {
        if !self.unlogged.is_empty() {
            store.commit_unlogged(std::mem::take(&mut self.unlogged))?;
        }
        Ok(&mut self.logged)
    }

    fn unlogged(&mut self, store: &RocksStore) -> Result<&mut WriteBatch, StoreError> {
        if !self.logged.is_empty() {
            store.commit(std::mem::take(&mut self.logged), false)?;
            self.logged_written = true;
        }
        Ok(&mut self.unlogged)
    }

    /// Write everything pending now (unsynced).
    fn flush(&mut self, store: &RocksStore) -> Result<(), StoreError> {
        self.unlogged(store)?;
        if !self.unlogged.is_empty() {
            store.commit_unlogged(std::mem::take(&mut self.unlogged))?;
        }
        Ok(())
    }

    fn finish(mut self, store: &RocksStore, sync: bool) -> Result<(), StoreError> {
        if !self.unlogged.is_empty() {
            store.commit_unlogged(std::mem::take(&mut self.unlogged))?;
        }
        if !self.logged.is_empty() {
            store.commit(std::mem::take(&mut self.logged), sync)?;
        } else if sync && self.logged_written {
            store.db.flush_wal(true).map_err(|e| store.err(e))?;
        }
        Ok(())
    }
}

/// A queue's scan at recovery: its key prefix, whether it is declared, and (key, body size,
/// carries an expiration) of each message.
type Scan = (Vec<u8>, bool, Vec<(u64, u64, bool)>);

impl Store for RocksStore {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        let shares = !self.refs().is_empty()
            || ops
                .iter()
                .any(|op| matches!(op, Op::Enqueue { queues, .. } if queues.len() > 1));
        let result = self.write_ops(ops, sync);
        if result.is_err() && shares {
            // The reference counts were changed while the batch was built; what reached the
            // disk is the truth: count again (a count left too low would delete a body that a
            // queue still refers to).
            if let Err(e) = self.recount_refs() {
                tracing::error!(error = %e, "recounting shared message references failed");
            }
        }
        result
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        self.recover_all()
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
        self.read_range(vhost, queue, from, to, max_count, max_bytes)
    }
}

impl RocksStore {
    fn write_ops(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        let meta = self.meta()?;
        let messages = self.messages()?;
        let shared = self.shared()?;
        let mut b = Batches {
            logged: WriteBatch::default(),
            unlogged: WriteBatch::default(),
            logged_written: false,
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
                    let batch = b.logged(self)?;
                    if let [(q, level)] = &queues[..] {
                        let key = crate::message_key(*level, *id);
                        batch.put_cf(
                            &messages,
                            message_key_in(&mut key_buf, vhost, q, key),
                            value,
                        );
                    } else if queues.len() > 1 {
                        batch.put_cf(&shared, id.to_be_bytes(), value);
                        for (q, level) in queues {
                            let key = crate::message_key(*level, *id);
                            batch.put_cf(
                                &messages,
                                message_key_in(&mut key_buf, vhost, q, key),
                                [SHARED_TAG],
                            );
                        }
                        self.refs().insert(*id, queues.len() as u32);
                    }
                }
                Op::Remove { vhost, queue, keys } => {
                    let batch = b.logged(self)?;
                    let mut refs = self.refs();
                    for k in keys {
                        batch.delete_cf(&messages, message_key_in(&mut key_buf, vhost, queue, *k));
                        if !refs.is_empty() {
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
                } => {
                    self.remove_range(&mut b, &queue_prefix(vhost, queue), *from, *to)?;
                }
                Op::Spill {
                    vhost, queue, key, ..
                } => {
                    let k = message_key_in(&mut key_buf, vhost, queue, *key);
                    let mut refs = self.refs();
                    let batch = b.unlogged(self)?;
                    // A body stored for other queues already: refer to it.
                    if let Some(n) = refs.get_mut(&key_id(*key)) {
                        *n += 1;
                        batch.put_cf(&messages, k, [SHARED_TAG]);
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
            }
        }
        b.finish(self, sync)
    }

    fn recover_all(&self) -> Result<Recovered, StoreError> {
        let mut ops = Vec::new();
        for (_, _, name, v) in self.meta_entities(USER_PREFIX)? {
            let u = UserRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(crate::op::put_user(&name, &u));
        }
        for (_, vhost, name, v) in self.meta_entities(EXCHANGE_PREFIX)? {
            let x = ExchangeRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(crate::op::declare_exchange(&vhost, &name, &x));
        }
        let queues = self.meta_entities(QUEUE_PREFIX)?;
        let mut known = std::collections::HashSet::new();
        for (_, vhost, name, v) in &queues {
            let q = QueueRecord::decode(v.clone()).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(crate::op::declare_queue(vhost, name, &q));
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
            ops.push(crate::op::bind(&b));
        }
        // Shared bodies: their sizes, then the references the queues hold.
        let shared = self.shared()?;
        // id -> (references, body size, carries an expiration)
        let mut sizes: HashMap<u64, (u32, u64, bool)> = HashMap::new();
        for item in self.db.iterator_cf(&shared, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            let id = self.message_key(&k)?;
            let m = MessageRecord::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?;
            let expires = crate::has_expiration(&m.properties);
            sizes.insert(id, (0, m.body.len() as u64, expires));
        }
        // One pass over every queue's messages, queue by queue (keys sort by queue).
        let messages = self.messages()?;
        let mut summaries = Vec::new();
        let mut current: Option<Scan> = None;
        let mut cleanup = WriteBatch::default();
        let mut orphan_prefixes: Vec<Vec<u8>> = Vec::new();
        let finish =
            |cur: Option<Scan>, summaries: &mut Vec<QueueSummary>| -> Result<(), StoreError> {
                if let Some((prefix, true, entries)) = cur {
                    let (_, vhost, name) = decode_entity_key(Bytes::from(prefix))
                        .map_err(|e| self.corrupt(e.to_string()))?;
                    summaries.push(QueueSummary {
                        vhost,
                        name,
                        levels: crate::mem::summarize(entries.into_iter()),
                    });
                }
                Ok(())
            };
        for item in self.db.iterator_cf(&messages, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
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
                    orphan_prefixes.push(prefix.to_vec());
                }
                current = Some((prefix.to_vec(), live, Vec::new()));
            }
            let Some((_, live, entries)) = current.as_mut() else {
                continue;
            };
            if !*live {
                continue;
            }
            match MessageEntry::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?
            {
                MessageEntry::Whole(m) => entries.push((
                    key,
                    m.body.len() as u64,
                    crate::has_expiration(&m.properties),
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
        for prefix in &orphan_prefixes {
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
        Ok(Recovered {
            ops,
            queues: summaries,
        })
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

impl RocksStore {
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
        if !self.refs().is_empty() {
            b.flush(self)?;
        }
        let messages = self.messages()?;
        let batch = b.logged(self)?;
        self.unref_range(prefix, from, to, batch)?;
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
        // As if a Remove had failed after lowering the count.
        s.refs().insert(1, 1);
        s.recount_refs().unwrap();
        assert_eq!(s.refs().get(&1), Some(&2));
        // A body gone while references remain (what a too-low count would have caused).
        s.db.delete_cf(&s.shared().unwrap(), 2u64.to_be_bytes())
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
}

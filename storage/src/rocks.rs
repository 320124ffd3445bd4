//! The RocksDB store: column family `meta` for definitions, one column family per durable queue
//! for its messages (key: `message_key(level, id)`, big-endian, so iteration is delivery order
//! within a priority level), and column family `shared` for bodies routed to several queues.
//!
//! A message routed to several stored queues is written once, under its id in `shared`; each
//! queue's entry is a one-byte reference. How many references a shared body has is not stored:
//! recovery counts them, and the store keeps the count in memory for the live ids only (the
//! last reference removed deletes the body). A queue that is deep in memory spills messages
//! into its column family without the write-ahead log (`Op::Spill`); even a non-durable queue
//! gets a column family for that, dropped with the queue, and at start-up as an orphan.
//!
//! Tuning, and why:
//! - One LRU block cache shared by every column family, and one write-buffer manager capping all
//!   memtables together: with a column family per queue, per-CF defaults (64 MiB memtables each)
//!   would let 10,000 queues ask for 640 GB. With the manager, idle queues' memtables are flushed
//!   when the total passes the cap, so memory follows the data in flight, not the queue count.
//! - Small per-CF write buffers (4 MiB): a queue's memtable holds its recent messages; the bulk
//!   of a backlog belongs in SST files, not in memory.
//! - Level compaction (the default): queues are mostly appended at the tail and deleted at the
//!   head; level compaction reclaims the deleted ranges steadily.
//! - Sync writes are RocksDB's WAL fsync; the committer batches many ops into one write, so one
//!   fsync serves every connection waiting at that moment.

use crate::codec::{
    decode_entity_key, entity_key, BindingKey, ExchangeRecord, MessageEntry, MessageRecord,
    QueueRecord, BINDING_PREFIX, EXCHANGE_PREFIX, QUEUE_PREFIX, SHARED_TAG,
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
const SHARED: &str = "shared";

/// Memory the store may use for block cache and memtables (each), across all queues.
const BLOCK_CACHE_BYTES: usize = 32 * 1024 * 1024;
const MEMTABLE_BUDGET_BYTES: usize = 64 * 1024 * 1024;
const CF_WRITE_BUFFER_BYTES: usize = 4 * 1024 * 1024;

pub struct RocksStore {
    db: Db,
    path: PathBuf,
    cf_opts: Options,
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

/// The column family of a queue: `q.` + hex of vhost, NUL, name (any bytes are allowed in
/// names; hex keeps CF names printable and unambiguous).
fn queue_cf(vhost: &str, name: &str) -> String {
    let mut s = String::from("q.");
    for b in vhost.bytes().chain(std::iter::once(0)).chain(name.bytes()) {
        s.push_str(&format!("{b:02x}"));
    }
    s
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
        let mut names: Vec<String> = existing;
        for wanted in [META, SHARED] {
            if !names.iter().any(|n| n == wanted) {
                names.push(wanted.to_string());
            }
        }
        let descriptors = names
            .iter()
            .map(|n| ColumnFamilyDescriptor::new(n, cf_opts.clone()));
        let db =
            Db::open_cf_descriptors(&db_opts, path, descriptors).map_err(|e| map_err(path, e))?;
        let store = RocksStore {
            db,
            path: path.to_path_buf(),
            cf_opts,
            refs: Mutex::new(HashMap::new()),
        };
        store.drop_orphan_queues()?;
        Ok(store)
    }

    fn err(&self, e: rocksdb::Error) -> StoreError {
        map_err(&self.path, e)
    }

    fn meta(&self) -> Result<std::sync::Arc<rocksdb::BoundColumnFamily<'_>>, StoreError> {
        self.db
            .cf_handle(META)
            .ok_or_else(|| StoreError::Io("meta column family missing".into()))
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

    /// Drop the references held by the entries of queue column family `cf` with keys in
    /// `from..=to`. Reads the stored keys, so the caller commits what is pending first.
    fn unref_range(
        &self,
        cf: &str,
        from: u64,
        to: u64,
        batch: &mut WriteBatch,
    ) -> Result<(), StoreError> {
        let mut refs = self.refs();
        if refs.is_empty() {
            return Ok(());
        }
        let Some(h) = self.db.cf_handle(cf) else {
            return Ok(());
        };
        let mut ids = Vec::new();
        let start = from.to_be_bytes();
        for item in self
            .db
            .iterator_cf(&h, IteratorMode::From(&start, Direction::Forward))
        {
            let (k, _) = item.map_err(|e| self.err(e))?;
            let key = self.message_key(&k)?;
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

    /// Column families of queues whose definition is gone (a crash between the definition's
    /// delete and the drop) are dropped at open.
    fn drop_orphan_queues(&self) -> Result<(), StoreError> {
        let mut wanted = std::collections::HashSet::new();
        for (prefix, vhost, name, _) in self.meta_entities(QUEUE_PREFIX)? {
            debug_assert_eq!(prefix, QUEUE_PREFIX);
            wanted.insert(queue_cf(&vhost, &name));
        }
        let cfs = Db::list_cf(&Options::default(), &self.path).map_err(|e| self.err(e))?;
        for cf in cfs {
            if cf.starts_with("q.") && !wanted.contains(&cf) {
                tracing::warn!(
                    cf,
                    "dropping the messages of a queue whose definition is gone"
                );
                self.db.drop_cf(&cf).map_err(|e| self.err(e))?;
            }
        }
        Ok(())
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

    fn ensure_queue_cf(&self, vhost: &str, name: &str) -> Result<(), StoreError> {
        let cf = queue_cf(vhost, name);
        if self.db.cf_handle(&cf).is_none() {
            self.db
                .create_cf(&cf, &self.cf_opts)
                .map_err(|e| self.err(e))?;
        }
        Ok(())
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

impl Store for RocksStore {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        let meta = self.meta()?;
        let shared = self.shared()?;
        let mut b = Batches {
            logged: WriteBatch::default(),
            unlogged: WriteBatch::default(),
            logged_written: false,
        };
        // Column families to drop once the batch that deletes their queue is written.
        let mut drops: Vec<String> = Vec::new();
        // Bindings put earlier in this batch (a later delete in the batch must see them too).
        let mut added: Vec<BindingKey> = Vec::new();
        for op in ops {
            // A queue deleted earlier in this write must be gone before it gets storage anew.
            let recreates = match op {
                Op::DeclareQueue { vhost, name, .. } => Some(queue_cf(vhost, name)),
                Op::Spill { vhost, queue, .. } => Some(queue_cf(vhost, queue)),
                _ => None,
            };
            if recreates.is_some_and(|cf| drops.contains(&cf)) {
                b.flush(self)?;
                for cf in drops.drain(..) {
                    self.db.drop_cf(&cf).map_err(|e| self.err(e))?;
                }
            }
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
                    self.ensure_queue_cf(vhost, name)?;
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
                    let cf = queue_cf(vhost, name);
                    if !self.refs().is_empty() {
                        b.flush(self)?;
                    }
                    let batch = b.logged(self)?;
                    self.unref_range(&cf, 0, u64::MAX, batch)?;
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
                    if self.db.cf_handle(&cf).is_some() && !drops.contains(&cf) {
                        drops.push(cf);
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
                    vhost,
                    queues,
                    id,
                    timestamp_ms,
                    exchange,
                    routing_key,
                    properties,
                    body,
                } => {
                    let value = MessageRecord {
                        timestamp_ms: *timestamp_ms,
                        exchange: exchange.clone(),
                        routing_key: routing_key.clone(),
                        properties: properties.clone(),
                        body: body.clone(),
                    }
                    .encode();
                    let targets: Vec<_> = queues
                        .iter()
                        .filter_map(|(q, level)| {
                            let cf = queue_cf(vhost, q);
                            if drops.contains(&cf) {
                                return None;
                            }
                            self.db
                                .cf_handle(&cf)
                                .map(|h| (h, crate::message_key(*level, *id)))
                        })
                        .collect();
                    let batch = b.logged(self)?;
                    if targets.len() > 1 {
                        batch.put_cf(&shared, id.to_be_bytes(), &value);
                        for (h, key) in &targets {
                            batch.put_cf(h, key.to_be_bytes(), [SHARED_TAG]);
                        }
                        self.refs().insert(*id, targets.len() as u32);
                    } else if let Some((h, key)) = targets.first() {
                        batch.put_cf(h, key.to_be_bytes(), &value);
                    }
                }
                Op::Remove { vhost, queue, keys } => {
                    let batch = b.logged(self)?;
                    if let Some(h) = self.db.cf_handle(&queue_cf(vhost, queue)) {
                        let mut refs = self.refs();
                        for k in keys {
                            batch.delete_cf(&h, k.to_be_bytes());
                            if !refs.is_empty() {
                                self.unref(&mut refs, key_id(*k), batch)?;
                            }
                        }
                    }
                }
                Op::Purge { vhost, queue } => {
                    self.remove_range(&mut b, &queue_cf(vhost, queue), 0, u64::MAX)?;
                }
                Op::RemoveRange {
                    vhost,
                    queue,
                    from,
                    to,
                } => {
                    self.remove_range(&mut b, &queue_cf(vhost, queue), *from, *to)?;
                }
                Op::Spill {
                    vhost,
                    queue,
                    key,
                    timestamp_ms,
                    exchange,
                    routing_key,
                    properties,
                    body,
                } => {
                    self.ensure_queue_cf(vhost, queue)?;
                    let h = self
                        .db
                        .cf_handle(&queue_cf(vhost, queue))
                        .ok_or_else(|| StoreError::Io("spill column family missing".into()))?;
                    let mut refs = self.refs();
                    let batch = b.unlogged(self)?;
                    // A body stored for other queues already: refer to it.
                    if let Some(n) = refs.get_mut(&key_id(*key)) {
                        *n += 1;
                        batch.put_cf(&h, key.to_be_bytes(), [SHARED_TAG]);
                    } else {
                        let value = MessageRecord {
                            timestamp_ms: *timestamp_ms,
                            exchange: exchange.clone(),
                            routing_key: routing_key.clone(),
                            properties: properties.clone(),
                            body: body.clone(),
                        }
                        .encode_spilled();
                        batch.put_cf(&h, key.to_be_bytes(), value);
                    }
                }
            }
        }
        b.finish(self, sync)?;
        for cf in drops {
            self.db.drop_cf(&cf).map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        let mut ops = Vec::new();
        for (_, vhost, name, v) in self.meta_entities(EXCHANGE_PREFIX)? {
            let x = ExchangeRecord::decode(v).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(crate::op::declare_exchange(&vhost, &name, &x));
        }
        let queues = self.meta_entities(QUEUE_PREFIX)?;
        for (_, vhost, name, v) in &queues {
            let q = QueueRecord::decode(v.clone()).map_err(|e| self.corrupt(e.to_string()))?;
            ops.push(crate::op::declare_queue(vhost, name, &q));
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
        let mut sizes: HashMap<u64, (u32, u64)> = HashMap::new();
        for item in self.db.iterator_cf(&shared, IteratorMode::Start) {
            let (k, v) = item.map_err(|e| self.err(e))?;
            let id = self.message_key(&k)?;
            let m = MessageRecord::decode(Bytes::from(v.into_vec()))
                .map_err(|e| self.corrupt(e.to_string()))?;
            sizes.insert(id, (0, m.body.len() as u64));
        }
        let mut summaries = Vec::new();
        for (_, vhost, name, _) in &queues {
            let Some(h) = self.db.cf_handle(&queue_cf(vhost, name)) else {
                continue;
            };
            let mut entries = Vec::new();
            let mut spilled = WriteBatch::default();
            for item in self.db.iterator_cf(&h, IteratorMode::Start) {
                let (k, v) = item.map_err(|e| self.err(e))?;
                let key = self.message_key(&k)?;
                match MessageEntry::decode(Bytes::from(v.into_vec()))
                    .map_err(|e| self.corrupt(e.to_string()))?
                {
                    MessageEntry::Whole(m) => entries.push((key, m.body.len() as u64)),
                    MessageEntry::Shared => {
                        let (n, size) = sizes.get_mut(&key_id(key)).ok_or_else(|| {
                            self.corrupt(format!(
                                "queue '{name}' refers to shared message {} which is missing",
                                key_id(key)
                            ))
                        })?;
                        *n += 1;
                        entries.push((key, *size));
                    }
                    MessageEntry::Spilled(_) => spilled.delete_cf(&h, k),
                }
            }
            if !spilled.is_empty() {
                self.commit(spilled, false)?;
            }
            summaries.push(QueueSummary {
                vhost: vhost.clone(),
                name: name.clone(),
                levels: crate::mem::summarize(entries.into_iter()),
            });
        }
        // Bodies nothing refers to any more (the last reference went with its queue) go.
        let mut orphans = WriteBatch::default();
        let mut refs = self.refs();
        refs.clear();
        for (id, (n, _)) in sizes {
            if n == 0 {
                orphans.delete_cf(&shared, id.to_be_bytes());
            } else {
                refs.insert(id, n);
            }
        }
        drop(refs);
        if !orphans.is_empty() {
            self.commit(orphans, true)?;
        }
        Ok(Recovered {
            ops,
            queues: summaries,
        })
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
        let mut out = Vec::new();
        let Some(h) = self.db.cf_handle(&queue_cf(vhost, queue)) else {
            return Ok(out);
        };
        let mut opts = ReadOptions::default();
        if to < u64::MAX {
            opts.set_iterate_upper_bound((to + 1).to_be_bytes());
        }
        let start = from.to_be_bytes();
        let mut bytes = 0;
        for item in
            self.db
                .iterator_cf_opt(&h, opts, IteratorMode::From(&start, Direction::Forward))
        {
            if out.len() >= max_count || (bytes >= max_bytes && !out.is_empty()) {
                break;
            }
            let (k, v) = item.map_err(|e| self.err(e))?;
            let key = self.message_key(&k)?;
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
    /// Delete the entries of queue column family `cf` with keys in `from..=to` (a range
    /// tombstone: compaction reclaims the space), dropping the shared bodies they refer to.
    fn remove_range(
        &self,
        b: &mut Batches,
        cf: &str,
        from: u64,
        to: u64,
    ) -> Result<(), StoreError> {
        let Some(h) = self.db.cf_handle(cf) else {
            return Ok(());
        };
        if !self.refs().is_empty() {
            b.flush(self)?;
        }
        let batch = b.logged(self)?;
        self.unref_range(cf, from, to, batch)?;
        if to == u64::MAX {
            batch.delete_range_cf(&h, from.to_be_bytes(), u64::MAX.to_be_bytes());
            batch.delete_cf(&h, u64::MAX.to_be_bytes());
        } else {
            batch.delete_range_cf(&h, from.to_be_bytes(), (to + 1).to_be_bytes());
        }
        Ok(())
    }
}

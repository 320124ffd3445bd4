//! The RocksDB store: column family `meta` for definitions, one column family per durable queue
//! for its messages (key: message id, big-endian, so iteration is delivery order).
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
    decode_entity_key, entity_key, BindingKey, ExchangeRecord, MessageRecord, QueueRecord,
    BINDING_PREFIX, EXCHANGE_PREFIX, QUEUE_PREFIX,
};
use crate::op::{BindingDest, Op};
use crate::{Store, StoreError};
use bytes::Bytes;
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBWithThreadMode, IteratorMode,
    MultiThreaded, Options, WriteBatch, WriteBufferManager, WriteOptions,
};
use std::path::{Path, PathBuf};

type Db = DBWithThreadMode<MultiThreaded>;

const META: &str = "meta";

/// Memory the store may use for block cache and memtables (each), across all queues.
const BLOCK_CACHE_BYTES: usize = 32 * 1024 * 1024;
const MEMTABLE_BUDGET_BYTES: usize = 64 * 1024 * 1024;
const CF_WRITE_BUFFER_BYTES: usize = 4 * 1024 * 1024;

pub struct RocksStore {
    db: Db,
    path: PathBuf,
    cf_opts: Options,
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
        if !names.iter().any(|n| n == META) {
            names.push(META.to_string());
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

impl Store for RocksStore {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        let meta = self.meta()?;
        let mut batch = WriteBatch::default();
        // Column families to drop once the batch that deletes their queue is durable.
        let mut drops: Vec<String> = Vec::new();
        // Bindings put earlier in this batch (a later delete in the batch must see them too).
        let mut added: Vec<BindingKey> = Vec::new();
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
                    batch.put_cf(
                        &meta,
                        entity_key(EXCHANGE_PREFIX, vhost, name),
                        rec.encode(),
                    );
                }
                Op::DeleteExchange { vhost, name } => {
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
                    // A queue deleted earlier in this batch must be gone before it is made anew.
                    if drops.contains(&queue_cf(vhost, name)) {
                        self.commit(std::mem::take(&mut batch), sync)?;
                        for cf in drops.drain(..) {
                            self.db.drop_cf(&cf).map_err(|e| self.err(e))?;
                        }
                    }
                    self.ensure_queue_cf(vhost, name)?;
                    let rec = QueueRecord {
                        durable: *durable,
                        exclusive: *exclusive,
                        auto_delete: *auto_delete,
                        arguments: arguments.clone(),
                    };
                    batch.put_cf(&meta, entity_key(QUEUE_PREFIX, vhost, name), rec.encode());
                }
                Op::DeleteQueue { vhost, name } => {
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
                    let cf = queue_cf(vhost, name);
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
                    batch.put_cf(&meta, key.encode(), []);
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
                    batch.delete_cf(&meta, key.encode());
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
                    for q in queues {
                        let cf = queue_cf(vhost, q);
                        if drops.contains(&cf) {
                            continue;
                        }
                        if let Some(h) = self.db.cf_handle(&cf) {
                            batch.put_cf(&h, id.to_be_bytes(), &value);
                        }
                    }
                }
                Op::Remove { vhost, queue, ids } => {
                    if let Some(h) = self.db.cf_handle(&queue_cf(vhost, queue)) {
                        for id in ids {
                            batch.delete_cf(&h, id.to_be_bytes());
                        }
                    }
                }
                Op::Purge { vhost, queue } => {
                    if let Some(h) = self.db.cf_handle(&queue_cf(vhost, queue)) {
                        batch.delete_range_cf(&h, [0u8; 8], [0xffu8; 8]);
                        batch.delete_cf(&h, [0xffu8; 8]);
                    }
                }
            }
        }
        self.commit(batch, sync)?;
        for cf in drops {
            self.db.drop_cf(&cf).map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    fn recover(&self) -> Result<Vec<Op>, StoreError> {
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
        for (_, vhost, name, _) in &queues {
            let Some(h) = self.db.cf_handle(&queue_cf(vhost, name)) else {
                continue;
            };
            for item in self.db.iterator_cf(&h, IteratorMode::Start) {
                let (k, v) = item.map_err(|e| self.err(e))?;
                let id = <[u8; 8]>::try_from(&k[..])
                    .map(u64::from_be_bytes)
                    .map_err(|_| self.corrupt("bad message key".into()))?;
                let m = MessageRecord::decode(Bytes::copy_from_slice(&v))
                    .map_err(|e| self.corrupt(e.to_string()))?;
                ops.push(crate::op::enqueue(vhost, name, id, &m));
            }
        }
        Ok(ops)
    }
}

//! The replicated log's storage (issue 15): numbered entries of opaque bytes and a few named
//! metadata values, in a RocksDB folder of their own (`<data-dir>/raft/`), apart from the state
//! store so that its tuning, damage checks and salvage stay as they are. It knows nothing of
//! Raft's types: the cluster code encodes entries, votes and membership; this keeps the
//! durability contract a Raft log store owes its engine:
//!
//! - `append` writes without waiting for the disk, and the entries can be read back at once;
//!   `sync` then returns only once everything appended before it is on disk (the engine is told
//!   an append is durable only after that).
//! - `put_meta(.., sync = true)` (the vote) returns only once it is on disk. All writes share
//!   one write-ahead log, so a synced write also makes every earlier one durable: a vote never
//!   reaches the disk ahead of the log it was cast on.
//! - `truncate` (a leader overwrote a conflicting suffix) and `purge` (entries a snapshot
//!   covers) are range deletes; `purge` records the last purged index in the same write, so the
//!   log's end is known even when every entry is purged (`purge_with_meta` also stores the
//!   caller's own record of it, the full log id, in that write).
//!
//! Column families: `log` (index, big-endian, so iteration is in index order) and `meta`.

use rocksdb::{
    ColumnFamilyDescriptor, DBWithThreadMode, Direction, IteratorMode, MultiThreaded, Options,
    WriteBatch, WriteOptions,
};
use std::path::Path;
use warren_storage::StoreError;

type Db = DBWithThreadMode<MultiThreaded>;

const LOG: &str = "log";
const META: &str = "meta";
/// The meta key holding the last purged index (8 bytes, big-endian).
const LAST_PURGED: &[u8] = b"last_purged";

/// The write-ahead log's size past which RocksDB flushes the column families holding its
/// oldest file, so that the file can go. Every append goes through this log; `meta` (the vote,
/// the committed index) is written into each of its files and, left alone, its memtable is
/// never full: RocksDB's default bound (four times the memtables, about a gigabyte here) then
/// kept every file, so each append wrote to page-cache pages the kernel had to find afresh.
/// Writing a freshly allocated page costs far more than a recently freed one on a virtual
/// machine whose freed memory goes back to the host (profiled: the copy of appends into the
/// page cache was 46% of a follower's CPU); with files that go every few dozen megabytes the
/// pages they free are soon reused.
const WAL_BYTES: u64 = 32 << 20;

/// Memtables of the log (the one written and those waiting for their flush).
const WRITE_BUFFERS: i32 = 6;

/// A Raft log on disk (see the module doc).
pub struct RaftLogDb {
    db: Db,
    path: std::path::PathBuf,
}

impl std::fmt::Debug for RaftLogDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftLogDb")
            .field("path", &self.path)
            .finish()
    }
}

impl RaftLogDb {
    /// Open (or create) the log in `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_paranoid_checks(true);
        // A torn last append (a crash mid-write) was never reported durable: dropping it is
        // right. Damage anywhere else refuses the open.
        opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
        opts.set_max_open_files(256);
        opts.set_max_total_wal_size(WAL_BYTES);
        let mut log_cf = Options::default();
        log_cf.set_write_buffer_size(WAL_BYTES as usize);
        // Memtables waiting for their flush before appends stop (RocksDB's default, 2, stopped
        // every append for the whole flush of the one before: with incompressible bodies the
        // cluster stalled for a third of a second every 32 MiB).
        log_cf.set_max_write_buffer_number(WRITE_BUFFERS);
        let cfs = [
            ColumnFamilyDescriptor::new(LOG, log_cf),
            ColumnFamilyDescriptor::new(META, Options::default()),
        ];
        let db = Db::open_cf_descriptors(&opts, path, cfs).map_err(|e| err(path, e))?;
        Ok(RaftLogDb {
            db,
            path: path.to_path_buf(),
        })
    }

    fn cf(&self, name: &str) -> Result<std::sync::Arc<rocksdb::BoundColumnFamily<'_>>, StoreError> {
        self.db.cf_handle(name).ok_or_else(|| {
            StoreError::Io(format!("{}: no column family {name}", self.path.display()))
        })
    }

    fn e(&self, e: rocksdb::Error) -> StoreError {
        err(&self.path, e)
    }

    /// Write entries (index, bytes), in one batch, without waiting for the disk (see `sync`).
    pub fn append(&self, entries: &[(u64, &[u8])]) -> Result<(), StoreError> {
        let log = self.cf(LOG)?;
        // Sized once: grown step by step, a batch of a few hundred KiB was reallocated (and
        // its fresh pages faulted in) at every doubling. 32: a record's header, key and
        // lengths.
        let size = entries.iter().map(|(_, b)| b.len() + 32).sum::<usize>() + 16;
        let mut batch = WriteBatch::with_capacity_bytes(size);
        for (index, bytes) in entries {
            batch.put_cf(&log, index.to_be_bytes(), bytes);
        }
        self.db.write(batch).map_err(|e| self.e(e))
    }

    /// Return once everything written so far is on disk (an fsync of the write-ahead log).
    pub fn sync(&self) -> Result<(), StoreError> {
        self.db.flush_wal(true).map_err(|e| self.e(e))
    }

    /// Entries with indexes in `from..to`, in order, stopping after `max_bytes` of them (at
    /// least one). The read starts at `from` exactly: an index missing there or in between
    /// (purged, never written) ends it.
    pub fn read(
        &self,
        from: u64,
        to: u64,
        max_bytes: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let log = self.cf(LOG)?;
        let mut out = Vec::new();
        let mut bytes = 0;
        let start = from.to_be_bytes();
        for item in self
            .db
            .iterator_cf(&log, IteratorMode::From(&start, Direction::Forward))
        {
            let (k, v) = item.map_err(|e| self.e(e))?;
            let index = index_of(&k).ok_or_else(|| self.corrupt("a log key is not 8 bytes"))?;
            if index >= to || (index != from + out.len() as u64) {
                break;
            }
            if !out.is_empty() && bytes + v.len() > max_bytes {
                break;
            }
            bytes += v.len();
            out.push((index, v.to_vec()));
        }
        Ok(out)
    }

    /// The last entry's index and bytes, if the log holds any.
    pub fn last(&self) -> Result<Option<(u64, Vec<u8>)>, StoreError> {
        let log = self.cf(LOG)?;
        match self.db.iterator_cf(&log, IteratorMode::End).next() {
            Some(item) => {
                let (k, v) = item.map_err(|e| self.e(e))?;
                let index = index_of(&k).ok_or_else(|| self.corrupt("a log key is not 8 bytes"))?;
                Ok(Some((index, v.to_vec())))
            }
            None => Ok(None),
        }
    }

    /// The first entry's index, if the log holds any.
    pub fn first(&self) -> Result<Option<u64>, StoreError> {
        let log = self.cf(LOG)?;
        match self.db.iterator_cf(&log, IteratorMode::Start).next() {
            Some(item) => {
                let (k, _) = item.map_err(|e| self.e(e))?;
                let index = index_of(&k).ok_or_else(|| self.corrupt("a log key is not 8 bytes"))?;
                Ok(Some(index))
            }
            None => Ok(None),
        }
    }

    /// Delete the entries from `from` on (a conflicting suffix).
    pub fn truncate(&self, from: u64) -> Result<(), StoreError> {
        let log = self.cf(LOG)?;
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(&log, from.to_be_bytes(), u64::MAX.to_be_bytes());
        // delete_range's end is exclusive: the entry at u64::MAX (never used) would stay.
        batch.delete_cf(&log, u64::MAX.to_be_bytes());
        self.db.write(batch).map_err(|e| self.e(e))
    }

    /// Delete the entries up to `upto` (inclusive; a snapshot covers them) and record `upto` as
    /// the last purged index, in one write.
    pub fn purge(&self, upto: u64) -> Result<(), StoreError> {
        self.purge_and_put(upto, None)
    }

    /// `purge`, and in the same write store the named value `key` (what the caller knows of
    /// the purged entry, e.g. its full id), so the two can never disagree after a crash. A
    /// stale purge (below the last purged index) leaves the value as it is.
    pub fn purge_with_meta(&self, upto: u64, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        self.purge_and_put(upto, Some((key, value)))
    }

    fn purge_and_put(&self, upto: u64, put: Option<(&[u8], &[u8])>) -> Result<(), StoreError> {
        let log = self.cf(LOG)?;
        let meta = self.cf(META)?;
        // The last purged index never goes back (a stale purge after a newer one).
        let prior = self.last_purged()?.unwrap_or(0);
        let stale = upto < prior;
        let upto = upto.max(prior);
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(
            &log,
            0u64.to_be_bytes(),
            upto.saturating_add(1).to_be_bytes(),
        );
        batch.put_cf(&meta, LAST_PURGED, upto.to_be_bytes());
        if let (Some((key, value)), false) = (put, stale) {
            batch.put_cf(&meta, key, value);
        }
        self.db.write(batch).map_err(|e| self.e(e))
    }

    /// The last purged index (`purge`), if any.
    pub fn last_purged(&self) -> Result<Option<u64>, StoreError> {
        match self.get_meta(LAST_PURGED)? {
            Some(v) => index_of(&v)
                .map(Some)
                .ok_or_else(|| self.corrupt("the last purged index is not 8 bytes")),
            None => Ok(None),
        }
    }

    /// Store a named value (the vote, the committed index, the node's identity); with `sync`,
    /// return only once it (and everything written before it) is on disk.
    pub fn put_meta(&self, key: &[u8], value: &[u8], sync: bool) -> Result<(), StoreError> {
        let meta = self.cf(META)?;
        let mut opts = WriteOptions::default();
        opts.set_sync(sync);
        let mut batch = WriteBatch::default();
        batch.put_cf(&meta, key, value);
        self.db.write_opt(batch, &opts).map_err(|e| self.e(e))
    }

    /// A named value stored with `put_meta`.
    pub fn get_meta(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let meta = self.cf(META)?;
        self.db.get_cf(&meta, key).map_err(|e| self.e(e))
    }

    fn corrupt(&self, detail: &str) -> StoreError {
        StoreError::Corrupt {
            path: self.path.clone(),
            detail: detail.to_string(),
        }
    }
}

fn index_of(k: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(k).ok().map(u64::from_be_bytes)
}

fn err(path: &Path, e: rocksdb::Error) -> StoreError {
    StoreError::Io(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn entries(range: std::ops::Range<u64>) -> Vec<(u64, Vec<u8>)> {
        range
            .map(|i| (i, format!("entry {i}").into_bytes()))
            .collect()
    }

    fn append(db: &RaftLogDb, e: &[(u64, Vec<u8>)]) {
        let refs: Vec<(u64, &[u8])> = e.iter().map(|(i, b)| (*i, b.as_slice())).collect();
        db.append(&refs).unwrap();
    }

    #[test]
    fn appended_entries_read_back_in_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = RaftLogDb::open(dir.path()).unwrap();
            assert_eq!(db.last().unwrap(), None);
            append(&db, &entries(1..101));
            // Readable before the sync, as a Raft engine expects.
            assert_eq!(db.read(1, 101, usize::MAX).unwrap(), entries(1..101));
            db.sync().unwrap();
            db.put_meta(b"vote", b"term 3 for node 2", true).unwrap();
        }
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.read(1, 101, usize::MAX).unwrap(), entries(1..101));
        assert_eq!(db.read(50, 53, usize::MAX).unwrap(), entries(50..53));
        assert_eq!(db.last().unwrap(), Some((100, b"entry 100".to_vec())));
        assert_eq!(
            db.get_meta(b"vote").unwrap(),
            Some(b"term 3 for node 2".to_vec())
        );
        assert_eq!(db.get_meta(b"other").unwrap(), None);
        // A byte budget stops the read (at least one entry).
        assert_eq!(db.read(1, 101, 1).unwrap(), entries(1..2));
        assert_eq!(db.read(1, 101, 20).unwrap(), entries(1..3));
    }

    #[test]
    fn truncate_and_purge_leave_what_they_should() {
        let dir = tempfile::tempdir().unwrap();
        let db = RaftLogDb::open(dir.path()).unwrap();
        append(&db, &entries(1..21));
        db.truncate(15).unwrap();
        assert_eq!(db.last().unwrap().map(|(i, _)| i), Some(14));
        // A new leader's suffix replaces the truncated one.
        append(&db, &[(15, b"new 15".to_vec())]);
        assert_eq!(
            db.read(14, 16, usize::MAX).unwrap()[1],
            (15, b"new 15".to_vec())
        );
        db.purge(10).unwrap();
        assert_eq!(db.last_purged().unwrap(), Some(10));
        assert_eq!(
            db.read(0, 100, usize::MAX).unwrap(),
            Vec::new(),
            "nothing left at 0"
        );
        assert_eq!(db.read(11, 100, usize::MAX).unwrap().len(), 5);
        // A stale purge does not move the last purged index back.
        db.purge(5).unwrap();
        assert_eq!(db.last_purged().unwrap(), Some(10));
        // Everything purged: the end of the log is still known.
        db.purge(15).unwrap();
        assert_eq!(db.last().unwrap(), None);
        assert_eq!(db.last_purged().unwrap(), Some(15));
        drop(db);
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.last_purged().unwrap(), Some(15));
        assert_eq!(db.last().unwrap(), None);
    }

    #[test]
    fn first_and_purge_with_meta() {
        let dir = tempfile::tempdir().unwrap();
        let db = RaftLogDb::open(dir.path()).unwrap();
        assert_eq!(db.first().unwrap(), None);
        append(&db, &entries(3..11));
        assert_eq!(db.first().unwrap(), Some(3));
        db.purge_with_meta(5, b"purged id", b"five").unwrap();
        assert_eq!(db.first().unwrap(), Some(6));
        assert_eq!(db.last_purged().unwrap(), Some(5));
        assert_eq!(db.get_meta(b"purged id").unwrap(), Some(b"five".to_vec()));
        // A stale purge keeps both the index and the value.
        db.purge_with_meta(4, b"purged id", b"four").unwrap();
        assert_eq!(db.last_purged().unwrap(), Some(5));
        assert_eq!(db.get_meta(b"purged id").unwrap(), Some(b"five".to_vec()));
        db.purge_with_meta(10, b"purged id", b"ten").unwrap();
        assert_eq!(db.first().unwrap(), None);
        assert_eq!(db.get_meta(b"purged id").unwrap(), Some(b"ten".to_vec()));
    }

    /// The write-ahead-log files' bytes in `dir`. A file RocksDB deletes between the listing
    /// and its size counts nothing (CI once saw one go in that instant).
    fn wal_bytes(dir: &Path) -> u64 {
        bytes_of(dir, ".log")
    }

    fn bytes_of(dir: &Path, suffix: &str) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
            .map(|e| match e.metadata() {
                Ok(m) => m.len(),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => 0,
                Err(err) => panic!("{}: {err}", e.path().display()),
            })
            .sum()
    }

    #[test]
    fn the_write_ahead_log_is_reclaimed_while_the_log_grows() {
        // Appends with a metadata write (the committed index) among them, as openraft makes
        // them: RocksDB's default bound kept every file of the write-ahead log, about a
        // gigabyte, since `meta`'s memtable never filled.
        let dir = tempfile::tempdir().unwrap();
        let db = RaftLogDb::open(dir.path()).unwrap();
        let body = vec![7u8; 256 * 1024];
        let total = 6 * WAL_BYTES;
        let mut most = 0;
        for i in 0..total / body.len() as u64 {
            db.append(&[(i + 1, body.as_slice())]).unwrap();
            db.put_meta(b"committed", &i.to_be_bytes(), false).unwrap();
            most = most.max(wal_bytes(dir.path()));
        }
        // Old files go once a background flush is done with them.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while wal_bytes(dir.path()) > 2 * WAL_BYTES && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let left = wal_bytes(dir.path());
        assert!(
            left <= 2 * WAL_BYTES,
            "{left} bytes of write-ahead log kept after {total} written (peak {most})"
        );
        assert_eq!(
            db.last().unwrap().map(|(i, _)| i),
            Some(total / body.len() as u64)
        );
    }

    #[test]
    fn purged_entries_leave_the_disk() {
        // Incompressible entries (as bodies of random bytes are), purged behind the last few
        // as openraft does behind snapshots: the table files the memtables were flushed to go
        // too, not only the write-ahead log.
        let dir = tempfile::tempdir().unwrap();
        let db = RaftLogDb::open(dir.path()).unwrap();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut body = vec![0u8; 256 * 1024];
        let total = 8 * WAL_BYTES;
        let n = total / body.len() as u64;
        for i in 1..=n {
            for chunk in body.chunks_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
            }
            db.append(&[(i, body.as_slice())]).unwrap();
            if i % 128 == 0 {
                db.purge(i - 8).unwrap();
            }
        }
        db.purge(n - 8).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let limit = 3 * WAL_BYTES;
        while bytes_of(dir.path(), ".sst") > limit && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let left = bytes_of(dir.path(), ".sst");
        assert!(
            left <= limit,
            "{left} bytes of table files kept after {total} appended and all but 8 entries purged"
        );
        assert_eq!(db.first().unwrap(), Some(n - 7));
    }

    #[test]
    fn a_gap_ends_a_read() {
        let dir = tempfile::tempdir().unwrap();
        let db = RaftLogDb::open(dir.path()).unwrap();
        append(&db, &entries(1..4));
        append(&db, &entries(5..8));
        assert_eq!(db.read(1, 8, usize::MAX).unwrap(), entries(1..4));
        assert_eq!(db.read(5, 8, usize::MAX).unwrap(), entries(5..8));
    }
}

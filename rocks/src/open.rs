//! Opening the RocksDB store: the options and why, and the checks that refuse a damaged store
//! rather than start with part of it (the README's "nothing is discarded").
//!
//! What a damaged store looks like, and how each case is caught:
//! - A torn tail: a crash (SIGKILL, power loss) in the middle of appending to the write-ahead log
//!   leaves its last record incomplete. That record was never fsynced, so never confirmed:
//!   `TolerateCorruptedTailRecords` drops it and opens. (`AbsoluteConsistency` would refuse
//!   that too, and a broker killed mid-write would then not start.)
//! - Damage inside a log (a flipped bit): the record's checksum fails. The default
//!   `PointInTimeRecovery` stopped replaying there, opened anyway and deleted the log: every
//!   later record was gone without a word. `TolerateCorruptedTailRecords` refuses instead
//!   (db/log_reader.cc only forgives an incomplete record at the end of a log).
//! - A log cut short, or gone: to the log reader a log cut at any point looks like a torn tail,
//!   and RocksDB's own tracking does not cover the live log (`track_and_verify_wals_in_manifest`
//!   records synced sizes of inactive logs only; `track_and_verify_wals` catches a missing log
//!   among several and a folder with none). So the store writes down the sequence number of the
//!   last write it fsynced, in `WARREN-CONFIRMED` (a few times a second, off the commit path: see
//!   `maintenance`), and at open refuses a store that ends before it. A torn tail only ever
//!   drops writes after the last fsync, so it never trips this check; a cut or lost log that
//!   removes confirmed writes does (unless it only removed the last ~200 ms of them, written
//!   after the file was last updated).
//! - A damaged table file: its blocks' checksums fail when read. Recovery reads every stored
//!   key (`recover_all`), so a damaged block holding live data stops the start naming the file.
//!   `paranoid_checks` refuses table files that cannot even be opened.
//! - A missing MANIFEST: RocksDB cannot tell which table files are live; refused, named.

use super::{Db, MESSAGES, META, SHARED};
use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBRecoveryMode, InfoLogger, LogLevel,
    Options, WriteBufferManager, WriteOptions,
};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use warren_storage::StoreError;

/// Memory the store may use for block cache and memtables (each), across all queues.
const BLOCK_CACHE_BYTES: usize = 16 * 1024 * 1024;
const MEMTABLE_BUDGET_BYTES: usize = 24 * 1024 * 1024;
const CF_WRITE_BUFFER_BYTES: usize = 4 * 1024 * 1024;
pub(crate) const MESSAGES_WRITE_BUFFER_BYTES: usize = 8 * 1024 * 1024;

/// Descriptors the store needs besides open table files: logs, MANIFEST, LOCK, the folder,
/// table files being written by a flush or a compaction, the watermark file.
pub const STORE_OTHER_FILES: u64 = 16;

/// The file naming the last sequence number known fsynced (see the module comment).
pub(crate) const WATERMARK: &str = "WARREN-CONFIRMED";
const WATERMARK_HEADER: &str = "warren-confirmed-sequence v1";

/// A key every column family holds forever, so that each has a table file from its first open
/// on: RocksDB's repair (the `--recover-damaged` path for a lost MANIFEST) learns column
/// families only from table files, and drops every logged write to one it does not know. The
/// empty key sorts before every queue's (`m...`), entity (`e`/`q`/`b`...) and body (8-byte) key;
/// the scans over whole column families skip it.
pub(crate) const SENTINEL: &[u8] = b"";

/// How many table files RocksDB may keep open: a quarter of the process's descriptor limit
/// (the rest is for sockets, one per client connection, and the store's other files), at least
/// 64 (RocksDB needs some to work at all, and keeps 10 of them for its other files) and at most
/// 5,000 (each open table holds its index and filter blocks in memory). RocksDB's default, -1,
/// keeps every table file open, and opens all of them at start: a folder with more table files
/// than the limit could not be opened again.
pub fn max_open_files() -> i32 {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    (soft / 4).clamp(64, 5000) as i32
}

/// How the store is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every start, and a reopen after a failed write: refuse what is not a torn tail.
    Strict,
    /// `Strict`, read-only: a first look at start, which changes nothing on disk. A read-write
    /// open replays the logs into table files and deletes them before Warren could compare
    /// what they held with what it confirmed; a refused store must be left as it was.
    Check,
    /// Just after RocksDB's repair, which leaves no log behind (`track_and_verify_wals` would
    /// refuse a folder without one).
    AfterRepair,
    /// A look at a damaged store before repairing it: read-only, read what can be read.
    Survey,
}

/// Lines RocksDB logs at warning level or above: forwarded to Warren's log (rate-limited) and,
/// while an open or a repair runs, kept so that an error can name the damaged files (RocksDB's
/// status says "checksum mismatch"; its log line says which file and how many bytes).
#[derive(Default)]
pub(crate) struct RocksLog {
    capture: Mutex<Option<Vec<String>>>,
    /// Start of the current 10 s window and lines forwarded in it.
    window: Mutex<Option<(Instant, u32)>>,
}

impl RocksLog {
    fn line(&self, level: LogLevel, msg: &str) {
        // The callback logger also gets RocksDB's INFO-level header lines (the options dump at
        // each open) whatever its level: only warnings and errors are kept.
        let error = match level {
            LogLevel::Warn => false,
            LogLevel::Error | LogLevel::Fatal => true,
            _ => return,
        };
        let msg = msg.trim_end();
        // Logged at warning level on every table file open (often, with `max_open_files`
        // bounded), and nothing to act on.
        if msg.contains("Tail prefetch size") || msg.contains("opened without unique ID") {
            return;
        }
        if let Some(lines) = lock(&self.capture).as_mut() {
            if lines.len() < 200 {
                lines.push(msg.to_string());
            }
        }
        {
            let mut w = lock(&self.window);
            let now = Instant::now();
            let (since, n) = w.get_or_insert((now, 0));
            if now.duration_since(*since) > Duration::from_secs(10) {
                *since = now;
                *n = 0;
            }
            *n += 1;
            if *n > 20 {
                if *n == 21 {
                    tracing::warn!(target: "rocksdb", "more RocksDB messages in the next 10 s not logged");
                }
                return;
            }
        }
        if error {
            tracing::error!(target: "rocksdb", "{msg}");
        } else {
            tracing::warn!(target: "rocksdb", "{msg}");
        }
    }

    fn start_capture(&self) {
        *lock(&self.capture) = Some(Vec::new());
    }

    fn take_capture(&self) -> Vec<String> {
        lock(&self.capture).take().unwrap_or_default()
    }

    fn logger(self: &Arc<Self>) -> InfoLogger {
        let log = self.clone();
        InfoLogger::new_callback_logger(LogLevel::Warn, move |level, msg| log.line(level, msg))
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What every open of one store shares (a reopen after a failed write uses the same).
pub(crate) struct Tuning {
    cache: Cache,
    buffers: WriteBufferManager,
    pub(crate) max_open_files: i32,
    pub(crate) log: Arc<RocksLog>,
    /// Writes skip the write-ahead log (`OpenOptions::unlogged`): column families are then
    /// flushed together (`atomic_flush`), so what is on disk is always the state after one
    /// whole write, across all of them.
    pub(crate) unlogged: bool,
}

impl Tuning {
    pub(crate) fn new(unlogged: bool) -> Self {
        let cache = Cache::new_lru_cache(BLOCK_CACHE_BYTES);
        let buffers = WriteBufferManager::new_write_buffer_manager_with_cache(
            MEMTABLE_BUDGET_BYTES,
            false,
            cache.clone(),
        );
        Tuning {
            cache,
            buffers,
            max_open_files: max_open_files(),
            log: Arc::new(RocksLog::default()),
            unlogged,
        }
    }

    fn cf_options(&self) -> Options {
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(&self.cache);
        let mut cf = Options::default();
        cf.set_write_buffer_size(CF_WRITE_BUFFER_BYTES);
        cf.set_max_write_buffer_number(2);
        cf.set_block_based_table_factory(&table);
        cf.set_compression_type(rocksdb::DBCompressionType::Lz4);
        cf
    }

    pub(crate) fn db_options(&self, mode: Mode) -> Result<Options, StoreError> {
        let mut cf = self.cf_options();
        // `track_and_verify_wals` has no setter in the crate: through RocksDB's option string.
        // Each new log records the number, size and last sequence number of the one before, so
        // a missing or shortened older log (or a folder with no log at all) is refused.
        let mut o = cf
            .get_options_from_string(if matches!(mode, Mode::Strict | Mode::Check) {
                "track_and_verify_wals=true"
            } else {
                "track_and_verify_wals=false"
            })
            .map_err(|e| StoreError::Io(format!("RocksDB options: {e}")))?;
        o.create_if_missing(true);
        o.create_missing_column_families(true);
        o.set_write_buffer_manager(&self.buffers);
        // Bound the WAL so idle queues' memtables get flushed rather than pinning old logs.
        o.set_max_total_wal_size(128 * 1024 * 1024);
        o.set_max_open_files(self.max_open_files);
        // Without a log, a flush of one column family alone could put on disk a write's
        // messages without its applied position (or the reverse). Flushing on close is
        // RocksDB's default (`avoid_flush_during_shutdown` false): a clean stop keeps all.
        o.set_atomic_flush(self.unlogged);
        // Refuse table files that cannot be opened, and stop writing after a failed write
        // (the store reopens itself once the cause is gone: see `maintenance`).
        o.set_paranoid_checks(mode != Mode::Survey);
        o.set_wal_recovery_mode(if mode == Mode::Survey {
            DBRecoveryMode::SkipAnyCorruptedRecord
        } else {
            DBRecoveryMode::TolerateCorruptedTailRecords
        });
        // Synced sizes of inactive logs go into the MANIFEST: a missing or shortened one is
        // refused at open.
        o.set_track_and_verify_wals_in_manifest(mode != Mode::Survey);
        // Last: the option string above gave back options without the crate's logger handle.
        o.set_info_logger(self.log.logger());
        Ok(o)
    }

    fn descriptors(&self, names: &[String]) -> Vec<ColumnFamilyDescriptor> {
        let cf = self.cf_options();
        let mut messages = cf.clone();
        messages.set_write_buffer_size(MESSAGES_WRITE_BUFFER_BYTES);
        names
            .iter()
            .map(|n| {
                ColumnFamilyDescriptor::new(
                    n,
                    if n == MESSAGES {
                        messages.clone()
                    } else {
                        cf.clone()
                    },
                )
            })
            .collect()
    }
}

pub(crate) fn map_err(path: &Path, e: rocksdb::Error) -> StoreError {
    let text = e.to_string();
    if text.contains("lock") && (text.contains("LOCK") || text.contains("Resource temporarily")) {
        StoreError::Locked(path.to_path_buf())
    } else if text.contains("No space left") || text.contains("ENOSPC") {
        StoreError::NoSpace(text)
    } else if e.kind() == rocksdb::ErrorKind::Corruption || text.contains("corrupt") {
        StoreError::Corrupt {
            path: path.to_path_buf(),
            detail: text,
        }
    } else {
        StoreError::Io(format!("{}: {text}", path.display()))
    }
}

/// RocksDB's lines about damage, from an open or a repair (they name files and byte counts).
pub(crate) fn damage_lines(lines: &[String]) -> Vec<String> {
    const WORDS: [&str; 8] = [
        "Corruption",
        "corrupt",
        "dropping",
        "ignoring",
        "mismatch",
        "Missing",
        "Repaired",
        "lost",
    ];
    lines
        .iter()
        .filter(|l| WORDS.iter().any(|w| l.contains(w)))
        .take(20)
        .cloned()
        .collect()
}

/// A store whose CURRENT names a MANIFEST that is not there cannot be opened; RocksDB would say
/// "No such file or directory", which reads like a missing folder. Say what it is.
fn check_manifest(path: &Path) -> Result<(), StoreError> {
    let Ok(current) = std::fs::read(path.join("CURRENT")) else {
        return Ok(());
    };
    let name = String::from_utf8_lossy(&current).trim().to_string();
    let named = !name.is_empty() && !name.contains('/') && name.starts_with("MANIFEST-");
    if named && path.join(&name).is_file() {
        return Ok(());
    }
    Err(StoreError::Corrupt {
        path: path.to_path_buf(),
        detail: if named {
            format!(
                "the MANIFEST ({name}, named by CURRENT) is missing: RocksDB cannot tell which \
                 table files hold the data"
            )
        } else {
            format!("CURRENT does not name a MANIFEST (it holds {name:?})")
        },
    })
}

/// Open RocksDB on `path` (creating it if need be) with all of Warren's column families.
pub(crate) fn open_db(path: &Path, tuning: &Tuning, mode: Mode) -> Result<Db, StoreError> {
    std::fs::create_dir_all(path)
        .map_err(|e| StoreError::Io(format!("{}: {e}", path.display())))?;
    check_manifest(path)?;
    let opts = tuning.db_options(mode)?;
    let existing = match Db::list_cf(&opts, path) {
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
    tuning.log.start_capture();
    let opened = if matches!(mode, Mode::Survey | Mode::Check) {
        Db::open_cf_descriptors_read_only(&opts, path, tuning.descriptors(&names), false)
    } else {
        Db::open_cf_descriptors(&opts, path, tuning.descriptors(&names))
    };
    let lines = tuning.log.take_capture();
    opened.map_err(|e| {
        let mut err = map_err(path, e);
        let damage = damage_lines(&lines);
        if let StoreError::Corrupt { detail, .. } = &mut err {
            if !damage.is_empty() {
                detail.push_str(&format!(" (RocksDB: {})", damage.join("; ")));
            }
        }
        err
    })
}

/// Give every column family a table file (see [`SENTINEL`]); done once in a store's life.
pub(crate) fn ensure_sentinels(db: &Db) -> Result<(), rocksdb::Error> {
    let mut sync = WriteOptions::default();
    sync.set_sync(true);
    for name in [META, MESSAGES, SHARED] {
        let Some(h) = db.cf_handle(name) else {
            continue;
        };
        if db.get_cf(&h, SENTINEL)?.is_none() {
            db.put_cf_opt(&h, SENTINEL, b"", &sync)?;
            db.flush_cf(&h)?;
        }
    }
    Ok(())
}

/// The sequence number recorded as last fsynced, if the file is there and readable.
pub(crate) fn read_watermark(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path.join(WATERMARK)).ok()?;
    let mut lines = text.lines();
    let parsed = (lines.next() == Some(WATERMARK_HEADER))
        .then(|| lines.next().and_then(|l| l.trim().parse::<u64>().ok()))
        .flatten();
    if parsed.is_none() {
        // Written through a rename, so this is not a torn write: someone edited it. It only
        // guards against lost writes; without it the store still opens.
        tracing::warn!(file = %path.join(WATERMARK).display(), "unreadable; ignored");
    }
    parsed
}

/// Record `seq` as fsynced: a new file, fsynced, renamed over the old one (never a torn file).
/// The folder is not fsynced: after a crash that loses the rename, the older, lower number is
/// still true, only a weaker check.
pub(crate) fn write_watermark(path: &Path, seq: u64) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.join(format!("{WATERMARK}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(format!("{WATERMARK_HEADER}\n{seq}\n").as_bytes())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path.join(WATERMARK))
}

/// The write-ahead log files in `path`, with their sizes (for error messages).
pub(crate) fn log_files(path: &Path) -> Vec<(String, u64)> {
    let mut logs: Vec<(String, u64)> = std::fs::read_dir(path)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    name.ends_with(".log")
                        .then(|| (name, e.metadata().map(|m| m.len()).unwrap_or(0)))
                })
                .collect()
        })
        .unwrap_or_default();
    logs.sort();
    logs
}

/// Refuse a store that ends before the last write it confirmed (a lost or shortened log).
pub(crate) fn check_watermark(path: &Path, recovered: u64) -> Result<(), StoreError> {
    let Some(confirmed) = read_watermark(path) else {
        return Ok(());
    };
    if confirmed <= recovered {
        return Ok(());
    }
    let logs = log_files(path);
    let logs = if logs.is_empty() {
        "there is no write-ahead log file".to_string()
    } else {
        format!(
            "write-ahead log {}",
            logs.iter()
                .map(|(n, s)| format!("{n} ({s} bytes)"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Err(StoreError::Corrupt {
        path: path.to_path_buf(),
        detail: format!(
            "writes confirmed to clients are missing: the store ends at sequence number \
             {recovered}, but {confirmed} had been fsynced ({WATERMARK}); {logs}: it was cut \
             short or removed"
        ),
    })
}

/// Copy every file of the store to a new folder beside it, `damaged-<unix time>`, before
/// anything changes them.
pub(crate) fn copy_aside(path: &Path) -> Result<PathBuf, StoreError> {
    let io = |e: std::io::Error, p: &Path| StoreError::Io(format!("{}: {e}", p.display()));
    let parent = path.parent().unwrap_or(Path::new("."));
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut aside = parent.join(format!("damaged-{secs}"));
    let mut n = 1;
    while aside.exists() {
        aside = parent.join(format!("damaged-{secs}-{n}"));
        n += 1;
    }
    fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(to)?;
        for e in std::fs::read_dir(from)? {
            let e = e?;
            let target = to.join(e.file_name());
            if e.file_type()?.is_dir() {
                copy_dir(&e.path(), &target)?;
            } else {
                std::fs::copy(e.path(), &target)?;
                std::fs::File::open(&target)?.sync_all()?;
            }
        }
        std::fs::File::open(to)?.sync_all()
    }
    copy_dir(path, &aside).map_err(|e| io(e, &aside))?;
    Ok(aside)
}

/// RocksDB's repair: a new MANIFEST from the table files found, logs turned into table files
/// (skipping damaged records), unreadable table files set aside in `lost/`. Returns its
/// warnings (which files, how many bytes).
pub(crate) fn repair(path: &Path, tuning: &Tuning) -> Result<Vec<String>, StoreError> {
    let opts = tuning.db_options(Mode::AfterRepair)?;
    tuning.log.start_capture();
    let repaired = Db::repair(&opts, path);
    let lines = tuning.log.take_capture();
    repaired.map_err(|e| map_err(path, e))?;
    Ok(lines)
}

//! The store's two background threads.
//!
//! `warren-store-sync`: every 200 ms, records the highest fsynced sequence number in
//! `WARREN-CONFIRMED` (off the commit path: one small fsync a few times a second at most, shared
//! by every commit meanwhile; see `open`), and every second looks at the database's health.
//!
//! Health: RocksDB stops a database for good after a background error it does not resume from
//! (with `paranoid_checks`, any I/O error in a flush, a compaction or the log: EMFILE at the
//! descriptor limit, say; only ENOSPC and errors marked retryable are resumed, and the C API has
//! no `Resume`). Every write then fails with that error until a restart. So: a failed write is
//! followed by an empty write, which fails only while the database is stopped; once it is, and
//! files can be created and written in the folder again, the database is closed and opened
//! again in-process (the log holds every write that succeeded; transient messages spilled
//! without the log since the last flush are lost, and the broker forgets them when it finds
//! them missing). A full disk is left to RocksDB's own recovery for a minute first.
//!
//! `warren-store-compact`: compacts the key ranges of deleted and purged queues that still have
//! table files (so their space comes back without waiting for level compaction, which never
//! picks files whose level is under its size target), and twice a second merges runs of small
//! table files. A queue's keys only grow, so each flushed file covers a key range no other file
//! touches; level compaction then moves such files down a level instead of merging them, and
//! nothing merges neighbouring small files in a level: with compressible bodies (an 8 MiB
//! memtable becomes a ~90 KB file) a flood left one file per flush, each an open descriptor.

use super::open::{self, lock, Mode};
use super::{Db, Inner, View, MESSAGES};
use rocksdb::{BottommostLevelCompaction, CompactOptions, LiveFile, WriteBatch, WriteOptions};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use warren_storage::StoreError;

/// Table files below this size are small: a memtable's worth of incompressible messages is
/// 8 MiB; smaller files come from compressible bodies or early flushes.
const SMALL_FILE: usize = 4 << 20;
/// Merge small files once this many sit next to each other in a level (fewer are not worth
/// rewriting; a merged file still small joins the next run).
pub(crate) const MERGE_RUN: usize = 8;
const MERGE_EVERY: Duration = Duration::from_millis(500);
/// Deleted ranges queue up for this long before they are compacted together.
const RANGES_EVERY: Duration = Duration::from_millis(500);
/// A stopped database is reopened after this long (RocksDB may still resume by itself)...
const REOPEN_AFTER: Duration = Duration::from_secs(2);
/// ...or this long for a full disk (RocksDB's SstFileManager resumes those by itself).
const REOPEN_AFTER_NO_SPACE: Duration = Duration::from_secs(60);
/// At most one log line per this long about a stopped or closed store.
const REPORT_EVERY: Duration = Duration::from_secs(30);

/// Work for the background threads, and their stop signal.
#[derive(Default)]
pub(crate) struct Jobs {
    state: Mutex<JobState>,
    wake: Condvar,
    /// Held by whoever compacts (see `View::reclaim`).
    pub(crate) compacting: Mutex<()>,
}

#[derive(Default)]
struct JobState {
    stop: bool,
    /// Deleted key ranges (inclusive) of `messages` to compact.
    ranges: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Jobs {
    pub(crate) fn compact_later(&self, ranges: Vec<(Vec<u8>, Vec<u8>)>) {
        let mut st = lock(&self.state);
        st.ranges.extend(ranges);
        drop(st);
        self.wake.notify_all();
    }

    /// Sleep up to `timeout` (less if woken); false once stopping.
    fn sleep(&self, timeout: Duration) -> bool {
        let st = lock(&self.state);
        if st.stop {
            return false;
        }
        let (st, _) = self
            .wake
            .wait_timeout(st, timeout)
            .unwrap_or_else(|e| e.into_inner());
        !st.stop
    }

    fn take_ranges(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        std::mem::take(&mut lock(&self.state).ranges)
    }
}

/// Whether the database takes writes.
#[derive(Default)]
pub(crate) struct Health {
    stopped: Option<Stopped>,
    /// The last reopen failed with this: the database is closed until one succeeds.
    reopen_failed: Option<String>,
    last_report: Option<Instant>,
}

struct Stopped {
    since: Instant,
    error: String,
    no_space: bool,
}

impl Health {
    pub(crate) fn describe(&self) -> String {
        match (&self.reopen_failed, &self.stopped) {
            (Some(e), _) => format!("reopening failed: {e}"),
            (None, Some(s)) => format!("stopped after: {}", s.error),
            (None, None) => "healthy".into(),
        }
    }

    /// Whether to log about it now (rate-limited).
    fn report(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last_report
            .is_some_and(|t| now.duration_since(t) < REPORT_EVERY)
        {
            return false;
        }
        self.last_report = Some(now);
        true
    }
}

pub(crate) fn start(inner: &Arc<Inner>) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    for (name, run) in [
        ("warren-store-sync", sync_loop as fn(Arc<Inner>)),
        ("warren-store-compact", compact_loop),
    ] {
        let inner = inner.clone();
        match std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(inner))
        {
            Ok(t) => threads.push(t),
            // The store works without them, less well: say so.
            Err(e) => tracing::error!(error = %e, thread = name, "cannot start a store thread"),
        }
    }
    threads
}

pub(crate) fn stop(inner: &Inner, threads: Vec<std::thread::JoinHandle<()>>) {
    lock(&inner.jobs.state).stop = true;
    inner.jobs.wake.notify_all();
    for t in threads {
        let _ = t.join();
    }
}

fn sync_loop(inner: Arc<Inner>) {
    let mut written = 0u64;
    let mut failed_since: Option<Instant> = None;
    let mut last_health = Instant::now();
    let mut record = |written: &mut u64| {
        let c = inner.confirmed.load(Ordering::Acquire);
        if c == *written {
            return;
        }
        match open::write_watermark(&inner.path, c) {
            Ok(()) => {
                *written = c;
                failed_since = None;
            }
            Err(e) => {
                if failed_since.is_none_or(|t| t.elapsed() > REPORT_EVERY) {
                    failed_since = Some(Instant::now());
                    tracing::warn!(error = %e, file = %inner.path.join(open::WATERMARK).display(), "cannot record the last confirmed write");
                }
            }
        }
    };
    while inner.jobs.sleep(Duration::from_millis(200)) {
        record(&mut written);
        if last_health.elapsed() >= Duration::from_secs(1) {
            last_health = Instant::now();
            check_health(&inner);
        }
    }
    // Every thread that writes has stopped: this is the last word.
    record(&mut written);
}

fn compact_loop(inner: Arc<Inner>) {
    let mut last_merge = Instant::now();
    let options = {
        let mut o = CompactOptions::default();
        // Automatic compactions go on meanwhile (otherwise level 0 fills and writes stall).
        o.set_exclusive_manual_compaction(false);
        // The ranges and runs are mostly in the last level: rewrite it too.
        o.set_bottommost_level_compaction(BottommostLevelCompaction::ForceOptimized);
        o
    };
    while inner.jobs.sleep(RANGES_EVERY) {
        let ranges = inner.jobs.take_ranges();
        let merge = last_merge.elapsed() >= MERGE_EVERY;
        if ranges.is_empty() && !merge {
            continue;
        }
        let _ = inner.with_view(|v| {
            let _c = lock(&inner.jobs.compacting);
            compact_ranges(v.db, ranges, &options);
            if merge {
                last_merge = Instant::now();
                merge_runs(v.db, &options);
            }
            Ok(())
        });
    }
}

/// Compact deleted ranges that some table file overlaps (a range still only in the memtable
/// goes when the memtable is flushed: a flush drops what a range tombstone covers; compacting
/// it would force a flush, a small file per deleted queue).
fn compact_ranges(db: &Db, mut ranges: Vec<(Vec<u8>, Vec<u8>)>, options: &CompactOptions) {
    if ranges.is_empty() {
        return;
    }
    let Some(h) = db.cf_handle(MESSAGES) else {
        return;
    };
    let Ok(files) = db.live_files() else {
        return;
    };
    let files: Vec<&LiveFile> = files
        .iter()
        .filter(|f| f.column_family_name == MESSAGES)
        .collect();
    ranges.sort();
    let mut merged: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for (from, to) in ranges {
        match merged.last_mut() {
            Some((_, end)) if from <= *end => {
                if to > *end {
                    *end = to;
                }
            }
            _ => merged.push((from, to)),
        }
    }
    for (from, to) in merged {
        let overlaps = files.iter().any(|f| match (&f.start_key, &f.end_key) {
            (Some(s), Some(e)) => s <= &to && &from <= e,
            _ => true,
        });
        if overlaps {
            db.compact_range_cf_opt(&h, Some(&from), Some(&to), options);
        }
    }
}

/// Merge every run of at least [`MERGE_RUN`] neighbouring small files below level 0 of any
/// column family; returns the number of runs merged.
pub(crate) fn merge_small_files(db: &Db) -> usize {
    let mut o = CompactOptions::default();
    o.set_exclusive_manual_compaction(false);
    o.set_bottommost_level_compaction(BottommostLevelCompaction::ForceOptimized);
    merge_runs(db, &o)
}

/// The runs of at least [`MERGE_RUN`] neighbouring small table files below level 0, as
/// (column family, first key, last key).
///
/// Neighbouring in key order across every level of a column family, not within one level: level
/// compaction moves a queue's files down one at a time as levels fill, so a flood's small files
/// end up spread over several levels, a few in each, and runs counted level by level (the first
/// version) were too short to merge while the files stayed (seen on a loaded CI machine). A
/// large file in any level between two small ones ends a run, so a merge never rewrites one.
pub(crate) fn small_file_runs(files: &[LiveFile]) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    let mut by_cf: std::collections::BTreeMap<&str, Vec<&LiveFile>> = Default::default();
    for f in files.iter().filter(|f| f.level >= 1) {
        by_cf.entry(&f.column_family_name).or_default().push(f);
    }
    let mut runs = Vec::new();
    for (cf, mut fs) in by_cf {
        fs.sort_by(|a, b| a.start_key.cmp(&b.start_key));
        let mut run: Vec<&LiveFile> = Vec::new();
        let mut close = |run: &mut Vec<&LiveFile>| {
            if run.len() >= MERGE_RUN {
                if let (Some(Some(s)), Some(e)) = (
                    run.first().map(|f| f.start_key.clone()),
                    run.iter().filter_map(|f| f.end_key.clone()).max(),
                ) {
                    runs.push((cf.to_string(), s, e));
                }
            }
            run.clear();
        };
        for f in fs {
            if f.size < SMALL_FILE && f.start_key.is_some() {
                run.push(f);
            } else {
                close(&mut run);
            }
        }
        close(&mut run);
    }
    runs
}

fn merge_runs(db: &Db, options: &CompactOptions) -> usize {
    let Ok(files) = db.live_files() else {
        return 0;
    };
    tracing::debug!(
        files = files.len(),
        l0 = files.iter().filter(|f| f.level == 0).count(),
        "table files"
    );
    let runs = small_file_runs(&files);
    for (cf, s, e) in &runs {
        let Some(h) = db.cf_handle(cf) else {
            continue;
        };
        let started = Instant::now();
        db.compact_range_cf_opt(&h, Some(s), Some(e), options);
        tracing::debug!(cf = %cf, took = ?started.elapsed(), "merged a run of small table files");
    }
    runs.len()
}

/// After a failed write: does the database still take writes? An empty write answers
/// cheaply (RocksDB returns its background error to every write while stopped).
pub(crate) fn after_failed_write(v: &View<'_>, e: &StoreError) {
    let mut no_wal = WriteOptions::default();
    no_wal.disable_wal(true);
    let Err(stopped) = v.db.write_opt(WriteBatch::default(), &no_wal) else {
        return;
    };
    let mut h = lock(&v.inner.health);
    if h.stopped.is_some() {
        return;
    }
    let error = stopped.to_string();
    let no_space = matches!(e, StoreError::NoSpace(_)) || error.contains("No space left");
    if no_space {
        tracing::warn!(%error, "the store stopped taking writes: the disk is full (RocksDB resumes once space is freed)");
    } else {
        tracing::error!(%error, "the store stopped taking writes after an error RocksDB does not recover from; it is reopened once files can be written again");
    }
    h.last_report = Some(Instant::now());
    h.stopped = Some(Stopped {
        since: Instant::now(),
        error,
        no_space,
    });
}

fn check_health(inner: &Inner) {
    let (since, no_space, closed) = {
        let h = lock(&inner.health);
        match (&h.stopped, &h.reopen_failed) {
            (None, None) => return,
            (Some(s), _) => (s.since, s.no_space, h.reopen_failed.is_some()),
            (None, Some(_)) => (Instant::now() - REOPEN_AFTER, false, true),
        }
    };
    if !closed {
        // RocksDB may have resumed by itself (a full disk, once space is back).
        let mut no_wal = WriteOptions::default();
        no_wal.disable_wal(true);
        let resumed = inner
            .with_view(|v| {
                v.db.write_opt(WriteBatch::default(), &no_wal)
                    .map_err(|e| v.err(e))
            })
            .is_ok();
        if resumed {
            lock(&inner.health).stopped = None;
            tracing::info!("the store takes writes again (RocksDB resumed)");
            return;
        }
    }
    let wait = if no_space {
        REOPEN_AFTER_NO_SPACE
    } else {
        REOPEN_AFTER
    };
    if since.elapsed() < wait {
        return;
    }
    if inner.tuning.unlogged {
        // Closing the database would drop its memtables: applied writes that no log holds.
        // It stays stopped (unless RocksDB resumes it, above); the node's next applied write
        // fails and it stops replicating; a restart applies again from its Raft log.
        let mut h = lock(&inner.health);
        if h.report() {
            tracing::error!(path = %inner.path.display(), state = %h.describe(), "the store stopped after an error and is not reopened while running (it writes no log of its own); restart this node once the cause is gone");
        }
        return;
    }
    if let Err(e) = files_writable(&inner.path) {
        let mut h = lock(&inner.health);
        if h.report() {
            tracing::warn!(error = %e, path = %inner.path.display(), state = %h.describe(), "the store is still stopped: files cannot be created and written in its folder yet");
        }
        return;
    }
    reopen(inner);
}

/// Can the folder take a new file, written and fsynced, with descriptors to spare (a reopen
/// opens a dozen files at once)?
fn files_writable(path: &Path) -> std::io::Result<()> {
    use std::io::Write;
    let probe = path.join(".warren-probe");
    let mut f = std::fs::File::create(&probe)?;
    let spare: std::io::Result<Vec<std::fs::File>> = (0..32).map(|_| f.try_clone()).collect();
    let written = f.write_all(b"probe").and_then(|()| f.sync_all());
    drop(spare?);
    drop(f);
    let _ = std::fs::remove_file(&probe);
    written
}

/// Close the database and open it again (see the module comment).
fn reopen(inner: &Inner) {
    let _w = lock(&inner.writing);
    let mut db = inner.db.write().unwrap_or_else(|e| e.into_inner());
    // Closing a stopped database skips its flush; what the log holds is replayed below.
    drop(db.take());
    match open::open_db(&inner.path, &inner.tuning, Mode::Strict) {
        Ok(opened) => {
            let recovered = opened.latest_sequence_number();
            let confirmed = inner.confirmed.load(Ordering::Acquire);
            if recovered < confirmed {
                tracing::error!(
                    recovered,
                    confirmed,
                    "the reopened store ends before writes it had confirmed"
                );
            }
            inner.last_logged.store(recovered, Ordering::Release);
            let view = View { db: &opened, inner };
            if let Err(e) = view.recount_refs() {
                tracing::error!(error = %e, "recounting shared message references failed");
            }
            *db = Some(opened);
            let mut h = lock(&inner.health);
            let was = h.describe();
            *h = Health::default();
            tracing::info!(path = %inner.path.display(), was = %was, "the store was reopened and takes writes again");
        }
        Err(e) => {
            let mut h = lock(&inner.health);
            h.reopen_failed = Some(e.to_string());
            if h.report() {
                tracing::error!(error = %e, path = %inner.path.display(), "reopening the store failed; retrying every second");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(level: i32, key: u8, size: usize) -> LiveFile {
        LiveFile {
            column_family_name: MESSAGES.into(),
            name: format!("{key}.sst"),
            size,
            level,
            start_key: Some(vec![key, 0]),
            end_key: Some(vec![key, 9]),
            num_entries: 1,
            num_deletions: 0,
        }
    }

    /// Small files spread over levels, a few in each, still form one run in key order; a large
    /// file between them ends it; level 0 is left to level compaction.
    #[test]
    fn runs_of_small_files_are_found_across_levels() {
        let spread: Vec<LiveFile> = (0..9)
            .map(|k| file(1 + i32::from(k % 3), k, 1000))
            .collect();
        let runs = small_file_runs(&spread);
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert_eq!(runs[0].1, vec![0, 0]);
        assert_eq!(runs[0].2, vec![8, 9]);

        let mut broken = spread;
        broken[4].size = SMALL_FILE;
        assert!(small_file_runs(&broken).is_empty());

        let level_0: Vec<LiveFile> = (0..9).map(|k| file(0, k, 1000)).collect();
        assert!(small_file_runs(&level_0).is_empty());
    }
}

//! `--recover-damaged`: start from a damaged store with what can still be read, after keeping a
//! copy of it, and say what was lost.
//!
//! 1. Every file of the store is copied to `damaged-<unix time>/` beside it (nothing is changed
//!    before that copy is fsynced).
//! 2. A read-only look, skipping damaged log records, lists the table files with their entry
//!    counts and key ranges (to say what a table file set aside held).
//! 3. RocksDB's repair: a new MANIFEST from the table files found; the logs are turned into
//!    table files, skipping damaged records; a table file that cannot be read through is set
//!    aside whole (RocksDB cannot skip one damaged block). Its `lost/` folder is removed
//!    afterwards: everything in it is in the copy.
//! 4. The store opens and is scanned as at any start; then the log says: why it was refused,
//!    RocksDB's own account (which log lost how many bytes, which table file was dropped), how
//!    many confirmed writes are missing (sequence numbers: one per stored message, ack or
//!    definition change), messages dropped because their queue's definition was lost, and what
//!    the store holds now, queue by queue.

use super::open::{self, lock, Mode, Tuning};
use super::{RocksStore, MESSAGES, META, SHARED};
use bytes::Bytes;
use rocksdb::LiveFile;
use std::path::Path;
use std::sync::atomic::Ordering;
use warren_storage::codec::decode_entity_key;
use warren_storage::StoreError;

pub(crate) fn salvage(
    path: &Path,
    refused: StoreError,
    unlogged: bool,
) -> Result<RocksStore, StoreError> {
    tracing::warn!(reason = %refused, "the store is damaged; --recover-damaged: keeping a copy, then starting with what can be read");
    let confirmed = open::read_watermark(path);
    let aside = open::copy_aside(path)?;
    tracing::warn!(copy = %aside.display(), "copied the damaged store aside (nothing was changed before)");
    let with_copy = |e: StoreError| match e {
        StoreError::Corrupt { path, detail } => StoreError::Corrupt {
            path,
            detail: format!(
                "{detail} (repair failed; the damaged store is kept in {})",
                aside.display()
            ),
        },
        e => e,
    };
    let tuning = Tuning::new(unlogged);
    let tables = survey(path, &tuning);
    let lines = open::repair(path, &tuning).map_err(with_copy)?;
    // RocksDB moved what it could not use (and the old MANIFEST) there: all of it is in the copy.
    let _ = std::fs::remove_dir_all(path.join("lost"));
    let store = RocksStore::open_checked(path, tuning, Mode::AfterRepair).map_err(with_copy)?;
    let recovered = store.inner.recovered_seq;
    // The old record names writes the repaired store does not have: start it afresh.
    if let Err(e) = open::write_watermark(path, store.inner.confirmed.load(Ordering::Acquire)) {
        tracing::warn!(error = %e, "cannot record the last confirmed write");
    }
    report(&store, &refused, &lines, &tables, confirmed, recovered);
    Ok(store)
}

/// The table files of the damaged store, as far as a read-only open can tell.
fn survey(path: &Path, tuning: &Tuning) -> Vec<LiveFile> {
    match open::open_db(path, tuning, Mode::Survey) {
        Ok(db) => db.live_files().unwrap_or_default(),
        Err(e) => {
            tracing::warn!(error = %e, "the damaged store cannot be opened even read-only; table files are listed by name only");
            Vec::new()
        }
    }
}

/// A key range of a column family, in Warren's terms.
fn describe_range(cf: &str, start: Option<&[u8]>, end: Option<&[u8]>) -> String {
    let message = |k: &[u8]| -> Option<(String, String, u64)> {
        let (prefix, key) = k.split_at(k.len().checked_sub(8)?);
        let (_, vhost, name) = decode_entity_key(Bytes::copy_from_slice(prefix)).ok()?;
        let key = u64::from_be_bytes(key.try_into().ok()?);
        Some((vhost, name, warren_storage::key_id(key)))
    };
    match cf {
        MESSAGES => match (start.and_then(message), end.and_then(message)) {
            (Some((v1, q1, a)), Some((v2, q2, b))) if v1 == v2 && q1 == q2 => {
                format!("messages of queue '{q1}' in vhost '{v1}', ids {a} to {b}")
            }
            (Some((v1, q1, a)), Some((v2, q2, b))) => format!(
                "messages from queue '{q1}' (vhost '{v1}') id {a} to queue '{q2}' (vhost '{v2}') id {b}"
            ),
            _ => "messages".into(),
        },
        META => "exchange, queue and binding definitions".into(),
        SHARED => "bodies of messages routed to several queues".into(),
        other => format!("column family {other}"),
    }
}

fn report(
    store: &RocksStore,
    refused: &StoreError,
    lines: &[String],
    tables: &[LiveFile],
    confirmed: Option<u64>,
    recovered: u64,
) {
    let damage = open::damage_lines(lines);
    for l in &damage {
        tracing::warn!(rocksdb = %l, "repair");
    }
    // "Table #12: ignoring Corruption: ..." names a table file set aside.
    let dropped: Vec<u64> = lines
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("Table #")? + 7..];
            let n = rest.split(|c: char| !c.is_ascii_digit()).next()?;
            rest[n.len()..]
                .starts_with(": ignoring")
                .then(|| n.parse().ok())
                .flatten()
        })
        .collect();
    for n in &dropped {
        let name = format!("{n:06}.sst");
        match tables.iter().find(|t| t.name.ends_with(&name)) {
            Some(t) => tracing::warn!(
                file = %name,
                column_family = %t.column_family_name,
                level = t.level,
                bytes = t.size,
                entries = t.num_entries,
                deletions = t.num_deletions,
                held = %describe_range(&t.column_family_name, t.start_key.as_deref(), t.end_key.as_deref()),
                "lost: a damaged table file was set aside whole (its deletions may bring acked messages back)"
            ),
            None => tracing::warn!(file = %name, "lost: a damaged table file was set aside whole"),
        }
    }
    match confirmed {
        Some(c) if c > recovered => tracing::warn!(
            missing = c - recovered,
            from = recovered + 1,
            to = c,
            "lost: confirmed writes not recovered (sequence numbers: one per message stored, ack, or definition change)"
        ),
        Some(_) if damage.iter().any(|l| l.contains("dropping")) => tracing::warn!(
            "lost: the log records RocksDB dropped (bytes above); the store still reaches the last confirmed write on record, so what follows them was kept"
        ),
        Some(_) => tracing::warn!(
            "the store reaches the last confirmed write on record (WARREN-CONFIRMED, at most 200 ms behind the last write)"
        ),
        None => tracing::warn!("no record of confirmed writes (WARREN-CONFIRMED) to compare with"),
    }
    for (vhost, queue, n) in lock(&store.inner.orphans).iter() {
        tracing::warn!(%vhost, %queue, messages = n, "lost: messages dropped, their queue's definition is gone");
    }
    let held = lock(&store.inner.recovered);
    if let Some(r) = held.as_ref() {
        let mut exchanges = 0;
        let mut queues = 0;
        let mut bindings = 0;
        for op in &r.ops {
            match op {
                warren_storage::Op::DeclareExchange { .. } => exchanges += 1,
                warren_storage::Op::DeclareQueue { .. } => queues += 1,
                warren_storage::Op::Bind { .. } => bindings += 1,
                _ => {}
            }
        }
        let mut messages = 0;
        for q in &r.queues {
            let n: u64 = q.levels.iter().map(|l| l.count).sum();
            messages += n;
            tracing::warn!(vhost = %q.vhost, queue = %q.name, messages = n, "recovered");
        }
        tracing::warn!(
            exchanges,
            queues,
            bindings,
            messages,
            damaged = %refused,
            "started from a salvaged store"
        );
    }
}

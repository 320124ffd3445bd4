//! The committer: the only caller of the store. One thread takes every pending request,
//! writes them as one batch (one fsync when any needs it), then tells each requester.
//!
//! Group commit is what makes durable confirms cheap: while one fsync runs, requests from every
//! connection queue up and share the next one. `Stats` counts writes and ops so a benchmark can
//! show ops per fsync rising with concurrency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;
use tracing::error;
use warren_storage::{Op, Store};

/// A finished commit: the ticket it was submitted under, and whether it reached the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub ticket: u64,
    pub ok: bool,
    /// Not `ok` because this node stopped leading before the change was known committed: the
    /// cluster may still commit it (another node may have its entry) or not. Nothing can be
    /// said of it, so it is neither confirmed nor refused: the waiting connection closes with
    /// 320 and its client reconnects to the new leader (a nack would claim it was not taken).
    pub deposed: bool,
}

struct Request {
    ops: crate::broker::Journal,
    sync: bool,
    ticket: u64,
    notify: Option<UnboundedSender<Done>>,
    /// More journal batches written in the same store write as `ops` (a replicated node's
    /// apply of several entries: each batch's requester hears of it under its own ticket).
    more: Vec<(u64, Option<UnboundedSender<Done>>)>,
    /// The replicated log position these ops bring the store to, written in the same atomic
    /// write (`Store::write_applied`).
    applied: Option<Vec<u8>>,
    /// Told whether the write succeeded, once it is done (the cluster's state machine stops
    /// on a failed one, holds applies back while too many are in flight, and waits for all of
    /// them before a snapshot, so that the snapshot never runs ahead of the store).
    done: Option<Box<dyn FnOnce(bool) + Send>>,
    /// May wait up to `LINGER` for more requests to share its write (see `LINGER`).
    linger: bool,
}

/// How long a cluster node's apply may wait in the committer for the applies after it. On a
/// cluster node the store write is no promise to anyone: the entry is durable in the Raft log
/// of a majority, and after a crash the node applies again from the position its store holds.
/// A message is stored by the entry that enqueues it and removed by the one with its ack, some
/// milliseconds later (the consumer hears of it only once it is committed): written in one
/// store write, the two cancel (`cancel_acked`) and the message never reaches the store.
/// Anything that needs the store now (a barrier, a local write, a throttled publisher's
/// `hurry`) ends the wait at once.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(100);

/// Ops that end a linger early (a write stays a reasonable size; about this many messages).
const LINGER_OPS: usize = 50_000;

impl Request {
    /// A request that writes nothing: it ends a linger, and `done` hears once everything
    /// submitted before it is written.
    fn empty(done: Option<Box<dyn FnOnce(bool) + Send>>) -> Self {
        Request {
            ops: Default::default(),
            sync: false,
            ticket: 0,
            notify: None,
            more: Vec::new(),
            applied: None,
            done,
            linger: false,
        }
    }
}

/// One journal batch of a group written with [`Committer::submit_group`].
pub struct Part {
    pub ticket: u64,
    pub ops: crate::broker::Journal,
    pub notify: Option<UnboundedSender<Done>>,
}

/// Counters, readable from anywhere.
#[derive(Debug, Default)]
pub struct Stats {
    /// Store writes (each one RocksDB write batch).
    pub writes: AtomicU64,
    /// Writes that were fsynced.
    pub syncs: AtomicU64,
    /// Ops written.
    pub ops: AtomicU64,
    /// Enqueue ops written (persistent messages).
    pub messages: AtomicU64,
    /// Failed writes (each failed request is reported to its requester).
    pub failures: AtomicU64,
    /// Messages consumed and acked before their write: neither written nor deleted.
    pub cancelled: AtomicU64,
}

/// What `cancel_acked` needs per write, kept by the committer thread between writes: a write
/// of a cluster node holds some ten thousand messages, and a map and flags allocated afresh
/// for each took new pages from the allocator every time (the kernel zeroing them was a fifth
/// of a follower's CPU).
#[derive(Default)]
pub(crate) struct CancelScratch {
    /// Message key -> index of the single-queue `Enqueue` that stores it.
    stored: rustc_hash::FxHashMap<u64, usize>,
    /// Per op of the last `mark_acked`: dropped.
    pub(crate) cancel: Vec<bool>,
}

/// A message stored in one queue and removed from it within the same write never needs to
/// reach the disk: drop both ops. (A consumer that keeps up acks most messages before the
/// group commit that stores them; their confirm still goes out after this write's fsync.)
/// Returns how many messages were dropped.
fn cancel_acked(ops: &mut Vec<Op>, scratch: &mut CancelScratch) -> u64 {
    let n = mark_acked(ops, scratch);
    if n > 0 {
        let mut i = 0;
        ops.retain(|_| {
            i += 1;
            !scratch.cancel[i - 1]
        });
    }
    n
}

/// The work of [`cancel_acked`] without dropping anything: each message stored by a
/// single-queue `Enqueue` of `ops` and removed from that queue by a later `Remove` of `ops` is
/// taken out of that `Remove` (with its size), and `scratch.cancel` marks the ops to drop
/// (those `Enqueue`s, and the `Remove`s left with no key). Returns how many messages that is
/// (0: `scratch.cancel` is not set, nothing is to drop).
pub(crate) fn mark_acked(ops: &mut [Op], scratch: &mut CancelScratch) -> u64 {
    if !ops.iter().any(|op| matches!(op, Op::Remove { .. })) {
        return 0;
    }
    let CancelScratch { stored, cancel } = scratch;
    stored.clear();
    for (i, op) in ops.iter().enumerate() {
        if let Op::Enqueue { queues, id, .. } = op {
            if queues.len() == 1 {
                stored.insert(warren_storage::message_key(queues[0].1, *id), i);
            }
        }
    }
    if stored.is_empty() {
        return 0;
    }
    cancel.clear();
    cancel.resize(ops.len(), false);
    let mut n = 0;
    for i in 0..ops.len() {
        let (head, tail) = ops.split_at_mut(i);
        let Op::Remove {
            vhost,
            queue,
            keys,
            sizes,
        } = &mut tail[0]
        else {
            continue;
        };
        // Whether the key at each position stays (its enqueue is not in these ops before it,
        // or was cancelled already: a message is removed once).
        let mut stays = |k: &u64| {
            let Some(&j) = stored.get(k).filter(|&&j| j < i) else {
                return true;
            };
            let same = matches!(&head[j], Op::Enqueue { vhost: v, queues, .. }
                if v == vhost && queues[0].0 == *queue);
            if same && !cancel[j] {
                cancel[j] = true;
                n += 1;
                return false;
            }
            true
        };
        if sizes.len() == keys.len() {
            // The sizes (one per key) go with their keys.
            let mut kept = 0;
            for at in 0..keys.len() {
                if stays(&keys[at]) {
                    keys.swap(kept, at);
                    sizes.swap(kept, at);
                    kept += 1;
                }
            }
            keys.truncate(kept);
            sizes.truncate(kept);
        } else {
            keys.retain(|k| stays(k));
            sizes.clear();
        }
        if keys.is_empty() {
            cancel[i] = true;
        }
    }
    n
}

#[derive(Debug)]
pub struct Committer {
    /// None once dropping (closing the channel ends the thread).
    tx: Option<mpsc::Sender<Request>>,
    /// Whether writes that need it are fsynced. Off in a cluster: the replicated log is
    /// fsynced on a majority before anything is applied, and a restart applies again what
    /// the store lost (from its applied position on).
    sync: bool,
    /// The highest ticket written (successfully or not): with tickets numbered like the
    /// broker's journal batches, queues know which staged messages the store has.
    pub written: Arc<AtomicU64>,
    /// Woken after every write (throttled publishers wait on it).
    pub progress: Arc<tokio::sync::Notify>,
    pub stats: Arc<Stats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Committer {
    /// Finish what was submitted and close the store before returning (a restart in the same
    /// process must find the data folder unlocked).
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let s = &self.stats;
        let (syncs, messages) = (
            s.syncs.load(Ordering::Relaxed),
            s.messages.load(Ordering::Relaxed),
        );
        tracing::info!(
            writes = s.writes.load(Ordering::Relaxed),
            syncs,
            messages,
            cancelled = s.cancelled.load(Ordering::Relaxed),
            messages_per_sync = if syncs == 0 {
                0.0
            } else {
                messages as f64 / syncs as f64
            },
            "committer closed"
        );
    }
}

/// Whether an op must be on disk before its effect is confirmed (acks need not be: losing one
/// in a crash means a redelivery, which at-least-once allows).
fn needs_sync(op: &Op) -> bool {
    // RemoveRange is a purge (its purge-ok waits for the sync); Spill is never synced.
    !matches!(op, Op::Remove { .. } | Op::Spill { .. })
}

impl Committer {
    /// A committer that fsyncs what needs it (`sync`), or never (a cluster node: see the
    /// field).
    pub fn start(store: Arc<dyn Store>, sync: bool) -> Self {
        let (tx, rx) = mpsc::channel::<Request>();
        let stats = Arc::new(Stats::default());
        let written = Arc::new(AtomicU64::new(0));
        let progress = Arc::new(tokio::sync::Notify::new());
        let (thread_stats, thread_written, thread_progress) =
            (stats.clone(), written.clone(), progress.clone());
        let thread = std::thread::Builder::new()
            .name("warren-committer".into())
            .spawn(move || run(store, rx, thread_stats, thread_written, thread_progress))
            .expect("spawning the committer thread");
        Committer {
            tx: Some(tx),
            sync,
            written,
            progress,
            stats,
            thread: Some(thread),
        }
    }

    /// Queue ops for the store under `ticket` (the broker's journal batch number: tickets
    /// grow); `notify` hears the outcome. Requests are written in submission order.
    pub fn submit(
        &self,
        ticket: u64,
        ops: crate::broker::Journal,
        notify: Option<UnboundedSender<Done>>,
    ) -> u64 {
        let sync = self.sync && ops.iter().any(needs_sync);
        self.send(Request {
            ops,
            sync,
            ticket,
            notify,
            more: Vec::new(),
            applied: None,
            done: None,
            linger: false,
        });
        ticket
    }

    /// Write `parts` in one store write with the replicated position `applied`, and tell
    /// `done` when it is done (true: written). Each part's requester hears under its ticket.
    /// The write may wait up to [`LINGER`] to be merged with later ones (a cluster node's
    /// applies: see there).
    pub fn submit_group(
        &self,
        parts: Vec<Part>,
        applied: Vec<u8>,
        done: tokio::sync::oneshot::Sender<bool>,
    ) {
        self.submit_group_then(
            parts,
            applied,
            Box::new(move |ok| {
                let _ = done.send(ok);
            }),
            true,
        )
    }

    /// [`Committer::submit_group`], and wait for it (blocking the thread).
    pub fn write_group(&self, parts: Vec<Part>, applied: Vec<u8>) -> bool {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit_group_then(
            parts,
            applied,
            Box::new(move |ok| {
                let _ = tx.send(ok);
            }),
            false,
        );
        rx.recv().unwrap_or(false)
    }

    fn submit_group_then(
        &self,
        parts: Vec<Part>,
        applied: Vec<u8>,
        done: Box<dyn FnOnce(bool) + Send>,
        linger: bool,
    ) {
        let mut parts = parts.into_iter();
        let (ticket, mut ops, notify) = match parts.next() {
            Some(p) => (p.ticket, p.ops, p.notify),
            None => (0, Default::default(), None),
        };
        let mut more = Vec::new();
        for p in parts {
            ops.extend(p.ops);
            more.push((p.ticket, p.notify));
        }
        let sync = self.sync && ops.iter().any(needs_sync);
        self.send(Request {
            ops,
            sync,
            ticket,
            notify,
            more,
            applied: Some(applied),
            done: Some(done),
            linger,
        });
    }

    /// Write what lingers (see [`LINGER`]) now: for a waiter that needs the store to catch
    /// up (a publisher throttled until its message is written).
    pub fn hurry(&self) {
        self.send(Request::empty(None));
    }

    /// Wait until everything submitted before is written (blocking: for a caller outside the
    /// async runtime's workers, or one that must hold a lock across it).
    pub fn barrier(&self) -> bool {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Request::empty(Some(Box::new(move |ok| {
            let _ = tx.send(ok);
        }))));
        rx.recv().unwrap_or(false)
    }

    fn send(&self, r: Request) {
        let Some(tx) = &self.tx else {
            return;
        };
        if tx.send(r).is_err() {
            error!("the committer thread is gone");
        }
    }
}

fn run(
    store: Arc<dyn Store>,
    rx: mpsc::Receiver<Request>,
    stats: Arc<Stats>,
    written: Arc<AtomicU64>,
    progress: Arc<tokio::sync::Notify>,
) {
    let mut batch: Vec<Request> = Vec::new();
    let mut ops: Vec<Op> = Vec::new();
    let mut failing = crate::log_limit::Repeats::default();
    let mut scratch = CancelScratch::default();
    while let Ok(first) = rx.recv() {
        // A first request that may linger waits for more until its deadline (see `LINGER`).
        let deadline = first.linger.then(|| std::time::Instant::now() + LINGER);
        let mut lingering = first.linger;
        let mut queued = first.ops.len();
        batch.push(first);
        // Everything that arrived meanwhile shares this write (bounded, so one write stays
        // a reasonable size).
        while batch.len() < 4096 {
            let next = match rx.try_recv() {
                Ok(r) => Ok(r),
                Err(mpsc::TryRecvError::Disconnected) => break,
                Err(mpsc::TryRecvError::Empty) => {
                    let wait = deadline
                        .filter(|_| lingering && queued < LINGER_OPS)
                        .and_then(|d| d.checked_duration_since(std::time::Instant::now()));
                    match wait {
                        Some(wait) => rx.recv_timeout(wait).map_err(|_| ()),
                        None => break,
                    }
                }
            };
            let Ok(r) = next else { break };
            lingering &= r.linger;
            queued += r.ops.len();
            batch.push(r);
        }
        let sync = batch.iter().any(|r| r.sync);
        for r in batch.iter_mut() {
            ops.extend(r.ops.drain(..));
        }
        let messages = ops
            .iter()
            .filter(|o| matches!(o, Op::Enqueue { .. }))
            .count() as u64;
        let cancelled = cancel_acked(&mut ops, &mut scratch);
        stats.cancelled.fetch_add(cancelled, Ordering::Relaxed);
        let applied = batch.iter_mut().rev().find_map(|r| r.applied.take());
        let result = match &applied {
            Some(a) => store.write_applied(&ops, a, sync),
            // Nothing to write (a `hurry` alone, or ops that all cancelled).
            None if ops.is_empty() && !sync => Ok(()),
            None => store.write(&ops, sync),
        };
        stats.writes.fetch_add(1, Ordering::Relaxed);
        stats.ops.fetch_add(ops.len() as u64, Ordering::Relaxed);
        stats.messages.fetch_add(messages, Ordering::Relaxed);
        if sync {
            stats.syncs.fetch_add(1, Ordering::Relaxed);
        }
        let ok = match result {
            Ok(()) => {
                if let Some(unlogged) = failing.clear() {
                    tracing::info!(unlogged, "store writes succeed again");
                }
                true
            }
            Err(e) => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                if let Some(unlogged) = failing.hit(crate::clock::now_ms()) {
                    error!(
                        error = %e,
                        ops = ops.len(),
                        failed_writes_not_logged = unlogged,
                        "store write failed (repeats are logged once per {:?})",
                        crate::log_limit::INTERVAL
                    );
                }
                false
            }
        };
        ops.clear();
        if let Some(last) = batch
            .iter()
            .flat_map(|r| std::iter::once(r.ticket).chain(r.more.iter().map(|m| m.0)))
            .max()
        {
            written.fetch_max(last, Ordering::Release);
        }
        progress.notify_waiters();
        for r in batch.drain(..) {
            for (ticket, notify) in std::iter::once((r.ticket, r.notify)).chain(r.more) {
                if let Some(n) = notify {
                    let _ = n.send(Done {
                        ticket,
                        ok,
                        deposed: false,
                    });
                }
            }
            if let Some(d) = r.done {
                d(ok);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{cancel_acked, Committer, Part};
    use bytes::Bytes;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use warren_storage::Op;

    fn part(ticket: u64, op: Op) -> Part {
        Part {
            ticket,
            ops: std::iter::once(op).collect(),
            notify: None,
        }
    }

    /// A cluster node's applies linger in the committer: a message enqueued by one apply and
    /// acknowledged by the next never reaches the store, and a non-lingering request (here a
    /// barrier) writes what lingers at once.
    #[test]
    fn applies_linger_so_that_an_enqueue_and_its_ack_cancel() {
        let store = Arc::new(warren_storage::mem::MemStore::new());
        let committer = Committer::start(store, false);
        let (first_tx, mut first) = tokio::sync::oneshot::channel();
        committer.submit_group(vec![part(1, enqueue(&["a"], 7))], vec![1], first_tx);
        // Long enough for the committer to take the first request and start its write, were
        // it not lingering.
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            first.try_recv().is_err(),
            "the first apply was written alone"
        );
        let (second_tx, mut second) = tokio::sync::oneshot::channel();
        committer.submit_group(vec![part(2, remove("a", &[7]))], vec![2], second_tx);
        assert!(committer.barrier());
        assert_eq!(first.try_recv(), Ok(true));
        assert_eq!(second.try_recv(), Ok(true));
        assert_eq!(committer.stats.cancelled.load(Ordering::Relaxed), 1);
        assert_eq!(committer.stats.writes.load(Ordering::Relaxed), 1);
        assert_eq!(committer.written.load(Ordering::Acquire), 2);
    }

    /// A lingering write alone is written by its deadline.
    #[test]
    fn a_lingering_apply_alone_is_written() {
        let store = Arc::new(warren_storage::mem::MemStore::new());
        let committer = Committer::start(store.clone(), false);
        let (tx, rx) = tokio::sync::oneshot::channel();
        committer.submit_group(vec![part(1, enqueue(&["a"], 7))], vec![9], tx);
        assert_eq!(rx.blocking_recv(), Ok(true));
        use warren_storage::Store;
        assert_eq!(store.applied().ok().flatten(), Some(vec![9]));
    }

    fn enqueue(queues: &[&str], id: u64) -> Op {
        Op::Enqueue {
            vhost: "/".into(),
            queues: queues
                .iter()
                .map(|q| (warren_storage::Name::from(*q), 0))
                .collect(),
            id,
            timestamp_ms: 0,
            exchange: "".into(),
            routing_key: "".into(),
            properties: Bytes::new(),
            body: Bytes::new().into(),
        }
    }

    fn remove(queue: &str, keys: &[u64]) -> Op {
        Op::Remove {
            vhost: "/".into(),
            queue: queue.into(),
            keys: keys.to_vec(),
            sizes: Vec::new(),
        }
    }

    #[test]
    fn a_message_acked_within_the_write_is_neither_written_nor_deleted() {
        let mut ops = vec![
            enqueue(&["a"], 1),
            enqueue(&["a"], 2),
            enqueue(&["a", "b"], 3),
            remove("a", &[1, 3]),
            remove("b", &[2]),
        ];
        assert_eq!(cancel_acked(&mut ops, &mut Default::default()), 1);
        assert_eq!(
            ops,
            vec![
                enqueue(&["a"], 2),
                enqueue(&["a", "b"], 3),
                remove("a", &[3]),
                remove("b", &[2]),
            ]
        );
        // A removal before the enqueue (another message with that key) cancels nothing.
        let mut ops = vec![remove("a", &[5]), enqueue(&["a"], 5)];
        assert_eq!(cancel_acked(&mut ops, &mut Default::default()), 0);
        assert_eq!(ops.len(), 2);
    }
}

//! A queue: its ready messages (by priority, then id), its consumers, its limits.

use super::{args, ConnId, Message};
use amq_protocol::types::FieldTable;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use warren_storage::{message_key, LevelSummary, Store};

/// How much of a queue stays in memory: past this many ready messages (or bytes of bodies),
/// newly arriving messages wait on disk and are read back in order, a batch at a time, as the
/// head drains. This bounds the heap of a deep queue (issue 3 point 4).
pub const WINDOW_MESSAGES: usize = 1024;
pub const WINDOW_BYTES: u64 = 8 * 1024 * 1024;
/// One read from the store brings back at most this much.
const READ_MESSAGES: usize = 512;

/// Where `Queue::push` put a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// In memory, within the window.
    Memory,
    /// In memory past the window, because the queue has consumers: its publisher should wait
    /// until they bring the queue back under its window (`Queue::holding`).
    Held,
    /// Staged for the store (see `Queue::push`).
    Staged,
}
const READ_BYTES: usize = 1024 * 1024;

/// A read asked of the node (`ReadPlan`) and unanswered this long (ms) is asked again: the
/// node answers every read it is asked (`Shared::execute`), so this only covers one whose
/// request was dropped; a slow disk's read must not be asked twice.
pub const READ_ASK_AGAIN_MS: u64 = 10_000;

/// Where queues page to: the store, and how far the committer has written the journal.
pub struct Pager {
    pub store: Arc<dyn Store>,
    /// The last journal batch (`Broker::journal_seq`) the committer has written.
    pub written: Arc<AtomicU64>,
    /// How long (ms of the broker's clock: the core reads no clock of its own) publishers may
    /// be held for a queue whose consumers are behind (see `Queue::push`) before the queue
    /// gives up waiting for them and pages instead (`Config::flow_hold`).
    pub hold_max_ms: u64,
    /// Some queue could not read its backlog back (`Queue::read_failed`): the broker's timer
    /// retries (`Broker::retry_reads`).
    pub read_failed: std::sync::atomic::AtomicBool,
    /// The broker's clock (`Broker::set_clock`), for rate-limited log lines of queues: the
    /// core reads no clock of its own.
    pub clock: AtomicU64,
    /// Deliveries to consumers do not read the store under the broker lock: they ask the node
    /// (`Effect::Read`), which reads outside it and hands the result back
    /// (`Broker::read_done`). Off, every read happens where it is needed (unit tests).
    pub async_reads: bool,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pager")
            .field("written", &self.written)
            .field("hold_max_ms", &self.hold_max_ms)
            .finish()
    }
}

/// One priority level of a queue. Its messages, in id order, are: `mem` (the head, in memory),
/// then `returned` (requeued messages paged out past the window), then `disk_count` messages on
/// disk with ids `disk_first..=disk_last` (only in the store), then `staged` (in memory until
/// the journal batch that writes them to the store is written).
#[derive(Debug, Default)]
struct Level {
    mem: VecDeque<QueuedMessage>,
    /// Requeued messages past the window, by id. They came from the head, so their ids are
    /// below the disk range; but delivered messages still unacknowledged sit between them in
    /// the store, so they are read back one key at a time (`Store::read_keys`), not as a range.
    returned: VecDeque<Returned>,
    /// Entries of `returned` still holding their message in memory.
    returned_held: usize,
    /// Entries requeued into `returned` not yet given a store write (`UNASSIGNED`), at most:
    /// `page_out_returned` looks for them only when there may be some.
    returned_unassigned: usize,
    disk_count: u64,
    disk_bytes: u64,
    disk_first: u64,
    disk_last: u64,
    /// (journal batch, message).
    staged: VecDeque<(u64, QueuedMessage)>,
    /// The journal batch that records the latest removal of messages from the disk part
    /// (`remove_keys`, `remove_key_range`: a replica applying acks, purges, drops decided on
    /// another broker). Until the committer has written it, the store still holds the removed
    /// records: a range read of `disk_count` records would return them in place of live ones,
    /// which would then stay on disk, uncounted (a message never delivered again). Reads of
    /// the disk part wait for it (`ReadPlan::after`).
    settle: u64,
}

impl Level {
    fn paged(&self) -> bool {
        self.disk_count > 0 || !self.staged.is_empty() || !self.returned.is_empty()
    }

    fn len(&self) -> usize {
        self.mem.len() + self.returned.len() + self.disk_count as usize + self.staged.len()
    }
}

/// `Returned::batch` of a message requeued among the paged-out ones and not yet given a store
/// write (`Queue::page_out_returned` gives it one).
const UNASSIGNED: u64 = u64::MAX;

/// What `Queue::purge` took, for its store writes: how many messages, the store keys of the
/// replicated ones outside the disk part with their sizes (a replica takes them without
/// reading its store), those of transient messages this broker spilled (no replica has them),
/// and per level the key range from the disk part (or the staged one) on.
#[derive(Debug, Default)]
pub struct Purged {
    pub count: usize,
    pub kept: Vec<(u64, u64)>,
    pub local: Vec<u64>,
    /// Key ranges, one per level, with what each held where this broker can tell: the
    /// number of messages and their body bytes (`Op::RemoveRange`'s `counted`). It can unless
    /// the queue ever spilled transient messages (those are on its disk alone, and only a
    /// read would tell how many).
    pub ranges: Vec<PurgedRange>,
}

/// A key range a purge took: from, to, and (messages, bytes) if known (see `Purged::ranges`).
pub type PurgedRange = (u64, u64, Option<(u64, u64)>);

/// A requeued message paged out of memory (see `Level::returned`): what the queue must know
/// of it without its body.
#[derive(Debug)]
struct Returned {
    id: u64,
    size: u64,
    returns: u32,
    /// Delivered before (a requeued message; the newer ones paged out with it were not).
    redelivered: bool,
    expires_at: Option<u64>,
    /// The store has (or, once `batch` is written, will have) its record.
    stored: bool,
    /// Replicated (`Queue::keeps` it, and its enqueue was recorded): not a transient
    /// message this broker spilled. A purge replicates the removal of these alone.
    kept: bool,
    /// The journal batch after whose write the store can give the message back.
    batch: u64,
    /// The message, kept until `batch` is written (or until it is delivered first).
    msg: Option<Arc<Message>>,
}

/// A read of a queue's backlog from the store that the queue needs before it can hand out its
/// next message (issue 13 point 5: the core asks, the node reads outside the broker lock, the
/// core takes the result with [`Queue::take_read`]). `epoch` is the queue's
/// [`Queue::read_epoch`] when it asked: a result for an older epoch is stale (the backlog moved
/// meanwhile) and is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    pub level: usize,
    pub epoch: u64,
    pub what: ReadWhat,
    /// The journal batch the committer must have written before the store is read
    /// (`Pager::written`): the store must hold every removal the queue's counts reflect
    /// (`Level::settle`). 0: nothing to wait for.
    pub after: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadWhat {
    /// The next messages on disk: keys `from..=to`, at most `want` of them.
    Range { from: u64, to: u64, want: usize },
    /// Requeued messages paged out: the first `take` entries of `returned`, of which those
    /// with these keys must be read.
    Keys { keys: Vec<u64>, take: usize },
}

/// What the store gave back for a [`ReadPlan`].
#[derive(Debug)]
pub enum ReadData {
    Range(Vec<warren_storage::StoredMessage>),
    Keys(Vec<Option<warren_storage::StoredMessage>>),
}

impl ReadPlan {
    /// Carry out the read (the node calls this outside the broker lock).
    pub fn read(
        &self,
        store: &dyn Store,
        vhost: &str,
        queue: &str,
    ) -> Result<ReadData, warren_storage::StoreError> {
        match &self.what {
            ReadWhat::Range { from, to, want } => store
                .read(vhost, queue, *from, *to, *want, READ_BYTES)
                .map(ReadData::Range),
            ReadWhat::Keys { keys, .. } => store.read_keys(vhost, queue, keys).map(ReadData::Keys),
        }
    }
}

/// A message waiting in (or delivered from) a queue.
#[derive(Debug, Clone)]
pub struct QueuedMessage {
    /// Broker-wide id; within a priority a queue keeps ready messages sorted by it, so a
    /// requeued message goes back to its original place.
    pub id: u64,
    pub msg: Arc<Message>,
    /// Delivered at least once before.
    pub redelivered: bool,
    /// When it expires (ms since the epoch), from the queue's x-message-ttl and the message's
    /// expiration, whichever is sooner.
    pub expires_at: Option<u64>,
    /// How often it came back unacknowledged (quorum queues' x-delivery-count).
    pub returns: u32,
    /// The store holds it for this queue (a persistent message in a stored queue, or a spilled
    /// one): taking it out must be journaled.
    pub stored: bool,
    /// The journal batch (`Broker::journal_seq`) that records its enqueue, for a message the
    /// journal records (0 otherwise, and for one read back from the store: written, so
    /// committed). A cluster's leader delivers it only once that batch's entry is committed:
    /// before, the cluster may still lose it (a leader that dies first), and a consumer must
    /// not see a message the cluster then does not have.
    pub batch: u64,
}

/// Why a message left a queue without being acknowledged (x-death's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    Rejected,
    Expired,
    MaxLen,
    DeliveryLimit,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Rejected => "rejected",
            DropReason::Expired => "expired",
            DropReason::MaxLen => "maxlen",
            DropReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// What happens when a queue is full (x-overflow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    DropHead,
    RejectPublish,
    RejectPublishDlx,
}

/// Identifies a consumer: its connection, channel and tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerKey {
    pub conn: ConnId,
    pub channel: u16,
    /// Shared with the channel's consumer record: cloning a key costs no allocation.
    pub tag: std::sync::Arc<str>,
}

/// A consumer as the queue sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConsumer {
    pub key: ConsumerKey,
    /// x-priority of basic.consume.
    pub priority: i64,
}

#[derive(Debug)]
pub struct Queue {
    // Replicated: the definition (name, flags, arguments) and the messages (levels, counts),
    // the same on every node that applies the same ops. Kept by this node alone: how the
    // messages are laid out between memory and its store (paging, reads), and `local`.
    /// Shared with the ops that name the queue (`warren_storage::Name`).
    pub name: warren_storage::Name,
    pub vhost: warren_storage::Name,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    /// The connection an exclusive queue belongs to.
    pub owner: Option<ConnId>,
    pub arguments: FieldTable,
    /// x-message-ttl, in ms.
    pub message_ttl: Option<u64>,
    pub max_length: Option<u64>,
    pub max_length_bytes: Option<u64>,
    pub overflow: Overflow,
    /// x-dead-letter-exchange and x-dead-letter-routing-key.
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    /// x-expires: the queue goes after this long unused (ms).
    pub expires: Option<u64>,
    /// When it was last used (declared, consumed from, got from), for x-expires.
    pub last_used: u64,
    /// x-single-active-consumer.
    pub single_active: bool,
    /// x-queue-type quorum: deliveries carry x-delivery-count, x-delivery-limit applies.
    pub quorum: bool,
    pub delivery_limit: Option<u64>,
    /// Ready messages, per priority level (one level without x-max-priority).
    levels: Vec<Level>,
    count: usize,
    ready_bytes: u64,
    /// Ready messages in memory (all levels' `mem` and `staged`) and their body bytes.
    mem_count: usize,
    mem_bytes: u64,
    /// Paging: with a pager, a deep queue keeps only a window in memory.
    pub pager: Option<Arc<Pager>>,
    /// The store holds spilled messages of this queue (it has storage even if not durable).
    pub spilled: bool,
    /// Messages on disk may carry an expiry (so the expiry tick keeps visiting the queue).
    disk_may_expire: bool,
    /// Messages paged out (staged for the store past the window) since the queue was made.
    pub paged_out: u64,
    /// Messages read back with an id up to this were recovered from a previous run: they may
    /// have been delivered before, so they go out redelivered.
    redeliver_upto: u64,
    /// Messages read back but unreadable or missing (a failed write): reported once.
    pub lost: u64,
    /// The last read of the backlog from the store failed (an I/O error): consumers wait for
    /// the broker's timer to try again (`Broker::retry_reads`).
    pub read_failed: bool,
    /// Rate limit for the log line of a failing read-back.
    read_errors: crate::log_limit::Repeats,
    /// Moves on when a read is taken, and when messages leave the disk part other than by a
    /// read (removals, purge) or it is rebuilt (restore): a read for an older epoch is not
    /// taken. Changes to `returned` need no new epoch: `plan_current` compares the head a
    /// plan was made from with the head now.
    pub read_epoch: u64,
    /// A read asked of the node and not answered yet: (epoch, broker clock in ms when asked).
    /// Deliveries from this queue wait for it; one unanswered for `READ_ASK_AGAIN_MS` is asked
    /// again.
    pub read_pending: Option<(u64, u64)>,
    /// With reads through the node (`async_reads`): the read a path that takes the head at
    /// once (drop-head, expiry, requeue, declare-ok's count) found it needed, its level's
    /// in-memory head being empty. Nothing is read under the broker lock: the broker asks the
    /// node for it (`Broker::ask_wanted`), and what waited is done once it is taken
    /// (`Broker::read_done`). Meanwhile a drop-head queue may be over its limit by what was
    /// published since; nothing is delivered from it before the trim (its head is the read).
    wanted: Option<ReadPlan>,
    /// What only the node serving clients keeps: consumers, deliveries, publisher holds.
    pub local: QueueLocal,
    /// Messages that left without an ack (expired, over the limit), for the broker to
    /// dead-letter and remove from the store.
    pub dropped: Vec<(QueuedMessage, DropReason)>,
}

/// A queue's leader-local state (issue 13 point 1): what a connection to this node made, which
/// a replica neither has nor needs. No op records it; a new leader starts with none (its
/// clients reconnect, and what was delivered comes back redelivered).
#[derive(Debug, Default)]
pub struct QueueLocal {
    /// Consumers in subscription order; `next` is where the round-robin resumes.
    pub consumers: Vec<QueueConsumer>,
    pub next: usize,
    /// The consumer that holds this queue exclusively (basic.consume exclusive=true).
    pub exclusive_consumer: Option<ConsumerKey>,
    /// Delivered and not yet acked, across all channels.
    pub unacked: usize,
    /// Auto-delete queues go when their last consumer goes, but only after they had one.
    pub had_consumers: bool,
    /// Since when (broker clock, ms) publishers are held for this queue's consumers (see
    /// `push`).
    hold_since: Option<u64>,
}

/// A message as the store gave it back.
fn stored(m: warren_storage::StoredMessage) -> Result<Message, warren_storage::StoreError> {
    super::stored_message(&m.exchange, &m.routing_key, m.properties, m.body)
        .map_err(|e| warren_storage::StoreError::Io(format!("unreadable stored message: {e}")))
}

impl Queue {
    pub fn new(
        name: String,
        vhost: String,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: FieldTable,
    ) -> Self {
        let max_priority = args::uint(&arguments, "x-max-priority")
            .unwrap_or(0)
            .min(255);
        let overflow = match args::string(&arguments, "x-overflow").as_deref() {
            Some("reject-publish") => Overflow::RejectPublish,
            Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
            _ => Overflow::DropHead,
        };
        Queue {
            name: name.into(),
            vhost: vhost.into(),
            durable,
            exclusive,
            auto_delete,
            owner: None,
            message_ttl: args::message_ttl(&arguments),
            max_length: args::uint(&arguments, "x-max-length"),
            max_length_bytes: args::uint(&arguments, "x-max-length-bytes"),
            overflow,
            dead_letter_exchange: args::string(&arguments, "x-dead-letter-exchange"),
            dead_letter_routing_key: args::string(&arguments, "x-dead-letter-routing-key"),
            expires: args::uint(&arguments, "x-expires"),
            last_used: 0,
            single_active: args::flag(&arguments, "x-single-active-consumer"),
            quorum: args::string(&arguments, "x-queue-type").as_deref() == Some("quorum"),
            delivery_limit: args::uint(&arguments, "x-delivery-limit"),
            arguments,
            levels: (0..=max_priority).map(|_| Level::default()).collect(),
            count: 0,
            ready_bytes: 0,
            mem_count: 0,
            mem_bytes: 0,
            pager: None,
            spilled: false,
            disk_may_expire: false,
            paged_out: 0,
            redeliver_upto: 0,
            lost: 0,
            read_failed: false,
            read_errors: Default::default(),
            read_epoch: 0,
            read_pending: None,
            wanted: None,
            local: QueueLocal::default(),
            dropped: Vec::new(),
        }
    }

    /// How long a message lives in this queue (ms): the queue's x-message-ttl or the message's
    /// expiration, whichever is shorter.
    pub fn ttl(&self, msg: &Message) -> Option<u64> {
        match (self.message_ttl, msg.expiration) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether this queue's persistent messages live in the store (durable, not exclusive).
    pub fn is_stored(&self) -> bool {
        self.durable && !self.exclusive
    }

    /// Whether this queue keeps `msg` in the store (and, in a cluster, replicates it): a
    /// persistent message of a stored queue, and every message of a quorum queue (quorum
    /// queues are durable, and RabbitMQ's keep transient messages in their log too).
    pub fn keeps(&self, msg: &super::Message) -> bool {
        self.is_stored() && (self.quorum || msg.persistent())
    }

    pub fn message_count(&self) -> usize {
        self.count
    }

    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Priority level of a message (above the maximum counts as the maximum).
    pub fn level(&self, m: &Message) -> usize {
        let p = m.properties.priority().unwrap_or(0) as usize;
        p.min(self.levels.len() - 1)
    }

    /// The key of a message of this queue in the store.
    pub fn store_key(&self, qm: &QueuedMessage) -> u64 {
        message_key(self.level(&qm.msg) as u8, qm.id)
    }

    /// Messages in memory (ready ones; delivered ones are held by their channels).
    pub fn in_memory(&self) -> usize {
        self.mem_count
    }

    /// Whether the store holds anything for this queue.
    pub fn has_storage(&self) -> bool {
        self.is_stored() || self.spilled
    }

    /// Whether one more message of `size` body bytes would pass a limit.
    pub fn would_overflow(&self, size: u64) -> bool {
        self.max_length.is_some_and(|m| self.count as u64 + 1 > m)
            || self
                .max_length_bytes
                .is_some_and(|m| self.ready_bytes + size > m)
    }

    /// Whether the queue is over a limit now.
    pub fn over_limit(&self) -> bool {
        self.max_length.is_some_and(|m| self.count as u64 > m)
            || self.max_length_bytes.is_some_and(|m| self.ready_bytes > m)
    }

    /// Add a newly arrived message. Past the window (or behind messages already on disk) it is
    /// staged: it stays in memory only until journal batch `batch` is written, which must store
    /// it (the caller journals a spill for a message not already stored).
    ///
    /// Except when the queue has consumers and nothing of this level is on disk: they are
    /// only behind, and paging would cost a store write and read for each message they are
    /// about to take. The message then stays in memory past the window (up to a second window)
    /// and its publisher waits for the consumers to bring the queue back under the window
    /// (`Pushed::Held`), as RabbitMQ's credit flow slows a publisher to its queue's pace. If
    /// they do not within `Pager::hold_max_ms` (stuck, or slower than the publishers for good), the
    /// queue pages as usual until it is back under the window, so a slow consumer costs a
    /// publisher at most `Pager::hold_max_ms` each time.
    pub fn push(&mut self, mut qm: QueuedMessage, batch: u64, now: u64) -> Pushed {
        let size = qm.msg.body.len() as u64;
        self.ready_bytes += size;
        self.count += 1;
        let level = self.level(&qm.msg);
        let over = self.mem_count >= WINDOW_MESSAGES || self.mem_bytes + size > WINDOW_BYTES;
        if !over {
            self.local.hold_since = None;
        }
        let paged = self.levels[level].paged();
        let stage = self.pager.is_some() && (paged || over);
        let hold_max = self.pager.as_ref().map_or(0, |p| p.hold_max_ms);
        let hold = stage
            && hold_max > 0
            && !paged
            && !self.local.consumers.is_empty()
            && self.mem_count < 2 * WINDOW_MESSAGES
            && self.mem_bytes + size <= 2 * WINDOW_BYTES
            && self
                .local
                .hold_since
                .is_none_or(|t| now.saturating_sub(t) < hold_max);
        self.mem_count += 1;
        self.mem_bytes += size;
        let l = &mut self.levels[level];
        if stage && !hold {
            qm.stored = true;
            // In id order, as `remove_id` searches it.
            match l.staged.back() {
                Some((_, last)) if last.id > qm.id => {
                    let pos = l.staged.partition_point(|(_, m)| m.id < qm.id);
                    l.staged.insert(pos, (batch, qm));
                }
                _ => l.staged.push_back((batch, qm)),
            }
            self.paged_out += 1;
            self.release_written(level);
            return Pushed::Staged;
        }
        if hold {
            self.local.hold_since.get_or_insert(now);
        }
        let l = &mut l.mem;
        match l.back() {
            Some(last) if last.id > qm.id => {
                let pos = l.partition_point(|m| m.id < qm.id);
                l.insert(pos, qm);
            }
            _ => l.push_back(qm),
        }
        if hold {
            Pushed::Held
        } else {
            Pushed::Memory
        }
    }

    /// Whether publishers should still wait for this queue's consumers (see `push`).
    pub fn holding(&self, now: u64) -> bool {
        let hold_max = self.pager.as_ref().map_or(0, |p| p.hold_max_ms);
        self.local
            .hold_since
            .is_some_and(|t| now.saturating_sub(t) < hold_max)
            && !self.local.consumers.is_empty()
            && !self.under_window()
    }

    /// Whether a publisher held for this queue can go on (checked after deliveries): true at
    /// the moment the queue is back under its window.
    pub fn released(&mut self) -> bool {
        if self.local.hold_since.is_some() && self.under_window() {
            self.local.hold_since = None;
            return true;
        }
        false
    }

    fn under_window(&self) -> bool {
        self.mem_count < WINDOW_MESSAGES && self.mem_bytes < WINDOW_BYTES
    }

    /// Drop from memory every staged message the store has now; returns whether some are
    /// still waiting for their write.
    pub fn release_all_written(&mut self) -> bool {
        for level in 0..self.levels.len() {
            self.release_written(level);
        }
        self.levels
            .iter()
            .any(|l| !l.staged.is_empty() || l.returned_held > 0)
    }

    /// More is staged in memory than a second window's worth: the store is behind the
    /// publishers (who should wait for it, see `PublishOutcome::staged`).
    pub fn pressure(&self) -> bool {
        self.mem_count > 2 * WINDOW_MESSAGES || self.mem_bytes > 2 * WINDOW_BYTES
    }

    /// Staged messages whose journal batch is written are on disk: drop them from memory.
    fn release_written(&mut self, level: usize) {
        let Some(pager) = &self.pager else {
            return;
        };
        let written = pager.written.load(Ordering::Acquire);
        let l = &mut self.levels[level];
        if l.returned_held > 0 {
            // Paged-out requeued messages whose records are written leave memory.
            let mut left = l.returned_held;
            for r in l.returned.iter_mut() {
                if left == 0 {
                    break;
                }
                if r.msg.is_none() {
                    continue;
                }
                left -= 1;
                if r.batch != UNASSIGNED && r.batch <= written {
                    r.msg = None;
                    l.returned_held -= 1;
                    self.mem_count -= 1;
                    self.mem_bytes -= r.size;
                }
            }
        }
        while l.staged.front().is_some_and(|(b, _)| *b <= written) {
            let Some((_, qm)) = l.staged.pop_front() else {
                break;
            };
            let size = qm.msg.body.len() as u64;
            if l.disk_count == 0 {
                l.disk_first = qm.id;
            }
            l.disk_count += 1;
            l.disk_bytes += size;
            l.disk_last = qm.id;
            self.disk_may_expire |= qm.expires_at.is_some();
            self.mem_count -= 1;
            self.mem_bytes -= size;
        }
    }

    /// Bring the next messages of a level into memory: from disk, or (nothing on disk) the
    /// staged ones. Called when the level's in-memory head is empty, on the paths that take
    /// the head at once (limits, expiry, basic.get). With reads through the node, a read from
    /// the store is only wanted (`wanted`) and the head stays empty; without (tests, tools),
    /// the store is read here and now.
    fn refill(&mut self, level: usize) {
        if self.async_reads() {
            // Never under the broker lock: what no read is needed for is done here, the read
            // is wanted (see `wanted`).
            if let Some(plan) = self.plan_refill(level) {
                self.want(plan);
            }
            return;
        }
        while let Some(plan) = self.plan_refill(level) {
            let Some(pager) = self.pager.clone() else {
                return;
            };
            let data = plan.read(&*pager.store, &self.vhost, &self.name);
            if !self.take_read(&plan, data) || !self.levels[level].mem.is_empty() {
                return;
            }
        }
    }

    /// Bring into memory what a level's empty head can have without reading the store
    /// (written staged messages leave memory, requeued ones still held come back, staged ones
    /// move up when nothing is on disk); if the head is still empty and the store must be read,
    /// what to read. None: nothing to read (the head has messages, or the level is empty).
    pub fn plan_refill(&mut self, level: usize) -> Option<ReadPlan> {
        self.release_written(level);
        // Requeued messages paged out come first.
        while self.levels[level].mem.is_empty() && !self.levels[level].returned.is_empty() {
            let (take, keys) = self.returned_head(level);
            if keys.is_empty() {
                self.fill_returned(level, take, Vec::new());
                continue;
            }
            return Some(ReadPlan {
                level,
                epoch: self.read_epoch,
                what: ReadWhat::Keys { keys, take },
                after: 0,
            });
        }
        if !self.levels[level].mem.is_empty() {
            return None;
        }
        let l = &mut self.levels[level];
        if l.disk_count == 0 {
            // Staged but not yet written: they are in memory already, and next in line.
            while let Some((_, qm)) = l.staged.pop_front() {
                l.mem.push_back(qm);
            }
            return None;
        }
        self.pager.as_ref()?;
        let (from, to) = (
            message_key(level as u8, l.disk_first),
            message_key(level as u8, l.disk_last),
        );
        let want = (l.disk_count as usize).min(READ_MESSAGES);
        Some(ReadPlan {
            level,
            epoch: self.read_epoch,
            what: ReadWhat::Range { from, to, want },
            after: l.settle,
        })
    }

    /// The next paged-out requeued messages to bring back: how many entries of `returned`
    /// (at most a read's worth), and the store keys of those not held in memory.
    fn returned_head(&self, level: usize) -> (usize, Vec<u64>) {
        let mut take = 0;
        let mut bytes = 0;
        let mut keys = Vec::new();
        for r in self.levels[level].returned.iter() {
            if take >= READ_MESSAGES || (bytes >= READ_BYTES as u64 && take > 0) {
                break;
            }
            take += 1;
            if r.msg.is_none() {
                bytes += r.size;
                keys.push(message_key(level as u8, r.id));
            }
        }
        (take, keys)
    }

    /// Whether `plan` still describes what this queue would read now: made at the current
    /// epoch, and (belt and braces) its head is what the plan was made from.
    fn plan_current(&self, plan: &ReadPlan) -> bool {
        if plan.epoch != self.read_epoch || plan.level >= self.levels.len() {
            return false;
        }
        let l = &self.levels[plan.level];
        match &plan.what {
            ReadWhat::Range { from, .. } => {
                l.returned.is_empty()
                    && l.disk_count > 0
                    && message_key(plan.level as u8, l.disk_first) == *from
            }
            ReadWhat::Keys { keys, take } => {
                let (t, k) = self.returned_head(plan.level);
                t == *take && k == *keys
            }
        }
    }

    /// Take what the store gave back for `plan` (read here, or by the node outside the broker
    /// lock). False when nothing could be taken: the read failed (consumers wait for the
    /// broker's timer, `Broker::retry_reads`) or the plan is stale (the caller asks again).
    pub fn take_read(
        &mut self,
        plan: &ReadPlan,
        data: Result<ReadData, warren_storage::StoreError>,
    ) -> bool {
        if self.read_pending.is_some_and(|(e, _)| e == plan.epoch) {
            self.read_pending = None;
        }
        if !self.plan_current(plan) {
            return false;
        }
        self.read_epoch += 1;
        let level = plan.level;
        let data = match data {
            Ok(data) => {
                if let Some(unlogged) = self.read_errors.clear() {
                    tracing::info!(queue = %self.name, failures_not_logged = unlogged, "reading the queue back from the store works again");
                }
                data
            }
            Err(e) => {
                // Retried every 50 ms while it fails: logged once per interval, with counts.
                let clock = self
                    .pager
                    .as_ref()
                    .map_or(0, |p| p.clock.load(Ordering::Relaxed));
                if let Some(unlogged) = self.read_errors.hit(clock) {
                    tracing::error!(queue = %self.name, error = %e, failures_not_logged = unlogged, "reading a queue back from the store failed; retrying");
                }
                self.read_failed = true;
                if let Some(p) = &self.pager {
                    p.read_failed.store(true, Ordering::Relaxed);
                }
                return false;
            }
        };
        match (&plan.what, data) {
            (ReadWhat::Keys { take, .. }, ReadData::Keys(read)) => {
                self.fill_returned(level, *take, read);
            }
            (ReadWhat::Range { .. }, ReadData::Range(read)) => self.fill_from_disk(level, read),
            // A plan answered with the other kind of data: a defect of the caller's.
            _ => {
                tracing::error!(queue = %self.name, "a store read answered with the wrong kind of data");
                return false;
            }
        }
        true
    }

    /// Messages read from the disk part of a level go to its in-memory head.
    fn fill_from_disk(&mut self, level: usize, read: Vec<warren_storage::StoredMessage>) {
        if read.is_empty() {
            // The store does not have what the queue counted (a write failed): forget it.
            let l = &mut self.levels[level];
            tracing::error!(queue = %self.name, missing = l.disk_count, "messages missing from the store");
            self.lost += l.disk_count;
            self.count -= l.disk_count as usize;
            self.ready_bytes -= l.disk_bytes;
            l.disk_count = 0;
            l.disk_bytes = 0;
            return;
        }
        for m in read {
            let id = warren_storage::key_id(m.key);
            let size = m.body.len() as u64;
            let l = &mut self.levels[level];
            l.disk_count = l.disk_count.saturating_sub(1);
            l.disk_bytes = l.disk_bytes.saturating_sub(size);
            l.disk_first = id + 1;
            let msg = match super::stored_message(&m.exchange, &m.routing_key, m.properties, m.body)
            {
                Ok(msg) => msg,
                Err(_) => {
                    tracing::error!(queue = %self.name, id, "unreadable stored message");
                    self.lost += 1;
                    self.count -= 1;
                    self.ready_bytes -= size;
                    continue;
                }
            };
            let ttl = self.ttl(&msg);
            self.mem_count += 1;
            self.mem_bytes += size;
            self.levels[level].mem.push_back(QueuedMessage {
                id,
                msg: Arc::new(msg),
                redelivered: id <= self.redeliver_upto,
                expires_at: ttl.map(|t| m.timestamp_ms.saturating_add(t)),
                returns: 0,
                stored: true,
                batch: 0,
            });
        }
        let l = &mut self.levels[level];
        if l.disk_count == 0 {
            l.disk_bytes = 0;
        }
    }

    /// The first `take` paged-out requeued messages go back to the in-memory head: those still
    /// held as they are, the others from `read` (one per entry not held, in order).
    fn fill_returned(
        &mut self,
        level: usize,
        take: usize,
        read: Vec<Option<warren_storage::StoredMessage>>,
    ) {
        let mut read = read.into_iter();
        for _ in 0..take {
            let Some(r) = self.levels[level].returned.pop_front() else {
                break;
            };
            let msg = match r.msg {
                Some(msg) => {
                    self.levels[level].returned_held -= 1;
                    msg
                }
                None => {
                    let stored = read.next().flatten().map(|m| {
                        super::stored_message(&m.exchange, &m.routing_key, m.properties, m.body)
                    });
                    match stored {
                        Some(Ok(msg)) => {
                            self.mem_count += 1;
                            self.mem_bytes += r.size;
                            Arc::new(msg)
                        }
                        _ => {
                            tracing::error!(queue = %self.name, id = r.id, "requeued message missing from the store or unreadable");
                            self.lost += 1;
                            self.count -= 1;
                            self.ready_bytes -= r.size;
                            continue;
                        }
                    }
                }
            };
            self.levels[level].mem.push_back(QueuedMessage {
                id: r.id,
                msg,
                redelivered: r.redelivered,
                expires_at: r.expires_at,
                returns: r.returns,
                stored: r.stored,
                batch: 0,
            });
        }
    }

    /// Page requeued messages past the window back to the store (issue 12: 200,000 requeued
    /// messages stayed in memory): the tail of each level's in-memory head, lowest priority
    /// first, moves to `returned` until the head is within the window. One the store does not
    /// hold yet (transient, or in a queue that is not stored) goes to `spills` (its store key
    /// and message) for the caller to journal as `Op::Spill` in journal batch `spill_batch`
    /// (the one being built), and keeps its message until that batch is written; one the
    /// store holds keeps it until batch `stored_batch` is written (the caller's: the last one
    /// taken, or the one being built when it already holds writes, since the message's own
    /// enqueue may be among them).
    pub fn page_out_returned(
        &mut self,
        stored_batch: u64,
        spill_batch: u64,
        spills: &mut Vec<(u64, Arc<Message>)>,
    ) {
        if self.pager.is_none() {
            return;
        }
        // Messages requeued among the paged-out ones (`requeue`) get this batch too.
        for (level, l) in self.levels.iter_mut().enumerate() {
            if l.returned_unassigned == 0 {
                continue;
            }
            l.returned_unassigned = 0;
            for r in l.returned.iter_mut().filter(|r| r.batch == UNASSIGNED) {
                r.batch = stored_batch;
                if !r.stored {
                    if let Some(msg) = &r.msg {
                        spills.push((message_key(level as u8, r.id), msg.clone()));
                        r.stored = true;
                        r.batch = spill_batch;
                    }
                }
            }
        }
        if !spills.is_empty() {
            self.spilled = true;
        }
        let mut head: usize = self.levels.iter().map(|l| l.mem.len()).sum();
        if head <= WINDOW_MESSAGES && self.mem_bytes <= WINDOW_BYTES {
            return;
        }
        // Bytes of the in-memory heads (without staged and held messages), counted only when
        // the bytes may be what is over the window.
        let mut head_bytes: u64 = if self.mem_bytes > WINDOW_BYTES {
            self.levels
                .iter()
                .flat_map(|l| l.mem.iter())
                .map(|m| m.msg.body.len() as u64)
                .sum()
        } else {
            0
        };
        let (stored_queue, quorum) = (self.is_stored(), self.quorum);
        let keeps = |msg: &Message| stored_queue && (quorum || msg.persistent());
        for level in 0..self.levels.len() {
            let l = &mut self.levels[level];
            while head > WINDOW_MESSAGES || head_bytes > WINDOW_BYTES {
                let Some(qm) = l.mem.pop_back() else {
                    break;
                };
                let kept = qm.stored && keeps(&qm.msg);
                let size = qm.msg.body.len() as u64;
                head -= 1;
                head_bytes = head_bytes.saturating_sub(size);
                let batch = if qm.stored {
                    stored_batch
                } else {
                    spills.push((message_key(level as u8, qm.id), qm.msg.clone()));
                    spill_batch
                };
                self.disk_may_expire |= qm.expires_at.is_some();
                l.returned.push_front(Returned {
                    id: qm.id,
                    size,
                    returns: qm.returns,
                    redelivered: qm.redelivered,
                    expires_at: qm.expires_at,
                    stored: true,
                    kept,
                    batch,
                    msg: Some(qm.msg),
                });
                l.returned_held += 1;
                self.paged_out += 1;
            }
        }
        if !spills.is_empty() {
            self.spilled = true;
        }
    }

    /// What recovery found on disk for this queue: it stays there until read back. Ids up to
    /// `redeliver_upto` go out redelivered.
    pub fn restore(&mut self, levels: &[LevelSummary], redeliver_upto: u64) {
        self.read_epoch += 1;
        for s in levels {
            let level = (s.level as usize).min(self.levels.len() - 1);
            let l = &mut self.levels[level];
            l.disk_count += s.count;
            l.disk_bytes += s.bytes;
            l.disk_first = warren_storage::key_id(s.first);
            l.disk_last = warren_storage::key_id(s.last);
            self.count += s.count as usize;
            self.ready_bytes += s.bytes;
            self.disk_may_expire |= s.may_expire;
        }
        // Without a TTL on the queue or an expiration on some message, the expiry timer has
        // nothing to look for on disk (and must not read the head of every queue back).
        self.disk_may_expire |= self.message_ttl.is_some() && self.count > 0;
        self.redeliver_upto = redeliver_upto;
    }

    /// Put a message back at its original place (by id, within its priority). In a quorum queue
    /// a message returned more often than x-delivery-limit is dropped instead (to be
    /// dead-lettered); returns false then.
    /// The caller calls `after_requeue` once it has put back all it puts back.
    pub fn requeue(&mut self, mut qm: QueuedMessage) -> bool {
        qm.redelivered = true;
        if self.quorum {
            qm.returns += 1;
            if self
                .delivery_limit
                .is_some_and(|limit| qm.returns as u64 > limit)
            {
                self.dropped.push((qm, DropReason::DeliveryLimit));
                return false;
            }
        }
        let size = qm.msg.body.len() as u64;
        self.ready_bytes += size;
        self.count += 1;
        self.mem_count += 1;
        self.mem_bytes += size;
        let level = self.level(&qm.msg);
        let kept = qm.stored && self.keeps(&qm.msg);
        // Its id is below anything on disk or staged (it came from the head), but it may be
        // above requeued messages paged out before: then it goes among them, and
        // `page_out_returned` gives it a store write.
        let l = &mut self.levels[level];
        if l.returned.front().is_some_and(|r| r.id < qm.id) {
            let pos = l.returned.partition_point(|r| r.id < qm.id);
            self.disk_may_expire |= qm.expires_at.is_some();
            l.returned.insert(
                pos,
                Returned {
                    id: qm.id,
                    size,
                    returns: qm.returns,
                    redelivered: true,
                    expires_at: qm.expires_at,
                    stored: qm.stored,
                    kept,
                    batch: UNASSIGNED,
                    msg: Some(qm.msg),
                },
            );
            l.returned_held += 1;
            l.returned_unassigned += 1;
            return true;
        }
        let l = &mut l.mem;
        match l.front() {
            Some(first) if first.id < qm.id => {
                let pos = l.partition_point(|m| m.id < qm.id);
                l.insert(pos, qm);
            }
            _ => l.push_front(qm),
        }
        true
    }

    /// After requeues, as in RabbitMQ: what expired meanwhile leaves from the head (a TTL-0
    /// message does not come back), and x-max-length / x-max-length-bytes apply again
    /// (drop-head, oldest first). Then what is past the window pages out
    /// (`page_out_returned`, which see for the batches and `spills`). Returns whether
    /// anything left for `dropped` (the caller dead-letters it).
    pub fn after_requeue(
        &mut self,
        now: u64,
        stored_batch: u64,
        spill_batch: u64,
        spills: &mut Vec<(u64, Arc<Message>)>,
    ) -> bool {
        let mut gone = self.drop_expired(now);
        if self.overflow == Overflow::DropHead {
            gone += self.trim_to_limits();
        }
        self.page_out_returned(stored_batch, spill_batch, spills);
        gone > 0
    }

    /// The message as a consumer of this queue receives it: quorum queues add
    /// `x-delivery-count` (how often it came back).
    pub fn outgoing(&self, qm: &QueuedMessage) -> Arc<Message> {
        if !self.quorum {
            return qm.msg.clone();
        }
        let mut h = qm
            .msg
            .properties
            .headers()
            .as_ref()
            .map(|h| h.inner().clone())
            .unwrap_or_default();
        h.insert(
            "x-delivery-count".into(),
            amq_protocol::types::AMQPValue::LongLongInt(qm.returns as i64),
        );
        let props = super::deadletter::rebuild(&qm.msg.properties, Some(FieldTable::from(h)), true);
        Arc::new(Message {
            exchange: qm.msg.exchange.clone(),
            routing_key: qm.msg.routing_key.clone(),
            raw_properties: warren_protocol::codec::encode_properties(&props),
            properties: props,
            body: qm.msg.body.clone(),
            expiration: qm.msg.expiration,
        })
    }

    /// The level of the next message to deliver, if its in-memory head is empty and the store
    /// must be read first: what to read (no I/O here; see `plan_refill`). Deliveries to
    /// consumers ask the node for it rather than reading under the broker lock.
    pub fn head_read(&mut self) -> Option<ReadPlan> {
        let level = (0..self.levels.len())
            .rev()
            .find(|&l| self.levels[l].len() > 0)?;
        if !self.levels[level].mem.is_empty() {
            return None;
        }
        self.plan_refill(level)
    }

    /// For the expiry timer: the read a level needs before its head can be looked at (its
    /// in-memory head is empty, messages that may expire wait on disk), highest priority first.
    pub fn expiry_read(&mut self) -> Option<ReadPlan> {
        if !self.disk_may_expire {
            return None;
        }
        for level in (0..self.levels.len()).rev() {
            if self.levels[level].mem.is_empty() && self.levels[level].paged() {
                if let Some(plan) = self.plan_refill(level) {
                    return Some(plan);
                }
            }
        }
        None
    }

    /// For a drop-head queue with a length limit, whose publishes each take its head: the
    /// read of the next batch from disk, asked of the node while the in-memory head still has
    /// half a batch, so that the head is there before a publish needs it (a publish that finds
    /// it empty reads the store itself, under the broker lock). None when nothing is to be
    /// read ahead: another kind of queue, no reads through the node, the head empty (the
    /// delivery paths ask then) or full enough, requeued messages paged out first, or nothing
    /// on disk.
    pub fn prefetch_read(&mut self) -> Option<ReadPlan> {
        if self.overflow != Overflow::DropHead
            || (self.max_length.is_none() && self.max_length_bytes.is_none())
            || !self.async_reads()
        {
            return None;
        }
        let level = (0..self.levels.len())
            .rev()
            .find(|&l| self.levels[l].len() > 0)?;
        self.release_written(level);
        let l = &self.levels[level];
        if l.mem.is_empty()
            || l.mem.len() >= READ_MESSAGES / 2
            || !l.returned.is_empty()
            || l.disk_count == 0
        {
            return None;
        }
        Some(ReadPlan {
            level,
            epoch: self.read_epoch,
            what: ReadWhat::Range {
                from: message_key(level as u8, l.disk_first),
                to: message_key(level as u8, l.disk_last),
                want: (l.disk_count as usize).min(READ_MESSAGES),
            },
            after: l.settle,
        })
    }

    /// Whether the node should be asked for `plan` now: not if the same read is pending and
    /// was asked for less than `READ_ASK_AGAIN_MS` ago (`now`, broker clock ms).
    pub fn ask_read(&mut self, plan: &ReadPlan, now: u64) -> bool {
        if self
            .read_pending
            .is_some_and(|(e, at)| e == plan.epoch && now < at.saturating_add(READ_ASK_AGAIN_MS))
        {
            return false;
        }
        self.read_pending = Some((plan.epoch, now));
        true
    }

    /// The read a path that takes the head at once found it needed (see `wanted`), for the
    /// broker to ask of the node.
    pub fn take_wanted(&mut self) -> Option<ReadPlan> {
        self.wanted.take()
    }

    /// Want `plan` (see `wanted`), unless a read of a higher level is wanted in this state of
    /// the queue (the head delivered next is the highest level's); a stale plan is replaced.
    pub fn want(&mut self, plan: ReadPlan) {
        if self
            .wanted
            .as_ref()
            .is_none_or(|w| w.epoch != plan.epoch || w.level < plan.level)
        {
            self.wanted = Some(plan);
        }
    }

    /// Whether a read is wanted (see `wanted`).
    pub fn wants_read(&self) -> bool {
        self.wanted.is_some()
    }

    /// Whether backlog reads go through the node (see `Pager::async_reads`).
    pub fn async_reads(&self) -> bool {
        self.pager.as_ref().is_some_and(|p| p.async_reads)
    }

    /// The next message to deliver: highest priority first.
    pub fn pop(&mut self) -> Option<QueuedMessage> {
        let level = (0..self.levels.len())
            .rev()
            .find(|&l| self.levels[l].len() > 0)?;
        if self.levels[level].mem.is_empty() {
            self.refill(level);
        }
        let qm = self.levels[level].mem.pop_front()?;
        self.taken(&qm);
        Some(qm)
    }

    /// Account for a ready in-memory message that left.
    fn taken(&mut self, qm: &QueuedMessage) {
        let size = qm.msg.body.len() as u64;
        self.count -= 1;
        self.ready_bytes -= size;
        self.mem_count -= 1;
        self.mem_bytes -= size;
    }

    /// Every ready message in delivery order (priority levels high to low, then by id) with its
    /// store key and expiry: memory, paged-out requeues and the disk part read back from the
    /// store, staged. For comparing brokers and snapshots (`Broker::replicated_view`), not for
    /// delivery.
    #[allow(clippy::type_complexity)]
    pub fn ready_messages(
        &self,
    ) -> Result<Vec<(u64, Arc<Message>, Option<u64>)>, warren_storage::StoreError> {
        let mut out = Vec::with_capacity(self.count);
        for (level, l) in self.levels.iter().enumerate().rev() {
            let key = |id: u64| message_key(level as u8, id);
            out.extend(
                l.mem
                    .iter()
                    .map(|m| (key(m.id), m.msg.clone(), m.expires_at)),
            );
            let pager = self.pager.as_ref();
            let unheld: Vec<u64> = l
                .returned
                .iter()
                .filter(|r| r.msg.is_none())
                .map(|r| key(r.id))
                .collect();
            let mut read = match (pager, unheld.is_empty()) {
                (Some(p), false) => p.store.read_keys(&self.vhost, &self.name, &unheld)?,
                _ => Vec::new(),
            }
            .into_iter();
            for r in &l.returned {
                let msg = match &r.msg {
                    Some(m) => m.clone(),
                    None => match read.next().flatten() {
                        Some(m) => Arc::new(stored(m)?),
                        None => continue,
                    },
                };
                out.push((key(r.id), msg, r.expires_at));
            }
            if let (Some(p), true) = (pager, l.disk_count > 0) {
                for m in p.store.read(
                    &self.vhost,
                    &self.name,
                    key(l.disk_first),
                    key(l.disk_last),
                    usize::MAX,
                    usize::MAX,
                )? {
                    let (k, at) = (m.key, m.timestamp_ms);
                    let msg = stored(m)?;
                    let expires_at = self.ttl(&msg).map(|t| at.saturating_add(t));
                    out.push((k, Arc::new(msg), expires_at));
                }
            }
            out.extend(
                l.staged
                    .iter()
                    .map(|(_, m)| (key(m.id), m.msg.clone(), m.expires_at)),
            );
        }
        Ok(out)
    }

    /// Take out the ready messages with these store keys (`Op::Remove`), wherever they are:
    /// in memory, paged out after a requeue, staged, or on disk. On the broker that decided
    /// the removal (an ack, a delivery without ack, a drop) the messages had left the ready
    /// list already and nothing is found: each key costs a binary search of the level's parts
    /// (each is in id order), not a scan, so the leader's acks stay cheap. `sizes` are their
    /// body sizes, one per key, or empty if the remover did not know them: those on disk are
    /// then read by key to learn them. `batch`: the journal batch that records the removal in
    /// this broker's store (reads of the disk part wait for it: `Level::settle`).
    pub fn remove_keys(&mut self, keys: &[u64], sizes: &[u64], batch: u64) {
        let with_sizes = sizes.len() == keys.len();
        // Per level touched on disk: the sizes known, and the keys whose size must be read.
        let mut on_disk: Vec<(usize, Vec<u64>, Vec<u64>)> = Vec::new();
        for (i, &key) in keys.iter().enumerate() {
            let level = warren_storage::key_level(key) as usize;
            if level >= self.levels.len() {
                continue;
            }
            let id = warren_storage::key_id(key);
            if self.remove_id(level, id) {
                continue;
            }
            let l = &self.levels[level];
            if l.disk_count == 0 || !(l.disk_first..=l.disk_last).contains(&id) {
                // Not ready here (delivered already, on the broker that decided it).
                continue;
            }
            let at = match on_disk.iter().position(|(lv, _, _)| *lv == level) {
                Some(at) => at,
                None => {
                    on_disk.push((level, Vec::new(), Vec::new()));
                    on_disk.len() - 1
                }
            };
            match with_sizes {
                true => on_disk[at].1.push(sizes[i]),
                false => on_disk[at].2.push(key),
            }
        }
        for (level, known, unknown) in on_disk {
            // Each id of the disk range not found in memory is on disk: a message is removed
            // once, so nothing is counted twice.
            self.forget_on_disk(level, batch, |pager, q| {
                let mut all = known;
                if !unknown.is_empty() {
                    let read = pager.store.read_keys(&q.vhost, &q.name, &unknown)?;
                    all.extend(read.into_iter().flatten().map(|m| m.body.len() as u64));
                }
                Ok(all)
            });
        }
    }

    /// Take the ready message `id` of a level out of memory, the paged-out requeued ones or
    /// the staged ones (each in id order: binary search). Whether it was there.
    fn remove_id(&mut self, level: usize, id: u64) -> bool {
        let l = &mut self.levels[level];
        let (size, held) = if let Ok(pos) = l.mem.binary_search_by_key(&id, |m| m.id) {
            let Some(m) = l.mem.remove(pos) else {
                return false;
            };
            (m.msg.body.len() as u64, true)
        } else if let Ok(pos) = l.returned.binary_search_by_key(&id, |r| r.id) {
            let Some(r) = l.returned.remove(pos) else {
                return false;
            };
            if r.msg.is_some() {
                l.returned_held -= 1;
            }
            if r.batch == UNASSIGNED {
                l.returned_unassigned = l.returned_unassigned.saturating_sub(1);
            }
            (r.size, r.msg.is_some())
        } else if let Ok(pos) = l.staged.binary_search_by_key(&id, |(_, m)| m.id) {
            let Some((_, m)) = l.staged.remove(pos) else {
                return false;
            };
            (m.msg.body.len() as u64, true)
        } else {
            return false;
        };
        self.count -= 1;
        self.ready_bytes -= size;
        if held {
            self.mem_count -= 1;
            self.mem_bytes -= size;
        }
        true
    }

    /// Take out the ready messages with store keys from `from` to `to` (inclusive:
    /// `Op::RemoveRange`), wherever they are (see `remove_keys`). `counted`: how many that is
    /// and their bytes, if the remover knew (a range within one level): what leaves the disk
    /// part is then known without reading it. `batch` as for `remove_keys`.
    pub fn remove_key_range(
        &mut self,
        from: u64,
        to: u64,
        counted: Option<(u64, u64)>,
        batch: u64,
    ) {
        if from > to {
            return;
        }
        let (lf, lt) = (
            warren_storage::key_level(from) as usize,
            warren_storage::key_level(to) as usize,
        );
        for level in lf..=lt.min(self.levels.len() - 1) {
            let lo = if level == lf {
                warren_storage::key_id(from)
            } else {
                0
            };
            let hi = if level == lt {
                warren_storage::key_id(to)
            } else {
                u64::MAX
            };
            let (besides, besides_bytes) =
                self.remove_in_level(level, |id| (lo..=hi).contains(&id));
            let l = &mut self.levels[level];
            if l.disk_count == 0 || hi < l.disk_first || lo > l.disk_last {
                continue;
            }
            l.settle = batch;
            let l = &self.levels[level];
            if lo <= l.disk_first && hi >= l.disk_last {
                // The whole part on disk.
                let (n, bytes) = (l.disk_count, l.disk_bytes);
                let l = &mut self.levels[level];
                l.disk_count = 0;
                l.disk_bytes = 0;
                self.count -= n as usize;
                self.ready_bytes -= bytes;
                continue;
            }
            let (a, b) = (lo.max(l.disk_first), hi.min(l.disk_last));
            match counted.filter(|_| lf == lt) {
                // What was not elsewhere was on disk.
                Some((n, bytes)) => {
                    let n = n.saturating_sub(besides as u64).min(l.disk_count);
                    let bytes = bytes.saturating_sub(besides_bytes).min(l.disk_bytes);
                    self.read_epoch += 1;
                    let l = &mut self.levels[level];
                    l.disk_count -= n;
                    l.disk_bytes -= bytes;
                    self.count -= n as usize;
                    self.ready_bytes = self.ready_bytes.saturating_sub(bytes);
                }
                None => self.forget_on_disk(level, batch, |pager, q| {
                    pager
                        .store
                        .read(
                            &q.vhost,
                            &q.name,
                            message_key(level as u8, a),
                            message_key(level as u8, b),
                            usize::MAX,
                            usize::MAX,
                        )
                        .map(|v| v.into_iter().map(|m| m.body.len() as u64).collect())
                }),
            }
            let l = &mut self.levels[level];
            if a == l.disk_first {
                l.disk_first = b + 1;
            }
            if b == l.disk_last && a > 0 {
                l.disk_last = a - 1;
            }
        }
    }

    /// Remove the ready messages of a level whose id `gone` says, from memory, the paged-out
    /// requeued ones and the staged ones: how many went, and their bytes.
    fn remove_in_level(&mut self, level: usize, gone: impl Fn(u64) -> bool) -> (usize, u64) {
        let l = &mut self.levels[level];
        let (mut n, mut bytes, mut held, mut held_bytes) = (0usize, 0u64, 0usize, 0u64);
        l.returned.retain(|r| {
            if !gone(r.id) {
                return true;
            }
            n += 1;
            bytes += r.size;
            if r.msg.is_some() {
                held += 1;
                held_bytes += r.size;
            }
            false
        });
        l.returned_held -= held;
        l.mem.retain(|m| {
            if !gone(m.id) {
                return true;
            }
            n += 1;
            held += 1;
            let size = m.msg.body.len() as u64;
            bytes += size;
            held_bytes += size;
            false
        });
        l.staged.retain(|(_, m)| {
            if !gone(m.id) {
                return true;
            }
            n += 1;
            held += 1;
            let size = m.msg.body.len() as u64;
            bytes += size;
            held_bytes += size;
            false
        });
        self.count -= n;
        self.ready_bytes -= bytes;
        self.mem_count -= held;
        self.mem_bytes -= held_bytes;
        (n, bytes)
    }

    /// Messages of a level's disk part leave: `sizes` reads the body sizes of those the store
    /// has (the count and bytes on disk come down by them). A failed read is logged: the
    /// store still drops them with the op, and a later read-back finds fewer than counted.
    fn forget_on_disk(
        &mut self,
        level: usize,
        batch: u64,
        sizes: impl FnOnce(&Pager, &Queue) -> Result<Vec<u64>, warren_storage::StoreError>,
    ) {
        self.read_epoch += 1;
        self.levels[level].settle = batch;
        let Some(pager) = self.pager.clone() else {
            return;
        };
        match sizes(&pager, self) {
            Ok(sizes) => {
                let n = sizes.len() as u64;
                // Sizes may come from a replicated op: never an overflow.
                let bytes = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
                let l = &mut self.levels[level];
                let n = n.min(l.disk_count);
                l.disk_count -= n;
                l.disk_bytes = l.disk_bytes.saturating_sub(bytes);
                self.count -= n as usize;
                self.ready_bytes = self.ready_bytes.saturating_sub(bytes);
            }
            Err(e) => {
                tracing::error!(queue = %self.name, error = %e, "reading removed messages' sizes failed; the queue's count is off until it drains");
            }
        }
    }

    /// Drop expired messages from the head of each priority level (RabbitMQ expires at the head
    /// only: a message behind one with a longer TTL waits). `now` is in ms; a message expiring
    /// at `now` is gone. Dropped messages go to `dropped`. Returns how many went.
    pub fn drop_expired(&mut self, now: u64) -> usize {
        self.drop_expired_reading(now, usize::MAX)
    }

    /// Like `drop_expired`, reading at most `reads` batches per level from the store: the
    /// expiry tick takes a large expired backlog a batch at a time (it comes back every 50 ms)
    /// rather than all at once under the broker lock. Before a delivery the whole expired head
    /// must go, so the delivery paths use `drop_expired`.
    pub fn drop_expired_reading(&mut self, now: u64, reads: usize) -> usize {
        let mut n = 0;
        for level in (0..self.levels.len()).rev() {
            let mut refills = 0;
            loop {
                if self.levels[level].mem.is_empty() {
                    if refills >= reads || !self.levels[level].paged() || !self.disk_may_expire {
                        break;
                    }
                    self.refill(level);
                    refills += 1;
                }
                match self.levels[level].mem.front().map(|h| h.expires_at) {
                    Some(Some(at)) if at <= now => {
                        if let Some(m) = self.levels[level].mem.pop_front() {
                            self.taken(&m);
                            self.dropped.push((m, DropReason::Expired));
                        }
                        n += 1;
                    }
                    _ => break,
                }
            }
        }
        n
    }

    /// Drop from the head until within the limits (x-overflow drop-head).
    pub fn trim_to_limits(&mut self) -> usize {
        let mut n = 0;
        while self.over_limit() {
            match self.pop() {
                Some(m) => {
                    self.dropped.push((m, DropReason::MaxLen));
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Whether any ready message carries an expiry (the broker's expiry tick visits this queue).
    pub fn has_expiring(&self) -> bool {
        self.levels.iter().any(|l| {
            l.mem.iter().any(|m| m.expires_at.is_some())
                || l.staged.iter().any(|(_, m)| m.expires_at.is_some())
                || (self.disk_may_expire && (l.disk_count > 0 || !l.returned.is_empty()))
        })
    }

    /// Every message the queue holds now goes out redelivered: in memory, staged, paged out
    /// after a requeue, and on disk (messages with ids up to `upto`, the highest given so
    /// far, when read back).
    pub fn mark_all_redelivered(&mut self, upto: u64) {
        for l in self.levels.iter_mut() {
            for m in l.mem.iter_mut() {
                m.redelivered = true;
            }
            for (_, m) in l.staged.iter_mut() {
                m.redelivered = true;
            }
            for r in l.returned.iter_mut() {
                r.redelivered = true;
            }
        }
        self.redeliver_upto = self.redeliver_upto.max(upto);
    }

    /// Drop every ready message; returns how many, and the store keys of the dropped ones the
    /// store holds: in-memory ones one by one, and per level the range from the first on disk
    /// or staged onwards (`(from, to)` keys).
    pub fn purge(&mut self) -> Purged {
        self.read_epoch += 1;
        let mut purged = Purged {
            count: self.count,
            ..Default::default()
        };
        for level in 0..self.levels.len() {
            let l = &self.levels[level];
            for m in l.mem.iter().filter(|m| m.stored) {
                let key = message_key(level as u8, m.id);
                match self.keeps(&m.msg) {
                    true => purged.kept.push((key, m.msg.body.len() as u64)),
                    false => purged.local.push(key),
                }
            }
            for r in l.returned.iter().filter(|r| r.stored) {
                let key = message_key(level as u8, r.id);
                match r.kept {
                    true => purged.kept.push((key, r.size)),
                    false => purged.local.push(key),
                }
            }
            let first = if l.disk_count > 0 {
                Some(l.disk_first)
            } else {
                l.staged.front().map(|(_, m)| m.id)
            };
            if let Some(first) = first {
                let counted = (!self.spilled).then(|| {
                    let staged = l.staged.iter().map(|(_, m)| m.msg.body.len() as u64);
                    (
                        l.disk_count + l.staged.len() as u64,
                        l.disk_bytes + staged.sum::<u64>(),
                    )
                });
                purged.ranges.push((
                    message_key(level as u8, first),
                    message_key(level as u8, (1 << warren_storage::ID_BITS) - 1),
                    counted,
                ));
            }
            self.levels[level] = Level::default();
        }
        self.count = 0;
        self.ready_bytes = 0;
        self.mem_count = 0;
        self.mem_bytes = 0;
        purged
    }

    pub fn remove_consumer(&mut self, key: &ConsumerKey) -> bool {
        if let Some(pos) = self.local.consumers.iter().position(|c| c.key == *key) {
            self.local.consumers.remove(pos);
            if self.local.exclusive_consumer.as_ref() == Some(key) {
                self.local.exclusive_consumer = None;
            }
            if self.local.next > pos {
                self.local.next -= 1;
            }
            if self.local.next >= self.local.consumers.len() {
                self.local.next = 0;
            }
            if pos == 0 {
                self.promote_next_active();
            }
            true
        } else {
            false
        }
    }

    /// Add a consumer. With single-active-consumer, the first one stays active; the others wait
    /// in subscription order (by priority when they take over).
    pub fn add_consumer(&mut self, c: QueueConsumer) {
        self.local.consumers.push(c);
    }

    /// Which consumers may receive now, in the order to try them: with single-active-consumer
    /// only the active one (the first); else those of the highest priority that `can_take`
    /// accepts, round-robin from `next`, falling back to lower priorities when all of a higher
    /// one are blocked.
    pub fn candidates(&self) -> Vec<usize> {
        let n = self.local.consumers.len();
        if n == 0 {
            return Vec::new();
        }
        if self.single_active {
            return vec![self.active_index()];
        }
        let mut order: Vec<usize> = (0..n).map(|i| (self.local.next + i) % n).collect();
        // Stable sort keeps the round-robin order within a priority.
        order.sort_by_key(|&i| std::cmp::Reverse(self.local.consumers[i].priority));
        order
    }

    /// The active consumer of a single-active-consumer queue: the first subscribed.
    fn active_index(&self) -> usize {
        0
    }

    /// A single-active-consumer queue lost its active consumer: the waiting one with the highest
    /// priority (then subscription order) becomes active, by moving to the front.
    pub fn promote_next_active(&mut self) {
        if !self.single_active || self.local.consumers.len() < 2 {
            return;
        }
        let best = (0..self.local.consumers.len())
            .max_by_key(|&i| (self.local.consumers[i].priority, std::cmp::Reverse(i)))
            .unwrap_or(0);
        let c = self.local.consumers.remove(best);
        self.local.consumers.insert(0, c);
    }
}

//! A queue: its ready messages (by priority, then id), its consumers, its limits.

use super::{args, ConnId, Message};
use amq_protocol::types::FieldTable;
use std::collections::VecDeque;
use std::sync::Arc;

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
    pub tag: String,
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
    pub name: String,
    pub vhost: String,
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
    /// Ready messages, one deque per priority level (one level without x-max-priority).
    levels: Vec<VecDeque<QueuedMessage>>,
    count: usize,
    ready_bytes: u64,
    /// Consumers in subscription order; `next` is where the round-robin resumes.
    pub consumers: Vec<QueueConsumer>,
    pub next: usize,
    /// The consumer that holds this queue exclusively (basic.consume exclusive=true).
    pub exclusive_consumer: Option<ConsumerKey>,
    /// Delivered and not yet acked, across all channels.
    pub unacked: usize,
    /// Auto-delete queues go when their last consumer goes, but only after they had one.
    pub had_consumers: bool,
    /// Messages that left without an ack (expired, over the limit), for the broker to
    /// dead-letter and remove from the store.
    pub dropped: Vec<(QueuedMessage, DropReason)>,
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
            name,
            vhost,
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
            levels: (0..=max_priority).map(|_| VecDeque::new()).collect(),
            count: 0,
            ready_bytes: 0,
            consumers: Vec::new(),
            next: 0,
            exclusive_consumer: None,
            unacked: 0,
            had_consumers: false,
            dropped: Vec::new(),
        }
    }

    /// Whether this queue's persistent messages live in the store (durable, not exclusive).
    pub fn is_stored(&self) -> bool {
        self.durable && !self.exclusive
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
    fn level(&self, m: &Message) -> usize {
        let p = m.properties.priority().unwrap_or(0) as usize;
        p.min(self.levels.len() - 1)
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

    pub fn push(&mut self, qm: QueuedMessage) {
        self.ready_bytes += qm.msg.body.len() as u64;
        self.count += 1;
        let level = self.level(&qm.msg);
        let l = &mut self.levels[level];
        match l.back() {
            Some(last) if last.id > qm.id => {
                let pos = l.partition_point(|m| m.id < qm.id);
                l.insert(pos, qm);
            }
            _ => l.push_back(qm),
        }
    }

    /// Put a message back at its original place (by id, within its priority). In a quorum queue
    /// a message returned more often than x-delivery-limit is dropped instead (to be
    /// dead-lettered); returns false then.
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
        self.ready_bytes += qm.msg.body.len() as u64;
        self.count += 1;
        let level = self.level(&qm.msg);
        let l = &mut self.levels[level];
        match l.front() {
            Some(first) if first.id < qm.id => {
                let pos = l.partition_point(|m| m.id < qm.id);
                l.insert(pos, qm);
            }
            _ => l.push_front(qm),
        }
        true
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

    /// The next message to deliver: highest priority first.
    pub fn pop(&mut self) -> Option<QueuedMessage> {
        let qm = self.levels.iter_mut().rev().find_map(|l| l.pop_front())?;
        self.count -= 1;
        self.ready_bytes -= qm.msg.body.len() as u64;
        Some(qm)
    }

    /// Drop expired messages from the head of each priority level (RabbitMQ expires at the head
    /// only: a message behind one with a longer TTL waits). `now` is in ms; a message expiring
    /// at `now` is gone. Dropped messages go to `dropped`. Returns how many went.
    pub fn drop_expired(&mut self, now: u64) -> usize {
        let mut n = 0;
        for level in (0..self.levels.len()).rev() {
            while let Some(head) = self.levels[level].front() {
                match head.expires_at {
                    Some(at) if at <= now => {
                        if let Some(m) = self.levels[level].pop_front() {
                            self.count -= 1;
                            self.ready_bytes -= m.msg.body.len() as u64;
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
        self.levels
            .iter()
            .any(|l| l.iter().any(|m| m.expires_at.is_some()))
    }

    pub fn mark_all_redelivered(&mut self) {
        for l in self.levels.iter_mut() {
            for m in l.iter_mut() {
                m.redelivered = true;
            }
        }
    }

    /// Drop every ready message; returns how many.
    pub fn purge(&mut self) -> usize {
        let n = self.count;
        for l in self.levels.iter_mut() {
            l.clear();
        }
        self.count = 0;
        self.ready_bytes = 0;
        n
    }

    /// Ids of the ready persistent messages (those a store holds for a stored queue).
    pub fn ready_persistent_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.levels
            .iter()
            .flat_map(|l| l.iter())
            .filter(|m| m.msg.persistent())
            .map(|m| m.id)
    }

    pub fn remove_consumer(&mut self, key: &ConsumerKey) -> bool {
        if let Some(pos) = self.consumers.iter().position(|c| c.key == *key) {
            self.consumers.remove(pos);
            if self.exclusive_consumer.as_ref() == Some(key) {
                self.exclusive_consumer = None;
            }
            if self.next > pos {
                self.next -= 1;
            }
            if self.next >= self.consumers.len() {
                self.next = 0;
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
        self.consumers.push(c);
    }

    /// Which consumers may receive now, in the order to try them: with single-active-consumer
    /// only the active one (the first); else those of the highest priority that `can_take`
    /// accepts, round-robin from `next`, falling back to lower priorities when all of a higher
    /// one are blocked.
    pub fn candidates(&self) -> Vec<usize> {
        let n = self.consumers.len();
        if n == 0 {
            return Vec::new();
        }
        if self.single_active {
            return vec![self.active_index()];
        }
        let mut order: Vec<usize> = (0..n).map(|i| (self.next + i) % n).collect();
        // Stable sort keeps the round-robin order within a priority.
        order.sort_by_key(|&i| std::cmp::Reverse(self.consumers[i].priority));
        order
    }

    /// The active consumer of a single-active-consumer queue: the first subscribed.
    fn active_index(&self) -> usize {
        0
    }

    /// A single-active-consumer queue lost its active consumer: the waiting one with the highest
    /// priority (then subscription order) becomes active, by moving to the front.
    pub fn promote_next_active(&mut self) {
        if !self.single_active || self.consumers.len() < 2 {
            return;
        }
        let best = (0..self.consumers.len())
            .max_by_key(|&i| (self.consumers[i].priority, std::cmp::Reverse(i)))
            .unwrap_or(0);
        let c = self.consumers.remove(best);
        self.consumers.insert(0, c);
    }
}

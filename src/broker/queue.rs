//! A queue: its ready messages in id order, its consumers in round-robin order.

use super::{ConnId, Message};
use amq_protocol::types::FieldTable;
use std::collections::VecDeque;
use std::sync::Arc;

/// A message waiting in (or delivered from) a queue.
#[derive(Debug, Clone)]
pub struct QueuedMessage {
    /// Broker-wide id; a queue keeps ready messages sorted by it, so a requeued message goes back
    /// to its original place.
    pub id: u64,
    pub msg: Arc<Message>,
    /// Delivered at least once before.
    pub redelivered: bool,
    /// When it expires (ms since the epoch), from the queue's x-message-ttl and the message's
    /// expiration, whichever is sooner.
    pub expires_at: Option<u64>,
}

/// Identifies a consumer: its connection, channel and tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerKey {
    pub conn: ConnId,
    pub channel: u16,
    pub tag: String,
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
    ready: VecDeque<QueuedMessage>,
    ready_bytes: u64,
    /// Consumers in subscription order; `next` is where the round-robin resumes.
    pub consumers: Vec<ConsumerKey>,
    pub next: usize,
    /// The consumer that holds this queue exclusively (basic.consume exclusive=true).
    pub exclusive_consumer: Option<ConsumerKey>,
    /// Delivered and not yet acked, across all channels.
    pub unacked: usize,
    /// Auto-delete queues go when their last consumer goes, but only after they had one.
    pub had_consumers: bool,
    /// Ids of stored (persistent) messages that expired here and must be removed from the store.
    pub dropped: Vec<u64>,
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
        Queue {
            name,
            vhost,
            durable,
            exclusive,
            auto_delete,
            owner: None,
            message_ttl: super::args::message_ttl(&arguments),
            arguments,
            ready: VecDeque::new(),
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
        self.ready.len()
    }

    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    pub fn push(&mut self, qm: QueuedMessage) {
        self.ready_bytes += qm.msg.body.len() as u64;
        match self.ready.back() {
            Some(last) if last.id > qm.id => self.insert_sorted(qm),
            _ => self.ready.push_back(qm),
        }
    }

    /// Put a message back at its original place (by id).
    pub fn requeue(&mut self, mut qm: QueuedMessage) {
        qm.redelivered = true;
        self.ready_bytes += qm.msg.body.len() as u64;
        match self.ready.front() {
            Some(first) if first.id < qm.id => self.insert_sorted(qm),
            _ => self.ready.push_front(qm),
        }
    }

    fn insert_sorted(&mut self, qm: QueuedMessage) {
        let pos = self.ready.partition_point(|m| m.id < qm.id);
        self.ready.insert(pos, qm);
    }

    /// Drop expired messages from the head (RabbitMQ expires at the head only: a message behind
    /// one with a longer TTL waits). `now` is in ms; a message expiring at `now` is gone.
    /// Returns how many went.
    pub fn drop_expired(&mut self, now: u64) -> usize {
        let mut n = 0;
        while let Some(head) = self.ready.front() {
            match head.expires_at {
                Some(at) if at <= now => {
                    if let Some(m) = self.pop() {
                        if self.is_stored() && m.msg.persistent() {
                            self.dropped.push(m.id);
                        }
                    }
                    n += 1;
                }
                _ => break,
            }
        }
        n
    }

    /// Whether any ready message carries an expiry (the broker's expiry tick visits this queue).
    pub fn has_expiring(&self) -> bool {
        self.ready.iter().any(|m| m.expires_at.is_some())
    }

    pub fn mark_all_redelivered(&mut self) {
        for m in self.ready.iter_mut() {
            m.redelivered = true;
        }
    }

    pub fn pop(&mut self) -> Option<QueuedMessage> {
        let qm = self.ready.pop_front()?;
        self.ready_bytes -= qm.msg.body.len() as u64;
        Some(qm)
    }

    /// Drop every ready message; returns how many.
    pub fn purge(&mut self) -> usize {
        let n = self.ready.len();
        self.ready.clear();
        self.ready_bytes = 0;
        n
    }

    /// Ids of the ready persistent messages (those a store holds for a stored queue).
    pub fn ready_persistent_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.ready
            .iter()
            .filter(|m| m.msg.persistent())
            .map(|m| m.id)
    }

    pub fn remove_consumer(&mut self, key: &ConsumerKey) -> bool {
        if let Some(pos) = self.consumers.iter().position(|c| c == key) {
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
            true
        } else {
            false
        }
    }
}

//! A connection's outgoing bytes: frames are encoded into it by whoever produces them (the
//! connection's own handlers, or another connection's publish that dispatched a delivery here),
//! and the connection's writer task swaps the buffer out and writes it in one call.
//!
//! Lock order: broker → outbox registry → outbox. The writer takes an outbox lock alone, and
//! takes the broker lock only while holding no outbox lock.

use crate::broker::Message;
use amq_protocol::protocol::AMQPClass;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use tokio::sync::Notify;
use warren_protocol::OutBuffer;

#[derive(Debug, Default)]
pub struct Outbox {
    buf: Mutex<OutBuffer>,
    /// Bytes buffered, readable without the lock (the reader's backpressure check).
    len: AtomicUsize,
    /// Wakes the writer.
    pub(crate) wake: Notify,
    /// Wakes a reader waiting for the writer to drain.
    pub(crate) drained: Notify,
    /// Negotiated frame_max, for splitting bodies.
    frame_max: AtomicU32,
    /// The broker core ran out of delivery budget for this connection; the writer must report
    /// what it flushed (see `Broker::refill`).
    pub(crate) throttled: AtomicBool,
    /// Close the socket once everything buffered is written.
    pub(crate) close_after_flush: AtomicBool,
    /// The client takes basic.cancel from the server (capability consumer_cancel_notify).
    pub(crate) cancel_notify: AtomicBool,
    /// Negotiated heartbeat in seconds (0 = none); the writer sends one when idle half as long.
    pub(crate) heartbeat: AtomicU16,
    /// The broker's id for this connection once connection.open succeeded (0 before).
    pub(crate) conn_id: AtomicU64,
    /// Bytes that wait for a commit: replies of durable declarations until their commit is
    /// fsynced (`hold_begin`), and on a cluster's leader deliveries of messages until their
    /// entry is committed (`hold_until`).
    held: Mutex<Holds>,
}

/// Marks in the buffer, in order: the bytes from a mark's `from` on stay unwritten until its
/// commit is done and every earlier mark's too. Several at once, each released on its own:
/// with one region whose ticket only grew, a consumer of a steady stream of messages would
/// wait for ever for a commit that is always one entry behind.
#[derive(Debug, Default)]
struct Holds {
    marks: std::collections::VecDeque<Mark>,
    next_id: u64,
    /// The connection.close or close-ok pushed behind a hold, with its offset in the buffer,
    /// until the writer takes it: `abandon_held` pushes it again if it drops it. (A node that
    /// stopped leading dropped a 320 pushed behind deliveries held for their commit, and the
    /// client saw its socket end 2-3 s later with no close.)
    ending: Option<(usize, AMQPClass)>,
}

#[derive(Debug)]
struct Mark {
    id: u64,
    from: usize,
    ticket: u64,
    /// Begun (`hold_begin`) and not yet given its ticket: nothing releases it meanwhile.
    pending: bool,
}

/// A hold begun by `Outbox::hold_begin`, ended by `Outbox::hold_end`.
#[derive(Debug, Clone, Copy)]
pub struct HoldId(u64);

impl Outbox {
    pub fn new(frame_max: u32) -> Self {
        let o = Outbox::default();
        o.frame_max.store(frame_max, Ordering::Relaxed);
        o
    }

    pub fn set_frame_max(&self, frame_max: u32) {
        self.frame_max.store(frame_max, Ordering::Relaxed);
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn with(&self, f: impl FnOnce(&mut OutBuffer)) {
        let mut buf = self.buf.lock();
        f(&mut buf);
        self.len.store(buf.len(), Ordering::Release);
        drop(buf);
        self.wake.notify_one();
    }

    pub fn method(&self, channel: u16, method: &AMQPClass) {
        self.with(|b| b.method(channel, method));
    }

    /// A method followed by the message's content (deliver, get-ok, return).
    pub fn method_with_content(&self, channel: u16, method: &AMQPClass, msg: &Message) {
        let frame_max = self.frame_max.load(Ordering::Relaxed);
        self.with(|b| {
            b.method(channel, method);
            b.content(channel, &msg.raw_properties, &msg.body, frame_max);
        });
    }

    pub fn deliver(
        &self,
        channel: u16,
        consumer_tag: &str,
        delivery_tag: u64,
        redelivered: bool,
        msg: &Message,
    ) {
        let frame_max = self.frame_max.load(Ordering::Relaxed);
        self.with(|b| {
            b.deliver(
                channel,
                consumer_tag,
                delivery_tag,
                redelivered,
                msg.exchange.as_ref(),
                msg.routing_key.as_ref(),
            );
            b.content(channel, &msg.raw_properties, &msg.body, frame_max);
        });
    }

    /// connection.close or connection.close-ok: the last frame the connection sends (see
    /// `Holds::ending`; held bytes may be dropped, this never is).
    pub(crate) fn connection_end(&self, method: &AMQPClass) {
        let mut held = self.held.lock();
        let mut buf = self.buf.lock();
        if !held.marks.is_empty() {
            held.ending = Some((buf.len(), method.clone()));
        }
        buf.method(0, method);
        self.len.store(buf.len(), Ordering::Release);
        drop(buf);
        drop(held);
        self.wake.notify_one();
    }

    /// A publisher confirm.
    pub fn ack(&self, channel: u16, delivery_tag: u64, multiple: bool) {
        self.with(|b| b.ack(channel, delivery_tag, multiple));
    }

    pub fn heartbeat(&self) {
        self.with(|b| b.heartbeat());
    }

    /// Take everything buffered (the writer swaps in its empty buffer), up to the first hold.
    pub(crate) fn take(&self, into: &mut OutBuffer) {
        let mut held = self.held.lock();
        let mut buf = self.buf.lock();
        match held.marks.front() {
            Some(first) => {
                // Never past the end (move_front asserts): a mark registered late must not
                // panic the writer.
                let from = first.from.min(buf.len());
                buf.move_front(from, into);
                for m in held.marks.iter_mut() {
                    m.from = m.from.saturating_sub(from);
                }
                held.ending = held
                    .ending
                    .take()
                    .and_then(|(at, m)| at.checked_sub(from).map(|at| (at, m)));
                self.len.store(buf.len(), Ordering::Release);
            }
            None => {
                std::mem::swap(&mut *buf, into);
                self.len.store(0, Ordering::Release);
                held.ending = None;
            }
        }
    }

    /// Keep everything pushed from now on unwritten, until `hold_end` says which commit it
    /// waits for: a durable declare-ok must not reach the client before the declaration is on
    /// disk. Call it before the reply is pushed, under the broker lock (so that nothing else
    /// pushes to this outbox in between): the hold then starts at the reply or before it,
    /// whatever the writer takes meanwhile. (Registering the hold after the push, at a
    /// position read before it, let a busy writer send the reply first: issue 13 point 7.)
    pub(crate) fn hold_begin(&self) -> HoldId {
        HoldId(self.push_mark(&mut self.held.lock(), 0, true))
    }

    /// The bytes pushed since `hold_begin` wait for commit `ticket`; with None (nothing was
    /// journaled) the hold is lifted (what follows it still waits for later marks).
    pub(crate) fn hold_end(&self, hold: HoldId, ticket: Option<u64>) {
        let mut held = self.held.lock();
        let Some(pos) = held.marks.iter().position(|m| m.id == hold.0) else {
            return;
        };
        match ticket {
            Some(t) => {
                held.marks[pos].ticket = t;
                held.marks[pos].pending = false;
            }
            None => {
                // Its bytes go with the mark before it (or are free if it was the first).
                held.marks.remove(pos);
                if pos == 0 {
                    drop(held);
                    self.wake.notify_one();
                }
            }
        }
    }

    /// Keep everything pushed from now on unwritten until commit `ticket` is done (a
    /// delivery of a message whose entry is not committed yet). Under the broker lock, before
    /// the push. A mark already waiting for this commit or a later one covers it.
    pub(crate) fn hold_until(&self, ticket: u64) {
        let mut held = self.held.lock();
        if held
            .marks
            .back()
            .is_some_and(|m| !m.pending && m.ticket >= ticket)
        {
            return;
        }
        self.push_mark(&mut held, ticket, false);
    }

    /// A new hold mark at the end of what is pushed so far; its id.
    fn push_mark(&self, held: &mut Holds, ticket: u64, pending: bool) -> u64 {
        let from = self.buf.lock().len();
        let id = held.next_id;
        held.next_id += 1;
        held.marks.push_back(Mark {
            id,
            from,
            ticket,
            pending,
        });
        id
    }

    /// Commit `ticket` is done (and every one before it: commits are done in order): release
    /// the holds that waited for it or an earlier one, up to the first still waiting.
    pub(crate) fn release(&self, ticket: u64) {
        let mut held = self.held.lock();
        let mut released = false;
        while held
            .marks
            .front()
            .is_some_and(|m| !m.pending && m.ticket <= ticket)
        {
            held.marks.pop_front();
            released = true;
        }
        if released {
            drop(held);
            self.wake.notify_one();
        }
    }

    /// Drop what holds keep back (the connection ends before its commits are reported), all
    /// but a connection.close or close-ok among it, which is pushed again after what is kept.
    pub(crate) fn abandon_held(&self) {
        let mut held = self.held.lock();
        let Some(first) = held.marks.front() else {
            return;
        };
        let mut buf = self.buf.lock();
        let mut front = OutBuffer::new();
        let from = first.from.min(buf.len());
        buf.move_front(from, &mut front);
        *buf = front;
        if let Some((at, method)) = held.ending.take() {
            if at >= from {
                buf.method(0, &method);
            }
        }
        self.len.store(buf.len(), Ordering::Release);
        held.marks.clear();
        drop(buf);
        drop(held);
        self.wake.notify_one();
    }

    /// Whether `take` would hand over something now (bytes before the first hold).
    pub(crate) fn has_unheld(&self) -> bool {
        let held = self.held.lock();
        match held.marks.front() {
            Some(first) => first.from.min(self.len()) > 0,
            None => !self.is_empty(),
        }
    }

    pub(crate) fn is_held(&self) -> bool {
        !self.held.lock().marks.is_empty()
    }

    /// Ask the writer to close the socket after flushing.
    pub fn close_after_flush(&self) {
        self.close_after_flush.store(true, Ordering::Release);
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::Outbox;
    use amq_protocol::protocol::{connection, AMQPClass};
    use warren_protocol::OutBuffer;

    fn close_320() -> AMQPClass {
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 320,
            reply_text: "leader changed".into(),
            class_id: 0,
            method_id: 0,
        }))
    }

    fn close_ok() -> AMQPClass {
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {}))
    }

    fn taken(o: &Outbox) -> Vec<u8> {
        let mut out = OutBuffer::new();
        o.take(&mut out);
        out.to_vec()
    }

    fn frames(f: impl FnOnce(&mut OutBuffer)) -> Vec<u8> {
        let mut b = OutBuffer::new();
        f(&mut b);
        b.to_vec()
    }

    #[test]
    fn a_close_pushed_behind_held_bytes_survives_their_abandon() {
        for end in [close_320(), close_ok()] {
            let o = Outbox::new(131072);
            o.ack(1, 1, false);
            o.hold_until(7);
            o.ack(1, 2, false);
            o.connection_end(&end);
            // The writer takes what is before the hold; the close waits behind it.
            assert_eq!(taken(&o), frames(|b| b.ack(1, 1, false)));
            assert!(taken(&o).is_empty());
            // The node stops leading: the held confirm is dropped, the close goes out.
            o.abandon_held();
            assert_eq!(taken(&o), frames(|b| b.method(0, &end)));
            assert!(!o.is_held());
        }
    }

    #[test]
    fn a_close_already_written_is_not_pushed_again_by_a_later_abandon() {
        let o = Outbox::new(131072);
        o.hold_until(3);
        o.ack(1, 1, false);
        o.connection_end(&close_320());
        o.release(3);
        assert_eq!(
            taken(&o),
            frames(|b| {
                b.ack(1, 1, false);
                b.method(0, &close_320());
            })
        );
        // Deliveries dispatched after the close and held for a later commit, then dropped.
        o.hold_until(4);
        o.ack(1, 2, false);
        o.abandon_held();
        assert!(taken(&o).is_empty());
    }

    #[test]
    fn a_close_ahead_of_a_later_hold_is_kept_where_it_is() {
        let o = Outbox::new(131072);
        o.hold_until(3);
        o.ack(1, 1, false);
        o.connection_end(&close_320());
        // A partial take (a mark released in between) keeps the close's offset right.
        o.release(3);
        o.hold_until(5);
        o.ack(1, 2, false);
        o.abandon_held();
        assert_eq!(
            taken(&o),
            frames(|b| {
                b.ack(1, 1, false);
                b.method(0, &close_320());
            })
        );
    }
}

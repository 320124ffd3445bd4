//! The protocol state of one connection: handshake, channels, and the one exhaustive dispatch
//! from a frame to the handler for its class and method (`crate::handlers`, one file per class).

use crate::broker::cmd::{Cmd, Grant, Outcome, Via, Who};
use crate::broker::{ConnId, Effect};
use crate::commit::Done;
use crate::node::{Caller, Shared};
use crate::outbox::Outbox;
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::protocol::AMQPClass;
use amq_protocol::types::FieldTable;
use bytes::Bytes;
use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;
use tracing::debug;
use warren_protocol::{AmqpError, ContentAssembler, Frame, FrameError, ReplyCode};

/// What the connection task does after a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Continue,
    /// We sent connection.close and wait for close-ok (bounded by the caller).
    Closing,
    /// Close the socket now (after flushing).
    Close,
    /// The client closed the connection and has its close-ok: read and drop what it still
    /// sends until it closes the socket (bounded by the caller), as RabbitMQ does. Clients
    /// that send connection.close from several threads at once read the close-ok and shut
    /// down cleanly only if the socket stays open until they do.
    Drain,
    /// A refused handshake (a malformed SASL response, or a bad login from a client that does
    /// not take connection.close for it): read and drop what the client sends, then close the
    /// socket without a frame after `LINGER`, as RabbitMQ does (it also slows down guessing).
    Linger,
}

/// How long a refused handshake lingers before the socket closes (RabbitMQ's 3 s).
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(3);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    AwaitStartOk,
    AwaitTuneOk,
    AwaitOpen,
    Open,
    /// We sent connection.close; only close-ok (or close) matters now.
    Closing,
    /// The client closed the connection and got close-ok (`Next::Drain`); its state is gone.
    Closed,
}

/// One buffered acknowledgement inside a transaction.
#[derive(Debug, Clone)]
pub(crate) enum TxAck {
    Ack {
        tag: u64,
        multiple: bool,
    },
    Reject {
        tag: u64,
        multiple: bool,
        requeue: bool,
    },
}

/// What a channel in tx mode holds until commit.
#[derive(Debug, Default)]
pub(crate) struct Tx {
    /// Messages and their mandatory flag, routed at commit.
    pub publishes: Vec<(Arc<crate::broker::Message>, bool)>,
}

/// Protocol-side state of one open channel (the broker core holds the delivery side).
#[derive(Debug, Default)]
pub(crate) struct Chan {
    /// We sent channel.close and wait for close-ok; other frames are dropped.
    pub closing: bool,
    pub content: ContentAssembler,
    /// confirm.select was received.
    pub confirm: bool,
    /// Sequence number of the last publish in confirm mode. Publishes up to here are confirmed
    /// once none before them waits for the store; the basic.ack goes out at the end of what the
    /// client sent in one go, `multiple` when it covers several.
    pub publish_seq: u64,
    /// Publishes whose message waits for its fsync, in order.
    pub durable_pending: VecDeque<u64>,
    /// Publishes the store could not take: nacked.
    pub failed: BTreeSet<u64>,
    /// Last sequence number confirmed (acked or nacked) to the client.
    pub acked_upto: u64,
    /// Tells this channel apart from an earlier one with the same number (late commits).
    pub generation: u64,
    pub tx: Option<Tx>,
    /// The last queue declared on this channel (an empty queue name in later methods means it).
    pub last_queue: Option<String>,
}

/// A confirm that waits for a commit.
#[derive(Debug)]
pub(crate) struct CommitWait {
    pub ticket: u64,
    pub channel: u16,
    pub generation: u64,
    pub seq: u64,
}

/// What a core call needs besides the broker: an effects buffer, where the committer reports
/// back, and the ticket of the last call's durable changes.
#[derive(Debug)]
pub(crate) struct CoreCtx {
    pub fx: Vec<Effect>,
    pub notify: UnboundedSender<Done>,
    pub last_ticket: Option<u64>,
}

pub struct Session {
    pub(crate) shared: Arc<Shared>,
    pub(crate) outbox: Arc<Outbox>,
    pub(crate) peer: SocketAddr,
    pub(crate) phase: Phase,
    /// Registered in the broker core at connection.open.
    pub(crate) conn: ConnId,
    pub(crate) vhost: String,
    pub(crate) user: String,
    pub(crate) frame_max: u32,
    pub(crate) channel_max: u16,
    pub(crate) heartbeat: u16,
    pub(crate) channels: rustc_hash::FxHashMap<u16, Chan>,
    /// The client takes connection.close after a failed login (capability).
    pub(crate) auth_failure_close: bool,
    /// Effects buffer and commit reporting for core calls.
    pub(crate) ctx: CoreCtx,
    /// Confirms waiting for commits, in ticket order.
    pub(crate) commit_waits: VecDeque<CommitWait>,
    /// Numbers channel generations.
    pub(crate) next_generation: u64,
    /// A channel.close was just pushed: the read loop stops handling buffered frames and
    /// lets the writer run before reading on (see `read_loop`).
    pub(crate) closed_channel: bool,
    /// A basic.publish arrived since the connection task last looked (disk alarm blocking).
    pub(crate) published: bool,
    /// A publish went to a queue past its in-memory window: read nothing more from this client
    /// until the store has written up to this commit ticket (flow control: a publisher to a
    /// deep queue goes at the speed of the disk, and staged messages stay bounded in memory).
    pub(crate) throttle: Option<u64>,
    /// A publish stayed in memory past a queue's window because the queue's consumers are
    /// behind: read nothing more from this client until they catch up (`Broker::holding`),
    /// for at most `Config::flow_hold`.
    pub(crate) hold: crate::broker::Targets,
    /// The client understands connection.blocked / unblocked (capability).
    pub(crate) blocked_capability: bool,
    /// What the management API shows of this connection.
    pub(crate) info: Option<Arc<crate::registry::ConnInfo>>,
    /// Body bytes received for contents not yet complete, across channels (an upper bound;
    /// see `check_unfinished`).
    pub(crate) unfinished: u64,
    /// The user's permissions in the vhost, as last looked up.
    pub(crate) grant: Grant,
}

impl Session {
    /// Hand `cmd` to the node's one entry point as this connection (its user, vhost and
    /// permissions; its replies to its outbox). The commit ticket of the durable changes it
    /// made is left in `ctx.last_ticket` (None when there were none).
    pub(crate) fn run(&mut self, cmd: Cmd) -> Result<Outcome, AmqpError> {
        self.run_as(self.conn, cmd, None)
    }

    /// Like [`Session::run`], for a held reply that also waits for an earlier commit
    /// (`after`): a tx.commit-ok waits for the publishes the commit routed in earlier calls.
    pub(crate) fn run_after(&mut self, cmd: Cmd, after: Option<u64>) -> Result<Outcome, AmqpError> {
        self.run_as(self.conn, cmd, after)
    }

    fn run_as(&mut self, conn: ConnId, cmd: Cmd, after: Option<u64>) -> Result<Outcome, AmqpError> {
        let who = Who {
            via: Via::Client,
            conn,
            user: &self.user,
            vhost: &self.vhost,
            grant: &self.grant,
        };
        // Borrowed apart: `execute` clones the sender once (the committer keeps it per batch).
        let CoreCtx { fx, notify, .. } = &mut self.ctx;
        let caller = Caller::Conn {
            who,
            outbox: &self.outbox,
            notify,
            fx,
            after,
        };
        let (r, ticket) = self.shared.execute(caller, cmd);
        self.ctx.last_ticket = ticket;
        r
    }
}

impl Session {
    pub fn new(
        shared: Arc<Shared>,
        outbox: Arc<Outbox>,
        peer: SocketAddr,
        notify: UnboundedSender<Done>,
    ) -> Self {
        // Until tune-ok settles it, frames are limited to the protocol's minimum frame size,
        // as in RabbitMQ (a larger connection.start-ok is refused).
        let frame_max = FRAME_MIN_SIZE;
        let channel_max = shared.config.channel_max;
        Session {
            shared,
            outbox,
            peer,
            phase: Phase::AwaitStartOk,
            conn: 0,
            vhost: String::new(),
            user: String::new(),
            frame_max,
            channel_max,
            heartbeat: 0,
            channels: Default::default(),
            info: None,
            auth_failure_close: false,
            ctx: CoreCtx {
                fx: Vec::new(),
                notify,
                last_ticket: None,
            },
            commit_waits: VecDeque::new(),
            next_generation: 1,
            published: false,
            closed_channel: false,
            throttle: None,
            hold: Default::default(),
            blocked_capability: false,
            unfinished: 0,
            grant: Grant::default(),
        }
    }

    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open | Phase::Closing) && self.conn != 0
    }

    pub fn heartbeat(&self) -> u16 {
        self.heartbeat
    }

    pub fn frame_max(&self) -> u32 {
        self.frame_max
    }

    /// Handle one frame; errors become channel.close or connection.close here.
    pub fn handle(&mut self, frame: Frame) -> Next {
        if self.phase == Phase::Closed {
            // A repeated connection.close gets its close-ok too (RabbitMQ answers each).
            if let Frame::Method(
                0,
                AMQPClass::Connection(amq_protocol::protocol::connection::AMQPMethod::Close(_)),
            ) = frame
            {
                self.send_connection_close_ok();
            }
            return Next::Drain;
        }
        if self.phase == Phase::Closing {
            return match frame {
                Frame::Method(0, AMQPClass::Connection(m)) => match m {
                    amq_protocol::protocol::connection::AMQPMethod::CloseOk(_) => Next::Close,
                    amq_protocol::protocol::connection::AMQPMethod::Close(_) => {
                        self.send_connection_close_ok();
                        Next::Close
                    }
                    _ => Next::Closing,
                },
                _ => Next::Closing,
            };
        }
        if self.phase == Phase::Open && !self.shared.serves_clients() {
            // This node stopped leading (or never led: a client it did not hand to the
            // leader): no command runs here any more, not even the frames already read, since
            // a change on a node that does not lead is one the cluster never agreed on. 320,
            // and the client reconnects (through any node, to the leader).
            let reason = match &self.shared.replication {
                Some(rep) => rep.not_leading(),
                None => "this node serves no client".into(),
            };
            self.force_close(&reason);
            return Next::Closing;
        }
        let channel = frame.channel();
        match self.dispatch(frame) {
            Ok(next) => next,
            Err(e) => self.fail(channel, e),
        }
    }

    fn dispatch(&mut self, frame: Frame) -> Result<Next, AmqpError> {
        if self.phase != Phase::Open {
            return self.handshake(frame.into_method());
        }
        match frame {
            // The method every message starts with, straight to its channel's content when the
            // channel takes it as it is (open, not closing, no content pending); otherwise the
            // generic path gives the same answers as for any method.
            Frame::Publish(ch, p) => match self.channels.get_mut(&ch) {
                Some(chan) if ch != 0 && !chan.closing && chan.content.is_idle() => {
                    if p.immediate {
                        return Err(AmqpError::not_implemented("immediate=true").on(60, 40));
                    }
                    chan.content.publish(p).map_err(|e| e.on(60, 40))?;
                    Ok(Next::Continue)
                }
                _ => self.dispatch(Frame::Publish(ch, p).into_method()),
            },
            Frame::Heartbeat(0) => Ok(Next::Continue),
            Frame::Heartbeat(_) => Err(AmqpError::new(
                ReplyCode::UnexpectedFrame,
                "type 8, all octets = <<>>",
            )
            .on_no_method()),
            Frame::Method(0, method) => self.connection_method(method),
            Frame::Method(ch, method) => {
                self.channel_method(ch, method)?;
                Ok(Next::Continue)
            }
            Frame::Header {
                channel: 0,
                class_id,
                body_size,
                raw_properties,
                ..
            } => {
                // RabbitMQ names the frame by its type and payload (weight is always 0).
                let mut payload = Vec::with_capacity(12 + raw_properties.len());
                payload.extend_from_slice(&class_id.to_be_bytes());
                payload.extend_from_slice(&[0, 0]);
                payload.extend_from_slice(&body_size.to_be_bytes());
                payload.extend_from_slice(&raw_properties);
                Err(unexpected_frame(2, &payload))
            }
            Frame::Body(0, data) => Err(unexpected_frame(3, &data)),
            Frame::Header {
                channel,
                class_id,
                body_size,
                properties,
                raw_properties,
            } => {
                self.content_header(channel, class_id, body_size, properties, raw_properties)?;
                Ok(Next::Continue)
            }
            Frame::Body(ch, data) => {
                self.content_body(ch, data)?;
                Ok(Next::Continue)
            }
        }
    }

    /// Method frames on a non-zero channel.
    fn channel_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), AmqpError> {
        use amq_protocol::protocol::channel::AMQPMethod as C;
        let (class_id, method_id) = (method.get_amqp_class_id(), method.get_amqp_method_id());
        let result = (|| {
            let Some(chan) = self.channels.get_mut(&ch) else {
                return match method {
                    AMQPClass::Channel(C::Open(_)) => self.channel_open(ch),
                    _ => Err(AmqpError::channel_error("expected 'channel.open'")),
                };
            };
            if chan.closing {
                // Waiting for close-ok: everything else on this channel is dropped (spec).
                match method {
                    AMQPClass::Channel(C::CloseOk(_)) => {
                        self.channels.remove(&ch);
                    }
                    AMQPClass::Channel(C::Close(_)) => {
                        // The client closed it too (the closes crossed): answer, and keep
                        // waiting for the close-ok of ours, as RabbitMQ does; forgetting the
                        // channel now would make that close-ok a 504 on an unknown channel.
                        self.outbox.method(
                            ch,
                            &AMQPClass::Channel(C::CloseOk(
                                amq_protocol::protocol::channel::CloseOk {},
                            )),
                        );
                    }
                    _ => {}
                }
                return Ok(());
            }
            if !chan.content.is_idle() {
                return Err(chan.content.unexpected());
            }
            match method {
                AMQPClass::Channel(m) => self.channel_class(ch, m),
                AMQPClass::Exchange(m) => self.exchange_class(ch, m),
                AMQPClass::Queue(m) => self.queue_class(ch, m),
                AMQPClass::Basic(m) => self.basic_class(ch, m),
                AMQPClass::Confirm(m) => self.confirm_class(ch, m),
                AMQPClass::Tx(m) => self.tx_class(ch, m),
                AMQPClass::Access(m) => self.access_class(ch, m),
                AMQPClass::Connection(_) => Err(AmqpError::command_invalid("unimplemented method")),
            }
        })();
        result.map_err(|e| e.on(class_id, method_id))
    }

    /// Turn an error into the close the spec asks for.
    fn fail(&mut self, channel: u16, e: AmqpError) -> Next {
        debug!(channel, code = e.code.code(), text = %e.text, "error");
        if !e.hard && channel != 0 && self.channels.contains_key(&channel) {
            self.outbox.method(channel, &e.close_method());
            self.closed_channel = true;
            self.close_channel_state(channel);
            if let Some(chan) = self.channels.get_mut(&channel) {
                chan.closing = true;
            }
            return Next::Continue;
        }
        let mut e = e;
        e.hard = true;
        self.outbox.connection_end(&e.close_method());
        self.phase = Phase::Closing;
        Next::Closing
    }

    /// A framing error: connection.close with the matching code; the socket closes after it
    /// (the byte stream cannot be trusted any more).
    pub fn frame_error(&mut self, e: &FrameError) {
        let err = match e {
            FrameError::TooLarge { .. }
            | FrameError::BadFrameEnd { .. }
            | FrameError::UnknownType { .. } => {
                AmqpError::new(ReplyCode::FrameError, e).on_no_method()
            }
            // Properties that cannot be decoded (an unknown field type in the headers table):
            // RabbitMQ only notices on delivery (541); we refuse them on arrival.
            FrameError::BadHeader { .. } => AmqpError::new(ReplyCode::SyntaxError, e).on(60, 40),
            FrameError::UnknownMethod {
                class_id,
                method_id,
            } => AmqpError::new(ReplyCode::NotImplemented, e).on(*class_id, *method_id),
            // RabbitMQ reports undecodable arguments as a frame error naming the method.
            FrameError::BadMethod {
                class_id,
                method_id,
                ..
            } => AmqpError::new(ReplyCode::FrameError, e).on(*class_id, *method_id),
            FrameError::PrefetchSize(_) => AmqpError::new(ReplyCode::NotImplemented, e).on(60, 10),
            // Deeper than any client nests (see `nesting`): a syntax error, on the method or
            // (a content header) on basic.publish.
            FrameError::TooDeep {
                class_id,
                method_id,
            } => match (class_id, method_id) {
                (60, 0) => AmqpError::new(ReplyCode::SyntaxError, e).on(60, 40),
                _ => AmqpError::new(ReplyCode::SyntaxError, e).on(*class_id, *method_id),
            },
            FrameError::Io(_) => return,
        };
        if matches!(self.phase, Phase::Closing | Phase::Closed) {
            return;
        }
        let mut err = err;
        err.hard = true;
        self.outbox.connection_end(&err.close_method());
        self.phase = Phase::Closing;
    }

    /// 320 CONNECTION_FORCED (broker shutdown, a leader change, the API, a deleted user or
    /// vhost). Written behind what the outbox holds for a commit: on a healthy node that
    /// goes out first (a declare-ok, deliveries and confirms already promised). A node that
    /// stops leading drops what it holds before this (`cluster` demotion, `on_commit` of a
    /// deposed commit): nothing held there may reach the client.
    pub fn force_close(&mut self, reason: &str) {
        if self.phase == Phase::Closing {
            return;
        }
        let e = AmqpError::connection(ReplyCode::ConnectionForced, reason);
        self.outbox.connection_end(&e.close_method());
        self.phase = Phase::Closing;
    }

    /// A defect (a caught panic) ends the connection: connection.close 541 INTERNAL_ERROR.
    /// Replies held for a commit are dropped, not sent: nobody will release them now.
    pub fn internal_error(&mut self) {
        self.internal_error_with("INTERNAL_ERROR");
    }

    /// Like `internal_error`, with this reply text.
    pub fn internal_error_with(&mut self, text: &str) {
        // A close or close-ok already pushed is kept (or pushed again) by the abandon (a
        // client's close-ok held behind a declare whose commit failed went out with it);
        // a second connection.close would only confuse the client.
        self.outbox.abandon_held();
        if matches!(self.phase, Phase::Closing | Phase::Closed) {
            return;
        }
        let e = AmqpError::connection(ReplyCode::InternalError, text);
        self.outbox.connection_end(&e.close_method());
        self.phase = Phase::Closing;
    }

    /// Release the connection's broker state (channels requeue, exclusive queues go).
    pub fn teardown(&mut self) {
        if self.conn == 0 {
            return;
        }
        let conn = self.conn;
        self.conn = 0;
        self.outbox.conn_id.store(0, Ordering::Release);
        // The node removes the outbox while the broker lock is held: nothing can route to us
        // after.
        let _ = self.run_as(conn, Cmd::CloseConnection, None);
        self.channels.clear();
    }

    /// Drop a channel's broker-side state (consumers, unacked messages back to their queues).
    pub(crate) fn close_channel_state(&mut self, ch: u16) {
        let _ = self.run(Cmd::CloseChannel { ch });
        if let Some(chan) = self.channels.get_mut(&ch) {
            chan.content.reset();
            chan.tx = None;
        }
    }

    /// Send confirms for publishes settled since the last call: runs of successes as one
    /// `multiple` basic.ack, each failure as its own basic.nack. Never past a publish that still
    /// waits for the store.
    pub fn flush_confirms(&mut self) {
        use amq_protocol::protocol::basic;
        // After a connection.close nothing but close-ok may follow.
        if self.phase != Phase::Open {
            return;
        }
        for (ch, chan) in self.channels.iter_mut() {
            if !chan.confirm || chan.closing {
                continue;
            }
            let upto = chan
                .durable_pending
                .front()
                .map_or(chan.publish_seq, |first| first - 1);
            while chan.acked_upto < upto {
                let next_failed = chan
                    .failed
                    .range(chan.acked_upto + 1..=upto)
                    .next()
                    .copied();
                match next_failed {
                    Some(f) if f == chan.acked_upto + 1 => {
                        chan.failed.remove(&f);
                        // RabbitMQ sets the requeue bit on publisher nacks.
                        self.outbox.method(
                            *ch,
                            &AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
                                delivery_tag: f,
                                multiple: false,
                                requeue: true,
                            })),
                        );
                        chan.acked_upto = f;
                    }
                    other => {
                        let end = other.map_or(upto, |f| f - 1);
                        self.outbox.ack(*ch, end, end - chan.acked_upto > 1);
                        chan.acked_upto = end;
                    }
                }
            }
        }
    }

    /// The committer finished `done.ticket` (and everything this connection submitted before).
    pub fn on_commit(&mut self, done: Done) {
        if done.deposed {
            // Its changes since the last commit may or may not be committed by the cluster:
            // no reply, confirm or nack says either. 320, as for every client of a node
            // that stops leading (before, a held reply closed with 541 and publishes were
            // nacked, claiming they were not taken, first). What the outbox holds (replies
            // and deliveries waiting for commits) never goes out. A connection already
            // closing or closed sends nothing more.
            self.commit_waits.clear();
            // A close or close-ok already pushed behind held bytes is kept by the abandon.
            self.outbox.abandon_held();
            if matches!(self.phase, Phase::Closing | Phase::Closed) {
                return;
            }
            self.force_close("leader changed: this node no longer leads; what was not confirmed yet may or may not have been committed");
            return;
        }
        if !done.ok && self.outbox.is_held() {
            // A declaration the client was about to be told is durable is not: that reply is
            // never sent, and the connection closes with 541 (issue 12: it used to close with
            // no frame at all, which clients report as a lost socket).
            self.internal_error_with("INTERNAL_ERROR - the store failed to write a change");
        } else {
            self.outbox.release(done.ticket);
        }
        while let Some(w) = self.commit_waits.front() {
            if w.ticket > done.ticket {
                break;
            }
            let Some(w) = self.commit_waits.pop_front() else {
                break;
            };
            if let Some(chan) = self.channels.get_mut(&w.channel) {
                if chan.generation == w.generation {
                    // Commits come back in order, so this is nearly always the front one.
                    if chan.durable_pending.front() == Some(&w.seq) {
                        chan.durable_pending.pop_front();
                    } else if let Some(pos) = chan.durable_pending.iter().position(|s| *s == w.seq)
                    {
                        chan.durable_pending.remove(pos);
                    }
                    if !done.ok {
                        chan.failed.insert(w.seq);
                    }
                }
            }
        }
        self.flush_confirms();
    }

    pub(crate) fn chan(&mut self, ch: u16) -> Result<&mut Chan, AmqpError> {
        self.channels
            .get_mut(&ch)
            .ok_or_else(|| AmqpError::channel_error("expected 'channel.open'"))
    }

    /// A queue name from a method: empty means the channel's last declared queue.
    pub(crate) fn resolve_queue(&mut self, ch: u16, name: &str) -> Result<String, AmqpError> {
        if !name.is_empty() {
            return Ok(name.to_string());
        }
        self.chan(ch)?
            .last_queue
            .clone()
            .ok_or_else(|| AmqpError::not_found("no previously declared queue"))
    }

    fn content_header(
        &mut self,
        ch: u16,
        class_id: u16,
        body_size: u64,
        properties: AMQPProperties,
        raw_properties: Bytes,
    ) -> Result<(), AmqpError> {
        let max = self.shared.config.max_message_size;
        let Some(chan) = self.content_channel(ch)? else {
            return Ok(());
        };
        if body_size > max {
            chan.content.reset();
            // RabbitMQ's two texts: "configured" unless the limit is its ceiling.
            let configured = if max == crate::config::MAX_MESSAGE_SIZE_LIMIT {
                ""
            } else {
                "configured "
            };
            return Err(AmqpError::precondition_failed(format!(
                "message size {body_size} is larger than {configured}max size {max}"
            ))
            .on(60, 40));
        }
        if let Some(content) =
            chan.content
                .header(class_id, body_size, properties, raw_properties)?
        {
            self.publish_content(ch, content)?;
        }
        Ok(())
    }

    fn content_body(&mut self, ch: u16, data: Bytes) -> Result<(), AmqpError> {
        let limit = self.shared.config.max_message_size;
        let len = data.len() as u64;
        let Some(chan) = self.content_channel(ch)? else {
            return Ok(());
        };
        let before = chan.content.received();
        match chan.content.body(data)? {
            Some(content) => {
                self.unfinished = self.unfinished.saturating_sub(before);
                self.publish_content(ch, content)?;
            }
            None => {
                self.unfinished += len;
                if self.unfinished > limit {
                    self.check_unfinished(limit)?;
                }
            }
        }
        Ok(())
    }

    /// What a connection holds of unfinished message bodies is bounded by the largest message
    /// it may publish (`max_message_size`): without a bound, a client declaring 100 MiB bodies
    /// on each of 2,047 channels and sending part of each held up to 200 GiB. `unfinished`
    /// counts up on partial bodies and down on completed ones; contents dropped by a channel
    /// close are not subtracted, so past the limit the exact sum is taken before refusing.
    fn check_unfinished(&mut self, limit: u64) -> Result<(), AmqpError> {
        self.unfinished = self.channels.values().map(|c| c.content.received()).sum();
        if self.unfinished > limit {
            return Err(AmqpError::connection(
                ReplyCode::NotAllowed,
                format!(
                    "unfinished message bodies on this connection exceed {limit} bytes (max_message_size)"
                ),
            )
            .on_no_method());
        }
        Ok(())
    }

    /// The channel a content frame arrived on (None: a channel closed by us, waiting for the
    /// client's close-ok, where content is dropped as the spec says: a client that pipelines
    /// publishes has their frames in flight when the close arrives, and amqp091-go's suite
    /// relies on them being dropped). On a channel that is not open at all (never opened, or
    /// closed) RabbitMQ closes the connection with 505, naming no method.
    fn content_channel(&mut self, ch: u16) -> Result<Option<&mut Chan>, AmqpError> {
        match self.channels.get_mut(&ch) {
            Some(chan) if chan.closing => Ok(None),
            Some(chan) => Ok(Some(chan)),
            None => Err(AmqpError::new(
                ReplyCode::UnexpectedFrame,
                "expected method frame, got non method frame instead",
            )
            .on_no_method()),
        }
    }

    /// Client capabilities, from start-ok's client-properties.
    pub(crate) fn client_capability(props: &FieldTable, name: &str) -> bool {
        use amq_protocol::types::AMQPValue;
        match props.inner().get("capabilities") {
            Some(AMQPValue::FieldTable(caps)) => {
                matches!(caps.inner().get(name), Some(AMQPValue::Boolean(true)))
            }
            _ => false,
        }
    }
}

/// RabbitMQ's 505 for a frame it cannot place: "type T, all octets = <<...>>" (or "first 16
/// octets"), the payload written as Erlang prints a binary.
fn unexpected_frame(frame_type: u8, payload: &[u8]) -> AmqpError {
    let (what, shown) = if payload.len() <= 16 {
        ("all", payload)
    } else {
        ("first 16", &payload[..16])
    };
    AmqpError::new(
        ReplyCode::UnexpectedFrame,
        format!(
            "type {frame_type}, {what} octets = {}",
            erlang_binary(shown)
        ),
    )
    .on_no_method()
}

/// A binary as Erlang's `~p` prints it: `<<"text">>` when every byte is printable ASCII,
/// else `<<1,2,3>>`.
fn erlang_binary(bytes: &[u8]) -> String {
    if !bytes.is_empty() && bytes.iter().all(|b| (0x20..0x7f).contains(b)) {
        let mut s = String::from("<<\"");
        for &b in bytes {
            if b == b'"' || b == b'\\' {
                s.push('\\');
            }
            s.push(b as char);
        }
        s.push_str("\">>");
        s
    } else {
        let parts: Vec<String> = bytes.iter().map(|b| b.to_string()).collect();
        format!("<<{}>>", parts.join(","))
    }
}

/// The smallest frame_max a peer may negotiate, and the limit before it has (AMQP 0-9-1's
/// frame-min-size).
pub(crate) const FRAME_MIN_SIZE: u32 = 4096;

/// RabbitMQ removes CR and LF from the queue and exchange names of declare, delete and the
/// bindings (not of purge or consume); the declare-ok carries the stripped name.
pub(crate) fn strip_cr_lf(name: &str) -> std::borrow::Cow<'_, str> {
    if name.contains(['\r', '\n']) {
        name.replace(['\r', '\n'], "").into()
    } else {
        name.into()
    }
}

#[cfg(test)]
mod tests {
    use super::erlang_binary;

    #[test]
    fn binaries_print_as_erlang_prints_them() {
        assert_eq!(erlang_binary(b"hello"), "<<\"hello\">>");
        assert_eq!(erlang_binary(&[0, 60, 0, 0]), "<<0,60,0,0>>");
        assert_eq!(erlang_binary(b""), "<<>>");
        assert_eq!(erlang_binary(b"a\"b"), "<<\"a\\\"b\">>");
    }
}

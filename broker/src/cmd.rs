//! Commands: every change a client connection, the management API or a timer of the node asks
//! of the broker, as a value (issue 13 point 6). The node hands each to its one entry point
//! (`Shared::execute` in the server crate), which owns the lock, the clock, the journal flush,
//! held replies and effects, and calls [`Broker::execute`] here: the permission checks, the
//! change, and the reply the client gets, in one place.
//!
//! Replies are values too ([`Reply`]): the node writes them to the caller's connection under
//! the same lock, before the effects the command caused (so consume-ok precedes the deliveries
//! it starts, and a held declare-ok is registered where it is written).

use crate::permissions::{refusal, topic_refusal, Access, Permissions, Resource, TopicPermissions};
use crate::{
    Broker, ConnId, Effect, ExchangeDeclare, Message, QueueDeclare, ReadRequest, Targets, REPLY_TO,
};
use amq_protocol::protocol::{basic, channel, exchange, queue, tx, AMQPClass};
use amq_protocol::types::FieldTable;
use std::cell::RefCell;
use std::sync::Arc;
use warren_protocol::{AmqpError, ReplyCode};
use warren_storage::Op;

/// What the node read for a [`ReadRequest`] (outside the broker lock), handed back.
#[derive(Debug)]
pub struct ReadDone {
    pub request: ReadRequest,
    pub data: Result<crate::queue::ReadData, warren_storage::StoreError>,
}

/// A change asked of the broker. `ch` is the channel a client's command came on (and its reply
/// goes to); commands of the management API and the node use 0. `nowait`: no reply.
#[derive(Debug)]
pub enum Cmd {
    // ------------------------------------------------------------ connections and channels
    /// connection.open of `vhost` by the caller's user, under the vhost's, the user's and the
    /// node's (`connection_max`) connection limits.
    OpenConnection {
        vhost: String,
        connection_max: usize,
    },
    /// The connection is gone: its channels close, its exclusive queues go.
    CloseConnection,
    /// channel.open, under the user's channel limit.
    OpenChannel {
        ch: u16,
    },
    /// The channel's broker state goes (consumers cancelled, unacked messages requeued).
    CloseChannel {
        ch: u16,
    },
    /// channel.flow active=true.
    Flow {
        ch: u16,
        active: bool,
    },

    // ------------------------------------------------------------------------ basic
    Qos {
        ch: u16,
        prefetch_count: u16,
        global: bool,
    },
    Consume {
        ch: u16,
        queue: String,
        tag: String,
        no_ack: bool,
        exclusive: bool,
        arguments: FieldTable,
        nowait: bool,
    },
    Cancel {
        ch: u16,
        tag: String,
        nowait: bool,
    },
    /// basic.get. If the queue's head is paged out, the answer is [`Outcome::Read`]: the node
    /// reads it with the lock released and asks again with what it read in `read`, which the
    /// queue takes before the get, in the same critical section (consumers cannot take it
    /// first). Nothing is read under the broker lock (issue 13 point 5).
    Get {
        ch: u16,
        queue: String,
        no_ack: bool,
        read: Option<Box<ReadDone>>,
    },
    Ack {
        ch: u16,
        tag: u64,
        multiple: bool,
    },
    /// basic.reject (`multiple` false) and basic.nack.
    Reject {
        ch: u16,
        tag: u64,
        multiple: bool,
        requeue: bool,
    },
    /// An ack (`reject` None) or reject/nack inside a transaction: checked now, settled at
    /// commit.
    Settle {
        ch: u16,
        tag: u64,
        multiple: bool,
        reject: Option<bool>,
    },
    /// basic.recover (`reply`) and basic.recover-async, requeue=true.
    Recover {
        ch: u16,
        reply: bool,
    },
    /// The direct reply-to address of the channel (`amq.rabbitmq.reply-to.…`).
    ReplyAddress {
        ch: u16,
    },
    /// A publish inside a transaction: its permissions and exchange checked now, routed at
    /// commit.
    CheckPublish {
        msg: Arc<Message>,
    },
    /// Route and enqueue a message. `check`: the write permission is checked (a transaction's
    /// messages were checked when published). Unroutable and `mandatory`: basic.return.
    Publish {
        ch: u16,
        msg: Arc<Message>,
        mandatory: bool,
        check: bool,
    },
    TxCommit {
        ch: u16,
    },
    TxRollback {
        ch: u16,
    },

    // ------------------------------------------------------------ queues and exchanges
    /// queue.declare, or PUT /api/queues (answers [`Outcome::Existed`] to the API).
    DeclareQueue {
        ch: u16,
        decl: QueueDeclare,
        nowait: bool,
    },
    DeleteQueue {
        ch: u16,
        queue: String,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    },
    PurgeQueue {
        ch: u16,
        queue: String,
        nowait: bool,
    },
    /// queue.bind (`bind`) or queue.unbind.
    BindQueue {
        ch: u16,
        queue: String,
        exchange: String,
        key: String,
        arguments: FieldTable,
        bind: bool,
        nowait: bool,
    },
    DeclareExchange {
        ch: u16,
        decl: ExchangeDeclare,
        nowait: bool,
    },
    DeleteExchange {
        ch: u16,
        name: String,
        if_unused: bool,
        nowait: bool,
    },
    /// exchange.bind (`bind`) or exchange.unbind.
    BindExchange {
        ch: u16,
        destination: String,
        source: String,
        key: String,
        arguments: FieldTable,
        bind: bool,
        nowait: bool,
    },
    /// DELETE /api/bindings/…: the binding whose properties key (as the API names bindings,
    /// `BindingView::properties_key`) is `props`.
    Unbind {
        source: String,
        destination: String,
        to_queue: bool,
        props: String,
    },

    // -------------------------------------------------- users, vhosts, permissions, limits
    /// PUT /api/users/{name}: answers whether the user existed.
    PutUser {
        name: String,
        /// RabbitMQ's `password_hash` (see `Op::PutUser`).
        password_hash: String,
        tags: Vec<String>,
    },
    /// DELETE /api/users/{name}: not the last user.
    DeleteUser {
        name: String,
    },
    /// PUT /api/vhosts/{name}; a vhost it creates gives the caller full permissions on it, as
    /// RabbitMQ's API does. Answers whether the vhost existed.
    PutVhost {
        name: String,
        description: String,
        tags: Vec<String>,
    },
    /// DELETE /api/vhosts/{name}: not the last vhost.
    DeleteVhost {
        name: String,
    },
    /// PUT /api/permissions/{vhost}/{user}: answers whether the user had permissions there.
    SetPermissions {
        user: String,
        vhost: String,
        configure: String,
        write: String,
        read: String,
    },
    /// PUT /api/topic-permissions/{vhost}/{user}: answers whether the user had topic
    /// permissions in the vhost.
    SetTopicPermissions {
        user: String,
        vhost: String,
        exchange: String,
        write: String,
        read: String,
    },
    /// DELETE /api/permissions/{vhost}/{user}, of permissions that exist.
    ClearPermissions {
        user: String,
        vhost: String,
    },
    /// DELETE /api/topic-permissions/{vhost}/{user}: on one exchange, or on all (""), of topic
    /// permissions that exist.
    ClearTopicPermissions {
        user: String,
        vhost: String,
        exchange: String,
    },
    /// Set (`Some`) or remove (`None`) one limit of a vhost.
    VhostLimit {
        vhost: String,
        name: String,
        value: Option<i64>,
    },
    /// Set (`Some`) or remove (`None`) one limit of a user.
    UserLimit {
        user: String,
        name: String,
        value: Option<i64>,
    },
    /// A definitions import, parsed: its steps in order (see [`ImportStep`]).
    Import(Vec<ImportStep>),

    // ------------------------------------------------------------------------ the node's
    /// The node's ticker: expiry and the consumer timeout (`lead`: only the leader's timers
    /// make replicated changes), retired writes, reads asked again.
    Tick {
        lead: bool,
        ack_timeout_ms: Option<u64>,
    },
    /// The connection's writer emptied its outbox: deliveries up to `budget` bytes.
    Refill {
        budget: usize,
    },
    /// Whether a publisher of the connection waits on `queues` (their consumers are behind).
    Holding {
        queues: Targets,
    },
}

impl Cmd {
    /// Whether the command's reply must not reach the client before the change it made is on
    /// disk (and, on a cluster, committed): durable declarations, bindings, deletions, purges
    /// and tx.commit-ok. The node holds it in the outbox until then.
    pub fn holds_reply(&self) -> bool {
        matches!(
            self,
            Cmd::DeclareQueue { .. }
                | Cmd::DeleteQueue { .. }
                | Cmd::PurgeQueue { .. }
                | Cmd::BindQueue { .. }
                | Cmd::DeclareExchange { .. }
                | Cmd::DeleteExchange { .. }
                | Cmd::BindExchange { .. }
                | Cmd::TxCommit { .. }
        )
    }
}

/// One step of a definitions import ([`Cmd::Import`]), each stopping the import when refused
/// (with `what` in the reason) but where said.
#[derive(Debug)]
pub enum ImportStep {
    /// A user, vhost, permission or limit.
    Op { op: Op, what: String },
    /// An exchange; one not equivalent to the one there is left as it is (logged).
    Exchange {
        vhost: String,
        decl: ExchangeDeclare,
    },
    /// A queue; one not equivalent to the one there is left as it is (logged).
    Queue { vhost: String, decl: QueueDeclare },
    /// A binding; one whose end is missing is left out (logged).
    Binding {
        vhost: String,
        source: String,
        destination: String,
        to_queue: bool,
        key: String,
        arguments: FieldTable,
    },
}

/// What a command gave back to its caller, beside its reply.
#[derive(Debug)]
pub enum Outcome {
    Done,
    /// A PUT of the API: whether the thing was there before (204) or made (201).
    Existed(bool),
    /// connection.open: the connection's id.
    Opened(ConnId),
    /// queue.declare: the queue's name (a server-named one's too).
    Declared(String),
    /// A publish: whether a queue refused it, whether a queue staged it, and the queues whose
    /// consumers are behind (see `PublishOutcome`).
    Published {
        rejected: bool,
        staged: bool,
        held: Targets,
    },
    /// basic.get with `read_first`: read this, then ask again.
    Read(ReadRequest),
    /// The direct reply-to address.
    Address(String),
    /// [`Cmd::Holding`]'s answer.
    Holding(bool),
}

impl Outcome {
    /// [`Outcome::Existed`]'s flag (false for any other).
    pub fn existed(&self) -> bool {
        matches!(self, Outcome::Existed(true))
    }

    /// The answer of the command `cmd` that was not the kind it gives: a defect of the core,
    /// logged with what it was, which closes the connection with 541 INTERNAL_ERROR rather
    /// than carry on with a value made up in its place.
    fn unexpected(self, cmd: &str) -> AmqpError {
        tracing::error!(command = cmd, answer = ?self, "the core answered with the wrong kind");
        AmqpError::connection(ReplyCode::InternalError, "internal error")
    }

    /// [`Cmd::OpenConnection`]'s answer: the connection's id.
    pub fn into_opened(self) -> Result<ConnId, AmqpError> {
        match self {
            Outcome::Opened(conn) => Ok(conn),
            other => Err(other.unexpected("connection.open")),
        }
    }

    /// [`Cmd::ReplyAddress`]'s answer: the channel's direct reply-to address.
    pub fn into_address(self) -> Result<String, AmqpError> {
        match self {
            Outcome::Address(a) => Ok(a),
            other => Err(other.unexpected("the reply address")),
        }
    }

    /// [`Cmd::Publish`]'s answer: (rejected, staged, held).
    pub fn into_published(self) -> Result<(bool, bool, Targets), AmqpError> {
        match self {
            Outcome::Published {
                rejected,
                staged,
                held,
            } => Ok((rejected, staged, held)),
            other => Err(other.unexpected("basic.publish")),
        }
    }
}

/// A method for the caller's connection, written before the effects of its command.
#[derive(Debug)]
pub struct Reply {
    pub channel: u16,
    pub method: AMQPClass,
    /// The content that follows the method (get-ok, return).
    pub content: Option<Arc<Message>>,
    /// The journal batch a get-ok's message was replicated by (`QueuedMessage::batch`): a
    /// cluster's leader holds the reply back until that batch is committed.
    pub batch: Option<u64>,
}

impl Reply {
    fn method(channel: u16, method: AMQPClass) -> Option<Reply> {
        Some(Reply {
            channel,
            method,
            content: None,
            batch: None,
        })
    }

    /// None for `nowait`.
    fn unless(nowait: bool, channel: u16, method: AMQPClass) -> Option<Reply> {
        if nowait {
            None
        } else {
            Reply::method(channel, method)
        }
    }
}

/// Who asks for a command: whose permissions it is checked against, and in which vhost.
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    pub via: Via,
    /// The client connection (0 for the API and the node).
    pub conn: ConnId,
    pub user: &'a str,
    pub vhost: &'a str,
    /// The user's permissions as last looked up (a connection keeps its own).
    pub grant: &'a Grant,
}

/// Where a command comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// A client connection: AMQP's checks and replies.
    Client,
    /// The management API, for a logged-in user: the API's checks (404 for what is not
    /// there), no topic permission checks (RabbitMQ's API makes none), no replies.
    Api,
    /// The node itself (timers, --load-definitions): no permission checks.
    Node,
}

impl<'a> Who<'a> {
    /// The node itself.
    pub fn node(grant: &'a Grant) -> Self {
        Who {
            via: Via::Node,
            conn: 0,
            user: "",
            vhost: "",
            grant,
        }
    }

    /// The management API acting for `user` in `vhost` ("" when none is concerned).
    pub fn api(user: &'a str, vhost: &'a str, grant: &'a Grant) -> Self {
        Who {
            via: Via::Api,
            conn: 0,
            user,
            vhost,
            grant,
        }
    }

    /// Whether `access` to `name` is allowed, else the 403 to answer.
    fn check(
        &self,
        b: &Broker,
        access: Access,
        resource: Resource,
        name: &str,
    ) -> Result<(), AmqpError> {
        if self.via == Via::Node {
            return Ok(());
        }
        self.grant
            .check(b, self.user, self.vhost, access, resource, name)
    }

    /// The topic permission check of a client's publish or binding (the API makes none).
    fn check_topic(
        &self,
        b: &Broker,
        access: Access,
        exchange: &str,
        key: &str,
    ) -> Result<(), AmqpError> {
        if self.via != Via::Client {
            return Ok(());
        }
        self.grant
            .check_topic(b, self.user, self.vhost, access, exchange, key)
    }
}

/// The name permissions see for an exchange: the default exchange ("") is `amq.default`, as
/// in RabbitMQ.
pub fn exchange_or_default(name: &str) -> &str {
    if name.is_empty() {
        "amq.default"
    } else {
        name
    }
}

/// A user's copy of their permissions in a vhost, looked up again whenever the broker's
/// permissions changed (so a change applies to open connections at their next method; RabbitMQ
/// caches checks per channel). Checked inside the command that makes the change, so the check
/// and the change see the same state.
#[derive(Debug, Default)]
pub struct Grant(RefCell<Option<Granted>>);

/// What `Grant` keeps: the broker's permissions generation it was read at, the permissions,
/// and the topic permissions by exchange.
type Granted = (
    u64,
    Option<Arc<Permissions>>,
    Vec<(String, Arc<TopicPermissions>)>,
);

impl Grant {
    /// The cached grant, read again from `b` when the permissions changed.
    fn current(
        &self,
        b: &Broker,
        user: &str,
        vhost: &str,
    ) -> std::cell::RefMut<'_, Option<Granted>> {
        let generation = b.permissions_generation();
        let mut cached = self.0.borrow_mut();
        if !matches!(&*cached, Some((g, _, _)) if *g == generation) {
            *cached = Some((
                generation,
                b.permissions(user, vhost),
                b.topic_permissions(user, vhost),
            ));
        }
        cached
    }

    /// The topic permission check of a publish (write) or a binding (read) with `key` on the
    /// topic exchange `exchange`: allowed when the user has none for it (RabbitMQ).
    pub fn check_topic(
        &self,
        b: &Broker,
        user: &str,
        vhost: &str,
        access: Access,
        exchange: &str,
        key: &str,
    ) -> Result<(), AmqpError> {
        let cached = self.current(b, user, vhost);
        let Some((_, _, topics)) = &*cached else {
            return Ok(());
        };
        let Some((_, t)) = topics.iter().find(|(x, _)| x == exchange) else {
            return Ok(());
        };
        if t.allows(access, key) || !b.is_topic_exchange(vhost, exchange) {
            return Ok(());
        }
        Err(AmqpError::access_refused(topic_refusal(
            key, exchange, vhost, user,
        )))
    }

    /// Whether `user` may have `access` to the queue or exchange `name` in `vhost`, by
    /// RabbitMQ's access-control table; else its 403 ACCESS_REFUSED (a channel error). The
    /// default exchange is named `amq.default`.
    pub fn check(
        &self,
        b: &Broker,
        user: &str,
        vhost: &str,
        access: Access,
        resource: Resource,
        name: &str,
    ) -> Result<(), AmqpError> {
        let name = match resource {
            Resource::Exchange => exchange_or_default(name),
            _ => name,
        };
        let perms = self
            .current(b, user, vhost)
            .as_ref()
            .and_then(|(_, p, _)| p.clone());
        if perms.is_some_and(|p| p.allows(access, name)) {
            return Ok(());
        }
        Err(AmqpError::access_refused(refusal(
            resource, name, vhost, user,
        )))
    }
}

fn not_found() -> AmqpError {
    AmqpError::connection(ReplyCode::NotFound, "Not Found")
}

fn refused(text: impl Into<String>) -> AmqpError {
    AmqpError::connection(ReplyCode::PreconditionFailed, text.into())
}

/// The limits after setting (`Some`) or removing (`None`) `name`.
fn with_limit(
    current: Vec<(String, Vec<(String, i64)>)>,
    of: &str,
    name: &str,
    value: Option<i64>,
) -> Vec<(String, i64)> {
    let current = current
        .into_iter()
        .find(|(n, _)| n == of)
        .map(|(_, l)| l)
        .unwrap_or_default();
    let mut out: Vec<(String, i64)> = current.into_iter().filter(|(k, _)| k != name).collect();
    if let Some(v) = value {
        out.push((name.to_string(), v));
        out.sort();
    }
    out
}

impl Broker {
    /// Carry out `cmd` for `who`: its permission checks, the change (effects in `fx`), and the
    /// reply for the caller's connection. The caller holds the broker lock and owns the
    /// journal flush (`Shared::execute`). Then what the command left to settle (messages
    /// dropped to dead-letter) is settled, and the reads queues found they need are asked
    /// of the node.
    pub fn execute(
        &mut self,
        who: &Who,
        cmd: Cmd,
        fx: &mut Vec<Effect>,
    ) -> Result<(Outcome, Option<Reply>), AmqpError> {
        let result = self.run_cmd(who, cmd, fx);
        self.settle(fx);
        self.ask_wanted(fx);
        result
    }

    fn run_cmd(
        &mut self,
        who: &Who,
        cmd: Cmd,
        fx: &mut Vec<Effect>,
    ) -> Result<(Outcome, Option<Reply>), AmqpError> {
        let conn = who.conn;
        let api = who.via == Via::Api;
        let done = |reply: Option<Reply>| Ok((Outcome::Done, reply));
        match cmd {
            Cmd::OpenConnection {
                vhost,
                connection_max,
            } => {
                let user = who.user;
                let refuse = |text: String| Err(AmqpError::connection(ReplyCode::NotAllowed, text));
                if !self.has_vhost(&vhost) {
                    return refuse(format!("vhost {vhost} not found"));
                }
                if self.permissions(user, &vhost).is_none() {
                    return refuse(format!(
                        "access to vhost '{vhost}' refused for user '{user}'"
                    ));
                }
                // Limits, the vhost's first (RabbitMQ's order and texts).
                if let Some(max) = self.vhost_limit(&vhost, "max-connections") {
                    if self.connections_in(&vhost) as u64 >= max {
                        return refuse(format!(
                            "access to vhost '{vhost}' refused for user '{user}': connection limit ({max}) is reached"
                        ));
                    }
                }
                if let Some(max) = self.user_limit(user, "max-connections") {
                    if self.usage_of(user).0 as u64 >= max {
                        return refuse(format!(
                            "connection refused for user '{user}': user connection limit ({max}) is reached"
                        ));
                    }
                }
                // RabbitMQ's connection_max, checked where RabbitMQ checks it.
                if self.connection_totals().0 >= connection_max {
                    return refuse(format!(
                        "connection refused: node connection limit ({connection_max}) is reached"
                    ));
                }
                let conn = self.connection_open_for(&vhost, user);
                Ok((Outcome::Opened(conn), None))
            }
            Cmd::CloseConnection => {
                self.connection_close(conn, fx);
                done(None)
            }
            Cmd::OpenChannel { ch } => {
                // The user's max-channels counts their channels on every connection; past it
                // the whole connection closes (RabbitMQ: 530, no method).
                let user = who.user;
                if let Some(max) = self.user_limit(user, "max-channels") {
                    if self.usage_of(user).1 as u64 >= max {
                        return Err(AmqpError::not_allowed(format!(
                            "number of channels opened for user '{user}' has reached the maximum allowed user limit of ({max})"
                        ))
                        .on_no_method());
                    }
                }
                self.channel_open(conn, ch);
                done(Reply::method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
                ))
            }
            Cmd::CloseChannel { ch } => {
                self.channel_close(conn, ch, fx);
                done(None)
            }
            Cmd::Flow { ch, active } => {
                self.flow(conn, ch, active, fx);
                done(Reply::method(
                    ch,
                    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active })),
                ))
            }
            Cmd::Qos {
                ch,
                prefetch_count,
                global,
            } => {
                self.qos(conn, ch, prefetch_count, global, fx);
                done(Reply::method(
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
                ))
            }
            Cmd::Consume {
                ch,
                queue,
                tag,
                no_ack,
                exclusive,
                arguments,
                nowait,
            } => {
                // Direct reply-to is no queue of the vhost: RabbitMQ checks nothing there.
                if queue != REPLY_TO {
                    who.check(self, Access::Read, Resource::Queue, &queue)?;
                }
                // Deliveries the subscription causes land in `fx` and go out after consume-ok.
                let tag = self.consume(
                    conn, ch, who.vhost, &queue, &tag, no_ack, exclusive, &arguments, fx,
                )?;
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                        consumer_tag: warren_protocol::short(&tag),
                    })),
                ))
            }
            Cmd::Cancel { ch, tag, nowait } => {
                self.cancel(conn, ch, &tag, fx);
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                        consumer_tag: warren_protocol::short(&tag),
                    })),
                ))
            }
            Cmd::Get {
                ch,
                queue,
                no_ack,
                read,
            } => {
                who.check(self, Access::Read, Resource::Queue, &queue)?;
                // A read that failed is not asked for again here (the error is logged, the
                // timer retries it): the get answers with what is in memory, get-empty if
                // nothing, as before reads moved out of the lock.
                let failed = read.as_ref().is_some_and(|done| done.data.is_err());
                let took = read.and_then(|done| {
                    let id = done.request.queue;
                    self.take_head_read(&done.request, done.data).then_some(id)
                });
                if !failed {
                    if let Some(read) = self.head_read_request(conn, who.vhost, &queue) {
                        return Ok((Outcome::Read(read), None));
                    }
                }
                let reply = match self.get(conn, ch, who.vhost, &queue, no_ack)? {
                    Some(r) => Reply {
                        channel: ch,
                        method: AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
                            delivery_tag: r.delivery_tag,
                            redelivered: r.redelivered,
                            exchange: warren_protocol::short(&r.msg.exchange),
                            routing_key: warren_protocol::short(&r.msg.routing_key),
                            message_count: r.message_count,
                        })),
                        content: Some(r.msg),
                        batch: Some(r.batch),
                    },
                    None => Reply {
                        channel: ch,
                        method: AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
                        content: None,
                        batch: None,
                    },
                };
                if let Some(id) = took {
                    // What the read brought in past the got message goes to consumers.
                    self.dispatch(id, fx);
                }
                done(Some(reply))
            }
            Cmd::Ack { ch, tag, multiple } => {
                self.ack(conn, ch, tag, multiple, fx)?;
                done(None)
            }
            Cmd::Reject {
                ch,
                tag,
                multiple,
                requeue,
            } => {
                self.reject(conn, ch, tag, multiple, requeue, fx)?;
                done(None)
            }
            Cmd::Settle {
                ch,
                tag,
                multiple,
                reject,
            } => {
                self.tx_settle(conn, ch, tag, multiple, reject)?;
                done(None)
            }
            Cmd::Recover { ch, reply } => {
                self.recover(conn, ch, fx)?;
                done(Reply::unless(
                    !reply,
                    ch,
                    AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
                ))
            }
            Cmd::ReplyAddress { ch } => {
                let address = self.reply_address(conn, ch)?;
                Ok((Outcome::Address(address), None))
            }
            Cmd::CheckPublish { msg } => {
                // Errors about the exchange come now, as in RabbitMQ; routing happens at
                // commit.
                who.check(self, Access::Write, Resource::Exchange, &msg.exchange)?;
                who.check_topic(self, Access::Write, &msg.exchange, &msg.routing_key)?;
                self.route(who.vhost, msg.exchange.as_ref(), &msg)?;
                done(None)
            }
            Cmd::Publish {
                ch,
                msg,
                mandatory,
                check,
            } => {
                if check {
                    who.check(self, Access::Write, Resource::Exchange, &msg.exchange)?;
                    who.check_topic(self, Access::Write, &msg.exchange, &msg.routing_key)?;
                }
                let outcome = self.publish(who.vhost, msg.clone(), fx)?;
                let reply = (outcome.routed == 0 && mandatory).then(|| Reply {
                    channel: ch,
                    method: AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
                        reply_code: ReplyCode::NoRoute.code(),
                        reply_text: "NO_ROUTE".into(),
                        exchange: warren_protocol::short(&msg.exchange),
                        routing_key: warren_protocol::short(&msg.routing_key),
                    })),
                    content: Some(msg),
                    batch: None,
                });
                Ok((
                    Outcome::Published {
                        rejected: outcome.rejected,
                        staged: outcome.staged,
                        held: outcome.held,
                    },
                    reply,
                ))
            }
            Cmd::TxCommit { ch } => {
                self.tx_commit(conn, ch, fx)?;
                done(Reply::method(
                    ch,
                    AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
                ))
            }
            Cmd::TxRollback { ch } => {
                self.tx_rollback(conn, ch)?;
                done(Reply::method(
                    ch,
                    AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
                ))
            }
            Cmd::DeclareQueue { ch, decl, nowait } => {
                if api && !self.has_vhost(who.vhost) {
                    return Err(AmqpError::connection(ReplyCode::NotFound, "no such vhost"));
                }
                let exists = if decl.passive {
                    true
                } else {
                    // RabbitMQ checks the name a server-named queue gets, and for a
                    // dead-letter exchange, reading the queue and writing to the exchange.
                    let name = if decl.name.is_empty() {
                        self.server_queue_name()
                    } else {
                        decl.name.clone()
                    };
                    let exists = self.queue_info(who.vhost, &name).is_some();
                    who.check(self, Access::Configure, Resource::Queue, &name)?;
                    // Checked when the queue is made (a redeclare changes nothing).
                    if !exists {
                        if let Some(dlx) =
                            crate::args::string(&decl.arguments, "x-dead-letter-exchange")
                        {
                            who.check(self, Access::Read, Resource::Queue, &name)?;
                            who.check(self, Access::Write, Resource::Exchange, &dlx)?;
                        }
                    }
                    exists
                };
                let info = self.queue_declare(conn, who.vhost, decl, fx)?;
                if api {
                    return Ok((Outcome::Existed(exists), None));
                }
                let reply = Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                        queue: warren_protocol::short(&info.name),
                        message_count: info.message_count,
                        consumer_count: info.consumer_count,
                    })),
                );
                Ok((Outcome::Declared(info.name), reply))
            }
            Cmd::DeleteQueue {
                ch,
                queue,
                if_unused,
                if_empty,
                nowait,
            } => {
                if api && self.queue_info(who.vhost, &queue).is_none() {
                    return Err(not_found());
                }
                who.check(self, Access::Configure, Resource::Queue, &queue)?;
                let count = self.queue_delete(conn, who.vhost, &queue, if_unused, if_empty, fx)?;
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                        message_count: count,
                    })),
                ))
            }
            Cmd::PurgeQueue { ch, queue, nowait } => {
                if api && self.queue_info(who.vhost, &queue).is_none() {
                    return Err(not_found());
                }
                who.check(self, Access::Read, Resource::Queue, &queue)?;
                let count = self.queue_purge(conn, who.vhost, &queue, fx)?;
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                        message_count: count,
                    })),
                ))
            }
            Cmd::BindQueue {
                ch,
                queue,
                exchange,
                key,
                arguments,
                bind,
                nowait,
            } => {
                // Writing to the queue, then reading the exchange (RabbitMQ's order).
                who.check(self, Access::Write, Resource::Queue, &queue)?;
                who.check(self, Access::Read, Resource::Exchange, &exchange)?;
                who.check_topic(self, Access::Read, &exchange, &key)?;
                self.queue_bind(
                    conn, who.vhost, &queue, &exchange, &key, &arguments, bind, fx,
                )?;
                let ok = if bind {
                    queue::AMQPMethod::BindOk(queue::BindOk {})
                } else {
                    queue::AMQPMethod::UnbindOk(queue::UnbindOk {})
                };
                done(Reply::unless(nowait, ch, AMQPClass::Queue(ok)))
            }
            Cmd::DeclareExchange { ch, decl, nowait } => {
                if api && !self.has_vhost(who.vhost) {
                    return Err(AmqpError::connection(ReplyCode::NotFound, "no such vhost"));
                }
                let existed = self.exchange_exists(who.vhost, &decl.name);
                if !decl.passive && !decl.name.is_empty() {
                    who.check(self, Access::Configure, Resource::Exchange, &decl.name)?;
                    // An alternate exchange: reading the new one, writing to the alternate
                    // (RabbitMQ), so nobody routes into an exchange they may not write to.
                    if let Some(ae) = crate::args::string(&decl.arguments, "alternate-exchange") {
                        who.check(self, Access::Read, Resource::Exchange, &decl.name)?;
                        who.check(self, Access::Write, Resource::Exchange, &ae)?;
                    }
                }
                self.exchange_declare(who.vhost, decl, fx)?;
                if api {
                    return Ok((Outcome::Existed(existed), None));
                }
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {})),
                ))
            }
            Cmd::DeleteExchange {
                ch,
                name,
                if_unused,
                nowait,
            } => {
                if api && !self.exchange_exists(who.vhost, &name) {
                    return Err(not_found());
                }
                // The default exchange is refused by the core first (RabbitMQ's order).
                if !name.is_empty() {
                    who.check(self, Access::Configure, Resource::Exchange, &name)?;
                }
                match self.exchange_delete(who.vhost, &name, if_unused, fx) {
                    Ok(()) => {}
                    // RabbitMQ answers delete-ok for an exchange that does not exist.
                    Err(e) if e.code == ReplyCode::NotFound && !api => {}
                    Err(e) => return Err(e),
                }
                done(Reply::unless(
                    nowait,
                    ch,
                    AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {})),
                ))
            }
            Cmd::BindExchange {
                ch,
                destination,
                source,
                key,
                arguments,
                bind,
                nowait,
            } => {
                // Writing to the destination, then reading the source (RabbitMQ's order).
                who.check(self, Access::Write, Resource::Exchange, &destination)?;
                who.check(self, Access::Read, Resource::Exchange, &source)?;
                who.check_topic(self, Access::Read, &source, &key)?;
                self.exchange_bind(who.vhost, &destination, &source, &key, &arguments, bind, fx)?;
                let ok = if bind {
                    exchange::AMQPMethod::BindOk(exchange::BindOk {})
                } else {
                    exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {})
                };
                done(Reply::unless(nowait, ch, AMQPClass::Exchange(ok)))
            }
            Cmd::Unbind {
                source,
                destination,
                to_queue,
                props,
            } => {
                let found = self
                    .binding_views(Some(who.vhost))
                    .into_iter()
                    .find(|v| {
                        !v.source.is_empty()
                            && v.source == source
                            && v.destination == destination
                            && v.destination_is_queue == to_queue
                            && v.properties_key() == props
                    })
                    .ok_or_else(not_found)?;
                let resource = if to_queue {
                    Resource::Queue
                } else {
                    Resource::Exchange
                };
                who.check(self, Access::Write, resource, &destination)?;
                who.check(self, Access::Read, Resource::Exchange, &source)?;
                let (key, args) = (&found.routing_key, &found.arguments);
                if to_queue {
                    self.queue_bind(0, who.vhost, &destination, &source, key, args, false, fx)?;
                } else {
                    self.exchange_bind(who.vhost, &destination, &source, key, args, false, fx)?;
                }
                done(None)
            }
            Cmd::PutUser {
                name,
                password_hash,
                tags,
            } => {
                let existed = self.user(&name).is_some();
                let op = Op::PutUser {
                    name,
                    password_hash,
                    tags,
                };
                self.apply(&op, fx)?;
                Ok((Outcome::Existed(existed), None))
            }
            Cmd::DeleteUser { name } => {
                if self.user(&name).is_none() {
                    return Err(not_found());
                }
                // With no user left, the next start (or the next leader) would create the
                // default user (guest/guest) again, as on an empty data folder: the last one
                // stays.
                if self.users().len() == 1 {
                    return Err(refused("the last user cannot be deleted"));
                }
                self.apply(&Op::DeleteUser { name }, fx)?;
                done(None)
            }
            Cmd::PutVhost {
                name,
                description,
                tags,
            } => {
                let existed = self.has_vhost(&name);
                let op = Op::PutVhost {
                    name: name.clone(),
                    description,
                    tags,
                };
                self.apply(&op, fx)?;
                if !existed {
                    // RabbitMQ's API gives whoever creates a vhost full permissions on it.
                    self.apply(&full_permissions(who.user, &name), fx)?;
                }
                Ok((Outcome::Existed(existed), None))
            }
            Cmd::DeleteVhost { name } => {
                if !self.has_vhost(&name) {
                    return Err(not_found());
                }
                // With no vhost left, the next start (or the next leader) would make "/"
                // again, as on an empty data folder: the last one stays.
                if self.vhost_names().len() == 1 {
                    return Err(refused("the last vhost cannot be deleted"));
                }
                self.apply(&Op::DeleteVhost { name }, fx)?;
                done(None)
            }
            Cmd::SetPermissions {
                user,
                vhost,
                configure,
                write,
                read,
            } => {
                // A missing user or vhost is refused by the apply (400).
                let had = self.permissions(&user, &vhost).is_some();
                let op = Op::SetPermissions {
                    user,
                    vhost,
                    configure,
                    write,
                    read,
                };
                self.apply(&op, fx)?;
                Ok((Outcome::Existed(had), None))
            }
            Cmd::SetTopicPermissions {
                user,
                vhost,
                exchange,
                write,
                read,
            } => {
                // A missing user or vhost is refused by the apply (400).
                let had = !self.topic_permissions(&user, &vhost).is_empty();
                let op = Op::SetTopicPermissions {
                    user,
                    vhost,
                    exchange,
                    write,
                    read,
                };
                self.apply(&op, fx)?;
                Ok((Outcome::Existed(had), None))
            }
            Cmd::ClearPermissions { user, vhost } => {
                if self.permissions(&user, &vhost).is_none() {
                    return Err(not_found());
                }
                self.apply(&Op::ClearPermissions { user, vhost }, fx)?;
                done(None)
            }
            Cmd::ClearTopicPermissions {
                user,
                vhost,
                exchange,
            } => {
                // 404 unless there is one to clear: on that exchange, or any ("": all).
                let there = self.topic_permissions(&user, &vhost);
                if !there
                    .iter()
                    .any(|(x, _)| exchange.is_empty() || *x == exchange)
                {
                    return Err(not_found());
                }
                let op = Op::ClearTopicPermissions {
                    user,
                    vhost,
                    exchange,
                };
                self.apply(&op, fx)?;
                done(None)
            }
            Cmd::VhostLimit { vhost, name, value } => {
                if !self.has_vhost(&vhost) {
                    return Err(AmqpError::connection(
                        ReplyCode::NotFound,
                        "vhost_not_found",
                    ));
                }
                let limits = with_limit(self.vhost_limits(), &vhost, &name, value);
                self.apply(&Op::PutVhostLimits { vhost, limits }, fx)?;
                done(None)
            }
            Cmd::UserLimit { user, name, value } => {
                if self.user(&user).is_none() {
                    return Err(refused("no_such_user"));
                }
                let limits = with_limit(self.user_limits(), &user, &name, value);
                self.apply(&Op::PutUserLimits { user, limits }, fx)?;
                done(None)
            }
            Cmd::Import(steps) => {
                self.import(steps, fx)?;
                done(None)
            }
            Cmd::Tick {
                lead,
                ack_timeout_ms,
            } => {
                if lead {
                    self.expire(fx);
                }
                self.release_written();
                self.retry_reads(fx);
                if let (Some(t), true) = (ack_timeout_ms, lead) {
                    self.enforce_ack_timeout(t, fx);
                }
                done(None)
            }
            Cmd::Refill { budget } => {
                self.refill(conn, budget, fx);
                done(None)
            }
            Cmd::Holding { queues } => Ok((Outcome::Holding(self.holding(conn, &queues)), None)),
        }
    }

    /// A definitions import's steps, in order (see `Cmd::Import`). The reason of a refusal
    /// names the step.
    fn import(&mut self, steps: Vec<ImportStep>, fx: &mut Vec<Effect>) -> Result<(), AmqpError> {
        let because = |what: &str, e: AmqpError| refused(format!("{what}: {}", e.text));
        for step in steps {
            match step {
                ImportStep::Op { op, what } => {
                    self.apply(&op, fx).map_err(|e| because(&what, e))?;
                }
                ImportStep::Exchange { vhost, decl } => {
                    let name = decl.name.clone();
                    match self.exchange_declare(&vhost, decl, fx) {
                        Err(e) if e.code == ReplyCode::PreconditionFailed => {
                            tracing::warn!(exchange = %name, vhost = %vhost, reason = %e.text, "definitions: an exchange not equivalent to the one there is left as it is");
                        }
                        r => {
                            r.map_err(|e| because(&format!("exchange {name} in vhost {vhost}"), e))?
                        }
                    }
                }
                ImportStep::Queue { vhost, decl } => {
                    let name = decl.name.clone();
                    match self.queue_declare(0, &vhost, decl, fx) {
                        Err(e) if e.code == ReplyCode::PreconditionFailed => {
                            tracing::warn!(queue = %name, vhost = %vhost, reason = %e.text, "definitions: a queue not equivalent to the one there is left as it is");
                        }
                        r => {
                            r.map_err(|e| because(&format!("queue {name} in vhost {vhost}"), e))?;
                        }
                    }
                }
                ImportStep::Binding {
                    vhost,
                    source,
                    destination,
                    to_queue,
                    key,
                    arguments,
                } => {
                    let what = format!("binding of {source} to {destination} in vhost {vhost}");
                    let bound = if to_queue {
                        self.queue_bind(
                            0,
                            &vhost,
                            &destination,
                            &source,
                            &key,
                            &arguments,
                            true,
                            fx,
                        )
                    } else {
                        self.exchange_bind(
                            &vhost,
                            &destination,
                            &source,
                            &key,
                            &arguments,
                            true,
                            fx,
                        )
                    };
                    match bound {
                        Err(e) if e.code == ReplyCode::NotFound => {
                            tracing::warn!(reason = %e.text, "definitions: {what} left out");
                        }
                        r => r.map_err(|e| because(&what, e))?,
                    }
                }
            }
        }
        Ok(())
    }
}

/// Full permissions for `user` on `vhost` (what creating a vhost gives its creator).
fn full_permissions(user: &str, vhost: &str) -> Op {
    Op::SetPermissions {
        user: user.to_string(),
        vhost: vhost.to_string(),
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    }
}

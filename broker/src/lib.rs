//! The broker core: vhosts, exchanges, queues, bindings, consumers and prefetch.
//!
//! No tokio, no sockets, no files, no async. Every method takes `&mut self`, changes state and
//! appends what the outside world must see to an effects vector (deliveries, cancel
//! notifications). The server holds the one `Broker` behind a mutex; see `server.rs` for the lock
//! order. Plain unit tests at the bottom drive it without any I/O.
//!
//! Durable state changes (declarations, bindings, messages) go through [`Broker::apply`] with a
//! typed [`Op`]: the live command path validates, builds the op and applies it, and crash
//! recovery (and, later, cluster followers) replay ops through the same function.

mod apply;
pub mod args;
pub mod cmd;
pub mod deadletter;
pub mod exchange;
pub mod headers;
pub mod log_limit;
pub mod permissions;
pub mod queue;
pub mod topic;
pub mod users;
pub mod view;

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldTable};
use apply::Removals;
use bytes::Bytes;
use exchange::{Dest, Exchange, ExchangeKind};
use queue::{ConsumerKey, DropReason, Overflow, Pushed, Queue, QueueConsumer, QueuedMessage};
// Maps keyed by the broker's own integer ids use FxHash (a multiply per lookup; SipHash was
// 18 hashings per message in the profile). Maps keyed by client-chosen names keep std's keyed
// SipHash, which resists collision flooding.
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use warren_protocol::AmqpError;
use warren_storage::{BindingDest, Op};

pub type ConnId = u64;
pub type QueueId = u64;
/// The queues one message goes to: inline (no allocation) for up to 8.
pub type Targets = SmallVec<[QueueId; 8]>;

/// Durable changes made under one lock of the broker (most often one or two: kept inline, so
/// a publish does not allocate a list to hand its op to the committer).
pub type Journal = SmallVec<[Op; 2]>;

/// A published message, shared (not copied) by every queue it was routed to.
#[derive(Debug)]
pub struct Message {
    /// Shared with the publish that brought it (and the ops that store it).
    pub exchange: warren_storage::Name,
    pub routing_key: warren_storage::Name,
    pub properties: AMQPProperties,
    /// Encoded properties exactly as published; sent unchanged on delivery.
    pub raw_properties: Bytes,
    pub body: warren_protocol::Body,
    /// The `expiration` property, parsed (ms).
    pub expiration: Option<u64>,
}

impl Message {
    pub fn persistent(&self) -> bool {
        self.properties.delivery_mode() == &Some(2)
    }
}

/// What the server must do after a core call.
#[derive(Debug)]
pub enum Effect {
    Deliver {
        conn: ConnId,
        channel: u16,
        consumer_tag: Arc<str>,
        delivery_tag: u64,
        redelivered: bool,
        msg: Arc<Message>,
        /// The journal batch that replicates the message's enqueue (`QueuedMessage::batch`):
        /// a cluster's leader holds the delivery back until that batch is committed.
        batch: u64,
    },
    /// The queue of a consumer went away: tell the client (consumer_cancel_notify).
    ConsumerCancelled {
        conn: ConnId,
        channel: u16,
        consumer_tag: Arc<str>,
    },
    /// The connection used up its delivery budget: the server must call [`Broker::refill`] once
    /// its writer has flushed.
    Throttled(ConnId),
    /// A queue that held publishers (`PublishOutcome::held`) is back under its window: the
    /// connections waiting for that go on.
    Drained,
    /// A queue's consumers wait for its backlog to be read from the store (issue 13 point 5):
    /// the node reads it outside the broker lock and hands it to [`Broker::read_done`].
    Read(ReadRequest),
}

/// A read of a queue's backlog the core asks of the node (`Effect::Read`).
#[derive(Debug, Clone)]
pub struct ReadRequest {
    pub queue: QueueId,
    pub vhost: warren_storage::Name,
    pub name: warren_storage::Name,
    pub plan: queue::ReadPlan,
}

/// The reads queues asked for (`Effect::Read`), taken out of `fx` (the node carries them out
/// once the broker lock is released).
pub fn take_reads(fx: &mut Vec<Effect>) -> Vec<ReadRequest> {
    if !fx.iter().any(|e| matches!(e, Effect::Read(_))) {
        return Vec::new();
    }
    let mut reads = Vec::new();
    fx.retain(|e| match e {
        Effect::Read(r) => {
            reads.push(r.clone());
            false
        }
        _ => true,
    });
    reads
}

impl ReadRequest {
    fn of(queue: QueueId, q: &Queue, plan: queue::ReadPlan) -> Self {
        ReadRequest {
            queue,
            vhost: q.vhost.clone(),
            name: q.name.clone(),
            plan,
        }
    }

    /// Ask the node for `plan` of queue `id` (unless the same read is pending already).
    fn ask(id: QueueId, q: &mut Queue, plan: queue::ReadPlan, now: u64, fx: &mut Vec<Effect>) {
        if q.ask_read(&plan, now) {
            fx.push(Effect::Read(ReadRequest::of(id, q, plan)));
        }
    }
}

/// A consumer on a channel.
#[derive(Debug)]
struct Consumer {
    tag: Arc<str>,
    queue: QueueId,
    no_ack: bool,
    /// basic.qos(global=false) in force when it subscribed; 0 = unlimited.
    prefetch: u16,
    unacked: u32,
}

#[derive(Debug)]
struct Unacked {
    queue: QueueId,
    qm: QueuedMessage,
    /// Which consumer got it (None for basic.get).
    consumer: Option<Arc<str>>,
    /// When it was delivered (ms), for the consumer ack timeout.
    delivered_at: u64,
}

#[derive(Debug)]
struct ChannelState {
    next_tag: u64,
    unacked: BTreeMap<u64, Unacked>,
    consumers: Vec<Consumer>,
    /// Applied to consumers created after basic.qos(global=false).
    prefetch_consumer: u16,
    /// basic.qos(global=true): shared by all consumers of the channel; 0 = unlimited.
    prefetch_channel: u16,
    /// Unacked deliveries to this channel's consumers (what the channel limit counts).
    consumer_unacked: u32,
    /// channel.flow: false pauses deliveries.
    flow: bool,
    /// Direct reply-to: the no-ack consumer of `amq.rabbitmq.reply-to` on this channel (its tag)
    /// and the address replies to it use.
    reply_consumer: Option<(Arc<str>, String)>,
    /// Transactions: deliveries acked, nacked or rejected since the last commit or rollback,
    /// with what to do at commit (None: ack; Some(requeue): reject). Out of `unacked`, so
    /// basic.recover leaves them alone, as in RabbitMQ; they still count against prefetch
    /// until the commit settles them.
    tx_settled: Vec<(u64, Unacked, Option<bool>)>,
    /// Which of the channel's queues gets freed channel-wide credit first (rotates).
    credit_turn: usize,
}

impl ChannelState {
    fn new() -> Self {
        ChannelState {
            next_tag: 1,
            unacked: BTreeMap::new(),
            consumers: Vec::new(),
            prefetch_consumer: 0,
            prefetch_channel: 0,
            consumer_unacked: 0,
            flow: true,
            reply_consumer: None,
            tx_settled: Vec::new(),
            credit_turn: 0,
        }
    }
}

/// How many bytes of deliveries a connection's writer may have pending before the core stops
/// handing it more (a client that stops reading must not grow the server's memory).
pub const DELIVERY_BUDGET: i64 = 4 * 1024 * 1024;

#[derive(Debug)]
struct ConnState {
    vhost: String,
    /// Who logged in (user limits count by it).
    user: String,
    channels: FxHashMap<u16, ChannelState>,
    budget: i64,
    throttled: bool,
}

#[derive(Debug)]
struct VHost {
    exchanges: HashMap<String, Exchange>,
    /// For each destination, the exchanges with bindings to it and how many each has: what
    /// a destination going away unbinds, found without a scan of every exchange (a chain of
    /// auto-delete exchanges deleted one after the other scanned them all at each link).
    sources: HashMap<exchange::Dest, BTreeMap<String, usize>>,
    queues: HashMap<String, QueueId>,
    /// Metadata (`Op::PutVhost`).
    description: String,
    tags: Vec<String>,
}

/// The exchanges a publish has reached: a few in a vector (most publishes reach one or two),
/// a set once there are many (exchange-to-exchange bindings as many as a client makes: a
/// linear search each made routing through thousands of them quadratic, under the lock).
#[derive(Default)]
struct Visited<'a> {
    few: SmallVec<[&'a str; 8]>,
    many: std::collections::HashSet<&'a str>,
}

impl<'a> Visited<'a> {
    /// Whether `name` is new (and now visited).
    fn insert(&mut self, name: &'a str) -> bool {
        if !self.many.is_empty() {
            return self.many.insert(name);
        }
        if self.few.contains(&name) {
            return false;
        }
        if self.few.len() < self.few.inline_size() {
            self.few.push(name);
        } else {
            self.many.extend(self.few.drain(..));
            self.many.insert(name);
        }
        true
    }
}

impl VHost {
    /// A binding of exchange `source` to `dest` went (`sources`).
    fn forget_source(&mut self, dest: &exchange::Dest, source: &str) {
        let Some(by) = self.sources.get_mut(dest) else {
            return;
        };
        if let Some(count) = by.get_mut(source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                by.remove(source);
            }
        }
        if by.is_empty() {
            self.sources.remove(dest);
        }
    }
}

/// A vhost as the management API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostInfo {
    pub name: String,
    pub description: String,
    pub tags: Vec<String>,
}

/// Numbers a queue.declare-ok reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    pub name: String,
    pub message_count: u32,
    pub consumer_count: u32,
}

/// One message handed out by basic.get.
#[derive(Debug)]
pub struct GetResult {
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub msg: Arc<Message>,
    pub message_count: u32,
    /// See `QueuedMessage::batch`: a get-ok waits for this batch's commit on a cluster.
    pub batch: u64,
}

/// Parameters of queue.declare, from the wire.
#[derive(Debug, Clone, Default)]
pub struct QueueDeclare {
    pub name: String,
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: FieldTable,
}

/// Parameters of exchange.declare, from the wire.
#[derive(Debug, Clone, Default)]
pub struct ExchangeDeclare {
    pub name: String,
    pub kind: String,
    pub passive: bool,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
}

/// The broker core. Its state is in two parts, kept apart in the types: `replicated`, what
/// every broker that applies the same ops holds alike (changed only through `apply` and the
/// removals it records, see `log.rs`), and `local`, what only the broker serving the clients
/// has (connections, channels, consumers, who holds which delivery, timers' indexes, paging).
/// A queue (`Queue`) still keeps its consumers and paging beside its messages.
#[derive(Debug)]
pub struct Broker {
    replicated: Replicated,
    local: Local,
    /// The store writes and replicated ops of the changes made (see `apply/log.rs`): only
    /// `apply.rs` writes them.
    log: apply::Log,
}

/// Replicated state: equal on every broker after the same ops (`view::ReplicatedView`).
#[derive(Debug)]
struct Replicated {
    vhosts: HashMap<String, VHost>,
    queues: FxHashMap<QueueId, Queue>,
    next_queue_id: QueueId,
    /// The next message id: assigned by the broker serving clients and carried in the ops.
    next_message_id: u64,
    /// Users by name (sorted: what lists them shows a stable order).
    users: std::collections::BTreeMap<String, users::User>,
    /// A vhost was made by an op (`vhosts_recorded`).
    vhosts_recorded: bool,
    /// Permissions by (user, vhost) (sorted: cascades remove them in a stable order).
    permissions: std::collections::BTreeMap<(String, String), Arc<permissions::Permissions>>,
    /// Limits by vhost and by user (`Op::PutVhostLimits`, `Op::PutUserLimits`).
    vhost_limits: std::collections::BTreeMap<String, Vec<(String, i64)>>,
    user_limits: std::collections::BTreeMap<String, Vec<(String, i64)>>,
    /// Topic permissions by (user, vhost, exchange).
    topic_permissions:
        std::collections::BTreeMap<(String, String, String), Arc<permissions::TopicPermissions>>,
}

/// Leader-local state: what the broker serving clients keeps for them.
#[derive(Debug)]
struct Local {
    conns: FxHashMap<ConnId, ConnState>,
    next_conn_id: ConnId,
    /// The time, in ms since the epoch, as the caller last set it (`set_clock`). The core never
    /// reads a clock itself; what a replica needs of it travels inside the ops.
    now_ms: u64,
    /// Queues that hold messages with an expiry; `expire` visits only these.
    expiring: std::collections::BTreeSet<QueueId>,
    /// Where deep queues page to (with a store).
    pager: Option<Arc<queue::Pager>>,
    /// Queues holding staged messages (in memory until their store write is done).
    staging: std::collections::BTreeSet<QueueId>,
    /// Queues whose `dropped` list needs settling (dead-lettering, store removal).
    dirty: Vec<QueueId>,
    /// Queues that found they need a read to go on taking their head (`Queue::wanted`): the
    /// node is asked for it after the command (`ask_wanted`).
    wanting: Vec<QueueId>,
    /// Queues with x-expires.
    expirable: std::collections::BTreeSet<QueueId>,
    /// Direct reply-to addresses (`amq.rabbitmq.reply-to.<suffix>`) → the channel they reach.
    reply_to: HashMap<String, (ConnId, u16)>,
    /// Counts changes of permissions (and of the users and vhosts they name): a connection
    /// that keeps a user's permissions looks them up again when it moved.
    permissions_generation: u64,
    /// The name the next server-named queue gets (`server_queue_name`).
    server_name: Option<String>,
}

/// The pseudo-queue of RabbitMQ's direct reply-to.
pub const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// What became of a publish.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishOutcome {
    /// Queues the message reached.
    pub routed: usize,
    /// Some queue refused it (x-overflow reject-publish): the publisher gets a basic.nack.
    pub rejected: bool,
    /// Some queue took it past its in-memory window and either has consumers (they are behind:
    /// the publisher should slow down to them rather than make the queue page) or holds more
    /// than another window's worth of such messages not yet written. The publisher should wait
    /// for the store to have it.
    pub staged: bool,
    /// Queues that kept it in memory past their window because their consumers are behind:
    /// the publisher should wait until `Broker::holding` says otherwise (at most `Config::flow_hold`).
    pub held: Targets,
}

impl Default for Broker {
    fn default() -> Self {
        Self::new()
    }
}

fn qname(vhost: &str, name: &str) -> String {
    format!("queue '{name}' in vhost '{vhost}'")
}

fn xname(vhost: &str, name: &str) -> String {
    format!("exchange '{name}' in vhost '{vhost}'")
}

/// Encode a field table in its wire form (for ops).
pub fn encode_table(t: &FieldTable) -> Bytes {
    use amq_protocol::frame::WriteContext;
    use amq_protocol::types::generation::gen_field_table;
    match gen_field_table(t)(WriteContext::from(Vec::new())) {
        Ok(ctx) => Bytes::from(ctx.into_inner().0),
        Err(_) => Bytes::from_static(&[0, 0, 0, 0]),
    }
}

/// Decode a field table from its wire form.
pub fn decode_table(b: &[u8]) -> Result<FieldTable, AmqpError> {
    amq_protocol::types::parsing::parse_field_table(b)
        .map(|(_, t)| t)
        .map_err(|_| AmqpError::new(warren_protocol::ReplyCode::InternalError, "bad field table"))
}

/// A limit from a list of them: None when absent or negative.
fn limit_in(limits: Option<&Vec<(String, i64)>>, name: &str) -> Option<u64> {
    limits?
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| u64::try_from(*v).ok())
}

fn random_name(prefix: &str) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut rng = rand::rng();
    let suffix: String = (0..22)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect();
    format!("{prefix}{suffix}")
}

/// A message rebuilt from what a store keeps.
pub(crate) fn stored_message(
    exchange: &str,
    routing_key: &str,
    properties: Bytes,
    body: warren_protocol::Body,
) -> Result<Message, AmqpError> {
    let parsed = amq_protocol::protocol::basic::parse_properties(&properties[..])
        .map(|(_, p)| p)
        .map_err(|_| {
            AmqpError::new(
                warren_protocol::ReplyCode::InternalError,
                "bad stored properties",
            )
        })?;
    let expiration = parsed
        .expiration()
        .as_ref()
        .and_then(|e| args::parse_expiration(e.as_str()).ok());
    Ok(Message {
        exchange: exchange.into(),
        routing_key: routing_key.into(),
        properties: parsed,
        raw_properties: properties,
        body,
        expiration,
    })
}

/// The `alternate-exchange` argument of an exchange, if it names one.
fn alternate_exchange(args: &FieldTable) -> Option<&str> {
    match args.inner().get("alternate-exchange") {
        Some(AMQPValue::LongString(s)) => std::str::from_utf8(s.as_bytes()).ok(),
        Some(AMQPValue::ShortString(s)) => Some(s.as_str()),
        _ => None,
    }
}

/// Text form of a value in "inequivalent arg" messages.
fn show_value(v: Option<&AMQPValue>) -> String {
    match v {
        None => "none".into(),
        Some(AMQPValue::LongString(s)) => format!("'{}'", String::from_utf8_lossy(s.as_bytes())),
        Some(AMQPValue::ShortString(s)) => format!("'{}'", s.as_str()),
        Some(AMQPValue::Boolean(b)) => format!("'{b}'"),
        Some(AMQPValue::ShortShortInt(x)) => format!("'{x}'"),
        Some(AMQPValue::ShortShortUInt(x)) => format!("'{x}'"),
        Some(AMQPValue::ShortInt(x)) => format!("'{x}'"),
        Some(AMQPValue::ShortUInt(x)) => format!("'{x}'"),
        Some(AMQPValue::LongInt(x)) => format!("'{x}'"),
        Some(AMQPValue::LongUInt(x)) => format!("'{x}'"),
        Some(AMQPValue::LongLongInt(x)) => format!("'{x}'"),
        Some(other) => format!("{other:?}"),
    }
}

/// RabbitMQ's name for a field type, as it prints it in errors.
pub(crate) fn type_name(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::Boolean(_) => "bool",
        AMQPValue::ShortShortInt(_) => "byte",
        AMQPValue::ShortShortUInt(_) => "unsignedbyte",
        AMQPValue::ShortInt(_) => "short",
        AMQPValue::ShortUInt(_) => "unsignedshort",
        AMQPValue::LongInt(_) => "signedint",
        AMQPValue::LongUInt(_) => "unsignedint",
        AMQPValue::LongLongInt(_) => "long",
        AMQPValue::Float(_) => "float",
        AMQPValue::Double(_) => "double",
        AMQPValue::DecimalValue(_) => "decimal",
        AMQPValue::ShortString(_) => "shortstr",
        AMQPValue::LongString(_) => "longstr",
        AMQPValue::FieldArray(_) => "array",
        AMQPValue::Timestamp(_) => "timestamp",
        AMQPValue::FieldTable(_) => "table",
        AMQPValue::ByteArray(_) => "binary",
        AMQPValue::Void => "void",
    }
}

impl Broker {
    /// A broker with the default vhost "/" and its predeclared exchanges.
    pub fn new() -> Self {
        let mut b = Broker {
            replicated: Replicated {
                vhosts: HashMap::new(),
                queues: FxHashMap::default(),
                next_queue_id: 1,
                next_message_id: 1,
                users: Default::default(),
                vhosts_recorded: false,
                permissions: Default::default(),
                vhost_limits: Default::default(),
                user_limits: Default::default(),
                topic_permissions: Default::default(),
            },
            local: Local {
                conns: FxHashMap::default(),
                next_conn_id: 1,
                now_ms: 0,
                expiring: Default::default(),
                pager: None,
                staging: Default::default(),
                dirty: Vec::new(),
                wanting: Vec::new(),
                expirable: Default::default(),
                reply_to: HashMap::new(),
                permissions_generation: 0,
                server_name: None,
            },
            log: Default::default(),
        };
        b.add_vhost("/");
        b
    }

    pub fn add_vhost(&mut self, name: &str) {
        if self.replicated.vhosts.contains_key(name) {
            return;
        }
        let mut exchanges = HashMap::new();
        for (x, kind) in [
            ("", ExchangeKind::Direct),
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
            ("amq.headers", ExchangeKind::Headers),
            ("amq.match", ExchangeKind::Headers),
        ] {
            exchanges.insert(
                x.to_string(),
                Exchange::new(
                    x.to_string(),
                    kind,
                    true,
                    false,
                    false,
                    FieldTable::default(),
                ),
            );
        }
        self.replicated.vhosts.insert(
            name.to_string(),
            VHost {
                exchanges,
                sources: HashMap::new(),
                queues: HashMap::new(),
                description: String::new(),
                tags: Vec::new(),
            },
        );
    }

    /// A broker without even the default vhost: for one rebuilt from a store that records its
    /// vhosts (`Op::PutVhost`), where "/" exists only if recorded (it may have been deleted).
    pub fn without_vhosts() -> Self {
        let mut b = Self::new();
        b.replicated.vhosts.clear();
        b
    }

    /// Whether any vhost was made by an op (`Op::PutVhost`): a store that records none holds
    /// data of a version before vhosts were recorded (all in "/"), or none at all, and the
    /// node records "/" (`default vhost`).
    pub fn vhosts_recorded(&self) -> bool {
        self.replicated.vhosts_recorded
    }

    /// A user's permissions in a vhost (None: they may not use it).
    pub fn permissions(&self, user: &str, vhost: &str) -> Option<Arc<permissions::Permissions>> {
        self.replicated
            .permissions
            .get(&(user.to_string(), vhost.to_string()))
            .cloned()
    }

    /// Every (user, vhost, permissions), sorted by user then vhost.
    pub fn permission_list(&self) -> Vec<(String, String, Arc<permissions::Permissions>)> {
        self.replicated
            .permissions
            .iter()
            .map(|((u, v), p)| (u.clone(), v.clone(), p.clone()))
            .collect()
    }

    /// The name the next queue.declare with an empty name gets: chosen before the declare, so
    /// the caller can check the permission to configure it (RabbitMQ checks the name it made).
    pub fn server_queue_name(&mut self) -> String {
        self.local
            .server_name
            .get_or_insert_with(|| random_name("amq.gen-"))
            .clone()
    }

    /// A user's topic permissions in a vhost, by exchange.
    pub fn topic_permissions(
        &self,
        user: &str,
        vhost: &str,
    ) -> Vec<(String, Arc<permissions::TopicPermissions>)> {
        self.replicated
            .topic_permissions
            .iter()
            .filter(|((u, v, _), _)| u == user && v == vhost)
            .map(|((_, _, x), p)| (x.clone(), p.clone()))
            .collect()
    }

    /// Every (user, vhost, exchange, topic permissions), sorted.
    pub fn topic_permission_list(
        &self,
    ) -> Vec<(String, String, String, Arc<permissions::TopicPermissions>)> {
        self.replicated
            .topic_permissions
            .iter()
            .map(|((u, v, x), p)| (u.clone(), v.clone(), x.clone(), p.clone()))
            .collect()
    }

    /// Whether `name` is a topic exchange of `vhost` (topic permissions apply to those).
    pub fn is_topic_exchange(&self, vhost: &str, name: &str) -> bool {
        self.replicated
            .vhosts
            .get(vhost)
            .and_then(|v| v.exchanges.get(name))
            .is_some_and(|x| x.kind == ExchangeKind::Topic)
    }

    /// Limit `name` of `vhost`: None when not set or negative (RabbitMQ: no limit).
    pub fn vhost_limit(&self, vhost: &str, name: &str) -> Option<u64> {
        limit_in(self.replicated.vhost_limits.get(vhost), name)
    }

    /// Limit `name` of `user` (as `vhost_limit`).
    pub fn user_limit(&self, user: &str, name: &str) -> Option<u64> {
        limit_in(self.replicated.user_limits.get(user), name)
    }

    /// Every vhost's limits, by vhost.
    pub fn vhost_limits(&self) -> Vec<(String, Vec<(String, i64)>)> {
        self.replicated
            .vhost_limits
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Every user's limits, by user.
    pub fn user_limits(&self) -> Vec<(String, Vec<(String, i64)>)> {
        self.replicated
            .user_limits
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Open connections to `vhost`.
    pub fn connections_in(&self, vhost: &str) -> usize {
        self.local
            .conns
            .values()
            .filter(|c| c.vhost == vhost)
            .count()
    }

    /// Open connections of `user`, and their open channels (every vhost).
    pub fn usage_of(&self, user: &str) -> (usize, usize) {
        self.local
            .conns
            .values()
            .filter(|c| c.user == user)
            .fold((0, 0), |(n, ch), c| (n + 1, ch + c.channels.len()))
    }

    /// See `Local::permissions_generation`.
    pub fn permissions_generation(&self) -> u64 {
        self.local.permissions_generation
    }

    /// Every vhost, sorted by name.
    pub fn vhost_infos(&self) -> Vec<VhostInfo> {
        let mut out: Vec<VhostInfo> = self
            .replicated
            .vhosts
            .iter()
            .map(|(name, v)| VhostInfo {
                name: name.clone(),
                description: v.description.clone(),
                tags: v.tags.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Recovery is over. Every recovered message is marked redelivered: the store does not
    /// record deliveries, so any of them may have reached a consumer before the restart (the
    /// flag means "may have been delivered"; `false` still always means "never delivered").
    pub fn mark_recovered(&mut self) {
        let upto = self.replicated.next_message_id.saturating_sub(1);
        for q in self.replicated.queues.values_mut() {
            q.mark_all_redelivered(upto);
        }
    }

    /// Let deep queues keep their backlog on disk (see `queue::WINDOW_MESSAGES`).
    pub fn set_pager(&mut self, pager: queue::Pager) {
        let pager = Arc::new(pager);
        for q in self.replicated.queues.values_mut() {
            q.pager = Some(pager.clone());
        }
        self.local.pager = Some(pager);
    }

    /// Recovery: what each stored queue holds on disk (read back as consumers need it).
    /// Returns how many messages that is.
    pub fn restore(&mut self, queues: &[warren_storage::QueueSummary]) -> usize {
        let mut total = 0;
        let last = queues
            .iter()
            .flat_map(|q| q.levels.iter())
            .map(|l| warren_storage::key_id(l.last))
            .max()
            .unwrap_or(0);
        self.replicated.next_message_id = self.replicated.next_message_id.max(last + 1);
        for s in queues {
            let Some(id) = self
                .replicated
                .vhosts
                .get(&s.vhost)
                .and_then(|v| v.queues.get(&s.name))
                .copied()
            else {
                continue;
            };
            if let Some(q) = self.replicated.queues.get_mut(&id) {
                q.restore(&s.levels, last);
                total += q.message_count();
                if q.has_expiring() {
                    self.local.expiring.insert(id);
                }
            }
        }
        total
    }

    /// After requeues to queue `qid`: `Queue::after_requeue` (expiry, length limits, paging
    /// out past the window), journaling a spill for each message it paged out that the store
    /// does not hold yet; a queue that dropped messages is marked dirty.
    fn after_requeue(&mut self, qid: QueueId, now: u64) {
        let (stored_batch, spill_batch) = (
            self.log.seq() + self.log.pending() as u64,
            self.log.seq() + 1,
        );
        let mut spills = Vec::new();
        let Some(q) = self.replicated.queues.get_mut(&qid) else {
            return;
        };
        if q.after_requeue(now, stored_batch, spill_batch, &mut spills) {
            self.local.dirty.push(qid);
        }
        if q.wants_read() {
            self.local.wanting.push(qid);
        }
        if q.pager.is_some() {
            // The timer lets go of the paged-out messages once their batch is written.
            self.local.staging.insert(qid);
        }
        for (key, msg) in spills {
            apply::write_local(
                &mut self.log,
                Op::Spill {
                    vhost: q.vhost.clone(),
                    queue: q.name.clone(),
                    key,
                    timestamp_ms: now,
                    exchange: msg.exchange.clone(),
                    routing_key: msg.routing_key.clone(),
                    properties: msg.raw_properties.clone(),
                    body: msg.body.clone(),
                },
            );
        }
    }

    /// Let go of staged messages the store has written (the server calls this on a timer, so
    /// a queue nobody touches does not keep them).
    pub fn release_written(&mut self) {
        let queues = &mut self.replicated.queues;
        self.local
            .staging
            .retain(|id| queues.get_mut(id).is_some_and(|q| q.release_all_written()));
    }

    /// For basic.get: the read a queue's head needs first, if it is on disk (the caller reads
    /// it outside the lock and hands it back with the get, `take_head_read`). Messages past
    /// their time at the head go first (they may be all that is in memory). None also where
    /// the get itself will refuse (no such queue, another connection's exclusive queue).
    pub fn head_read_request(
        &mut self,
        conn: ConnId,
        vhost: &str,
        queue: &str,
    ) -> Option<ReadRequest> {
        let id = self.usable_queue(conn, vhost, queue).ok()?;
        let now = self.local.now_ms;
        let q = self.replicated.queues.get_mut(&id)?;
        if !q.async_reads() {
            return None;
        }
        if q.drop_expired(now) > 0 {
            self.local.dirty.push(id);
        }
        // The get needs the head of the highest level; a read the expiry of another level
        // wants is asked after the command.
        if q.wants_read() {
            self.local.wanting.push(id);
        }
        let plan = q.head_read()?;
        Some(ReadRequest::of(id, q, plan))
    }

    /// A read the node did for a queue (`Effect::Read`, or a get's `head_read_request`): taken
    /// (unless the queue moved on meanwhile: then it asks again), and what waited for the head
    /// done, without handing anything to consumers yet (a get takes its message first, then
    /// dispatches the rest). A failed read is tried again by the timer (`retry_reads`), not at
    /// once. False if the queue is gone: not the same queue, but one that took its id in a
    /// broker rebuilt meanwhile (a leader that stepped down rebuilds its broker from the
    /// store).
    pub fn take_head_read(
        &mut self,
        req: &ReadRequest,
        data: Result<queue::ReadData, warren_storage::StoreError>,
    ) -> bool {
        let Some(q) = self.replicated.queues.get_mut(&req.queue) else {
            return false;
        };
        if q.name != req.name || q.vhost != req.vhost {
            return false;
        }
        let failed = data.is_err();
        q.take_read(&req.plan, data);
        if !failed {
            self.took_head(req.queue);
        }
        true
    }

    /// The node read what a queue asked for (`Effect::Read`): take it (`take_head_read`) and
    /// hand out what it can.
    pub fn read_done(
        &mut self,
        req: &ReadRequest,
        data: Result<queue::ReadData, warren_storage::StoreError>,
        fx: &mut Vec<Effect>,
    ) {
        if !self.take_head_read(req, data) {
            return;
        }
        self.settle(fx);
        self.dispatch(req.queue, fx);
        self.ask_wanted(fx);
    }

    /// A read of a queue's head was taken: what waited for it is done now, before any
    /// delivery (messages past their time at the head go, and a drop-head queue over its
    /// limit drops its oldest); it may want the next read in turn.
    fn took_head(&mut self, id: QueueId) {
        let now = self.local.now_ms;
        let Some(q) = self.replicated.queues.get_mut(&id) else {
            return;
        };
        let mut dropped = q.drop_expired(now);
        if q.overflow == Overflow::DropHead {
            dropped += q.trim_to_limits();
        }
        if dropped > 0 {
            self.local.dirty.push(id);
        }
        if q.wants_read() {
            self.local.wanting.push(id);
        }
    }

    /// Ask the node for the reads queues found they need (`Queue::wanted`), once each.
    pub(crate) fn ask_wanted(&mut self, fx: &mut Vec<Effect>) {
        if self.local.wanting.is_empty() {
            return;
        }
        let now = self.local.now_ms;
        let mut wanting = std::mem::take(&mut self.local.wanting);
        wanting.sort_unstable();
        wanting.dedup();
        for id in wanting {
            if let Some(q) = self.replicated.queues.get_mut(&id) {
                if let Some(plan) = q.take_wanted() {
                    ReadRequest::ask(id, q, plan, now, fx);
                }
            }
        }
    }

    /// A read asked for and not carried out: its queue asks again at its next dispatch.
    pub fn read_dropped(&mut self, req: &ReadRequest) {
        if let Some(q) = self.replicated.queues.get_mut(&req.queue) {
            if q.read_pending.is_some_and(|(e, _)| e == req.plan.epoch) {
                q.read_pending = None;
                // Still needed, maybe by a trim with nobody consuming: the timer asks again.
                q.want(req.plan.clone());
            }
        }
    }

    /// Hand out again the backlog of queues whose read from the store failed (called on a
    /// timer: a failed read must not leave consumers waiting for the next publish or ack).
    /// Also the queues whose read asked of the node (`Effect::Read`) has gone unanswered for
    /// `READ_ASK_AGAIN_MS`: asked again.
    pub fn retry_reads(&mut self, fx: &mut Vec<Effect>) {
        let Some(pager) = &self.local.pager else {
            return;
        };
        let failed = pager.read_failed.swap(false, Ordering::Relaxed);
        let now = self.local.now_ms;
        if !failed && !pager.async_reads {
            return;
        }
        let mut failed: Vec<QueueId> = self
            .replicated
            .queues
            .iter_mut()
            .filter(|(_, q)| {
                (failed && q.read_failed)
                    || q.wants_read()
                    || q.read_pending
                        .is_some_and(|(_, at)| now >= at.saturating_add(queue::READ_ASK_AGAIN_MS))
            })
            .map(|(id, q)| {
                q.read_failed = false;
                *id
            })
            .collect();
        // In id order, whatever the map's: the dispatch order is the order of the ops (no-ack
        // removals) it records.
        failed.sort_unstable();
        for id in failed {
            // What waited for the head (a trim, expiry) asks again too, consumers or not.
            self.took_head(id);
            self.dispatch(id, fx);
        }
        self.settle(fx);
        self.ask_wanted(fx);
    }

    /// Ready messages held in memory, across all queues (for tests and reports).
    pub fn messages_in_memory(&self) -> usize {
        self.replicated.queues.values().map(|q| q.in_memory()).sum()
    }

    /// How many consumers a queue has.
    pub fn consumer_count(&self, vhost: &str, queue: &str) -> Option<usize> {
        let id = self.queue_id(vhost, queue).ok()?;
        self.replicated
            .queues
            .get(&id)
            .map(|q| q.local.consumers.len())
    }

    /// How many messages a queue has paged out to the store past its window since it was
    /// declared (RabbitMQ reports the like as `messages_paged_out`).
    pub fn paged_out(&self, vhost: &str, queue: &str) -> Option<u64> {
        let id = self.queue_id(vhost, queue).ok()?;
        self.replicated.queues.get(&id).map(|q| q.paged_out)
    }

    /// Whether an op changes durable state (checked against the state before it is applied).
    fn is_durable(&self, op: &Op) -> bool {
        let queue_stored = |vhost: &str, name: &str| {
            self.replicated
                .vhosts
                .get(vhost)
                .and_then(|v| v.queues.get(name))
                .and_then(|id| self.replicated.queues.get(id))
                .is_some_and(|q| q.is_stored())
        };
        let exchange_durable = |vhost: &str, name: &str| {
            self.replicated
                .vhosts
                .get(vhost)
                .and_then(|v| v.exchanges.get(name))
                .is_some_and(|x| x.durable && !name.is_empty())
        };
        match op {
            Op::DeclareExchange { durable, .. } => *durable,
            Op::DeleteExchange { vhost, name } => exchange_durable(vhost, name),
            Op::DeclareQueue {
                durable, exclusive, ..
            } => *durable && !*exclusive,
            Op::DeleteQueue { vhost, name } => queue_stored(vhost, name),
            Op::Purge { vhost, queue } => queue_stored(vhost, queue),
            Op::Bind {
                vhost,
                source,
                destination,
                ..
            }
            | Op::Unbind {
                vhost,
                source,
                destination,
                ..
            } => {
                exchange_durable(vhost, source)
                    && match destination {
                        BindingDest::Queue(q) => queue_stored(vhost, q),
                        BindingDest::Exchange(x) => exchange_durable(vhost, x),
                    }
            }
            Op::Enqueue { .. }
            | Op::Remove { .. }
            | Op::Spill { .. }
            | Op::RemoveRange { .. }
            | Op::PutUser { .. }
            | Op::DeleteUser { .. }
            | Op::PutVhost { .. }
            | Op::DeleteVhost { .. }
            | Op::SetPermissions { .. }
            | Op::ClearPermissions { .. }
            | Op::PutVhostLimits { .. }
            | Op::PutUserLimits { .. }
            | Op::SetTopicPermissions { .. }
            | Op::ClearTopicPermissions { .. } => true,
        }
    }

    /// A user, by name.
    pub fn user(&self, name: &str) -> Option<&users::User> {
        self.replicated.users.get(name)
    }

    /// Every user with their name, in name order.
    pub fn users(&self) -> Vec<(String, users::User)> {
        self.replicated
            .users
            .iter()
            .map(|(n, u)| (n.clone(), u.clone()))
            .collect()
    }

    /// Whether any user exists (a data folder that has none gets its default user).
    pub fn has_users(&self) -> bool {
        !self.replicated.users.is_empty()
    }

    /// Set the time (ms since the epoch) the following calls see.
    pub fn set_clock(&mut self, now_ms: u64) {
        self.local.now_ms = self.local.now_ms.max(now_ms);
        if let Some(p) = &self.local.pager {
            p.clock.store(self.local.now_ms, Ordering::Relaxed);
        }
    }

    /// Drop expired messages at the head of every queue that has some; returns how many went.
    pub fn expire(&mut self, fx: &mut Vec<Effect>) -> usize {
        let now = self.local.now_ms;
        let mut dropped = 0;
        let mut done = Vec::new();
        for id in &self.local.expiring {
            match self.replicated.queues.get_mut(id) {
                Some(q) => {
                    // With the node reading for us, a head on disk is asked for (read outside
                    // the lock) and looked at on a later tick.
                    let asks = q.async_reads();
                    let n = q.drop_expired_reading(now, if asks { 0 } else { 1 });
                    if n > 0 {
                        dropped += n;
                        self.local.dirty.push(*id);
                    }
                    if asks {
                        if let Some(plan) = q.expiry_read() {
                            ReadRequest::ask(*id, q, plan, now, fx);
                        }
                    }
                    if !q.has_expiring() {
                        done.push(*id);
                    }
                }
                None => done.push(*id),
            }
        }
        for id in done {
            self.local.expiring.remove(&id);
        }
        // x-expires: a queue unused (no consumer, no declare, no get) that long goes, with its
        // messages (not dead-lettered, as in RabbitMQ).
        let unused: Vec<QueueId> = self
            .local
            .expirable
            .iter()
            .filter(|id| {
                self.replicated.queues.get(id).is_some_and(|q| {
                    q.local.consumers.is_empty()
                        && q.expires
                            .is_some_and(|e| now >= q.last_used.saturating_add(e))
                })
            })
            .copied()
            .collect();
        for id in unused {
            // The queue's storage goes with it, unacked ones included.
            self.delete_queue(id, fx);
        }
        self.settle(fx);
        dropped
    }

    /// Consumer ack timeout: a consumer holding a delivery unacknowledged longer than
    /// `timeout_ms` is cancelled (the client is told, if it takes cancel notifications) and the
    /// messages it holds go back to their queues. Only that consumer is affected; its channel
    /// stays open. Returns how many consumers were cancelled.
    pub fn enforce_ack_timeout(&mut self, timeout_ms: u64, fx: &mut Vec<Effect>) -> usize {
        let now = self.local.now_ms;
        let mut stuck: Vec<(ConnId, u16, Arc<str>)> = Vec::new();
        for (conn, c) in &self.local.conns {
            for (ch, state) in &c.channels {
                for u in state.unacked.values() {
                    if let Some(tag) = &u.consumer {
                        if now.saturating_sub(u.delivered_at) > timeout_ms
                            && !stuck
                                .iter()
                                .any(|(a, b, t)| a == conn && b == ch && t == tag)
                        {
                            stuck.push((*conn, *ch, tag.clone()));
                        }
                    }
                }
            }
        }
        // In connection, channel, tag order, whatever the maps': the requeues and dispatches
        // that follow record ops in this order.
        stuck.sort_unstable();
        for (conn, ch, tag) in &stuck {
            tracing::warn!(conn, ch, tag = %tag, timeout_ms, "consumer ack timeout: cancelling");
            let mut requeue: Vec<(QueueId, QueuedMessage)> = Vec::new();
            if let Ok(state) = self.channel(*conn, *ch) {
                let tags: Vec<u64> = state
                    .unacked
                    .iter()
                    .filter(|(_, u)| u.consumer.as_ref() == Some(tag))
                    .map(|(t, _)| *t)
                    .collect();
                for t in tags {
                    if let Some(u) = state.unacked.remove(&t) {
                        state.consumer_unacked -= 1;
                        requeue.push((u.queue, u.qm));
                    }
                }
            }
            let now = self.local.now_ms;
            let mut touched: Vec<QueueId> = Vec::new();
            for (qid, qm) in requeue.into_iter().rev() {
                if let Some(q) = self.replicated.queues.get_mut(&qid) {
                    q.local.unacked -= 1;
                    if !q.requeue(qm) {
                        self.local.dirty.push(qid);
                    }
                    if !touched.contains(&qid) {
                        touched.push(qid);
                    }
                }
            }
            for qid in touched {
                self.after_requeue(qid, now);
            }
            if self.cancel(*conn, *ch, tag, fx) {
                fx.push(Effect::ConsumerCancelled {
                    conn: *conn,
                    channel: *ch,
                    consumer_tag: tag.clone(),
                });
            }
        }
        self.settle(fx);
        stuck.len()
    }

    /// Dead-letter and un-store what queues dropped (expired, over their limit). Dead-lettering
    /// can make other queues drop, so this runs until nothing is left (bounded).
    fn settle(&mut self, fx: &mut Vec<Effect>) {
        for _ in 0..64 {
            if self.local.dirty.is_empty() {
                return;
            }
            let mut dirty = std::mem::take(&mut self.local.dirty);
            dirty.sort_unstable();
            dirty.dedup();
            for qid in dirty {
                let Some(q) = self.replicated.queues.get_mut(&qid) else {
                    continue;
                };
                let dropped = std::mem::take(&mut q.dropped);
                let mut gone = Removals::default();
                for (m, _) in &dropped {
                    gone.add(qid, q, m);
                }
                self.removed(gone);
                for (m, reason) in dropped {
                    self.dead_letter(qid, &m, reason, fx);
                }
            }
        }
    }

    /// Hand a message that left queue `qid` without an ack to the queue's dead-letter exchange.
    fn dead_letter(
        &mut self,
        qid: QueueId,
        m: &QueuedMessage,
        reason: DropReason,
        fx: &mut Vec<Effect>,
    ) {
        let Some(q) = self.replicated.queues.get(&qid) else {
            return;
        };
        let Some(dlx) = q.dead_letter_exchange.clone() else {
            return;
        };
        let dlrk = q.dead_letter_routing_key.clone();
        let (vhost, qname) = (q.vhost.clone(), q.name.clone());
        let (props, raw_properties) = deadletter::dead_letter_properties(
            &m.msg,
            reason,
            &qname,
            self.local.now_ms / 1000,
            dlrk.is_some(),
        );
        let keys: Vec<String> = match &dlrk {
            Some(k) => vec![k.clone()],
            None => {
                let mut keys = vec![m.msg.routing_key.to_string()];
                keys.extend(deadletter::header_keys(
                    m.msg.properties.headers().as_ref(),
                    "CC",
                ));
                keys
            }
        };
        let routing_key = dlrk.unwrap_or_else(|| m.msg.routing_key.to_string());
        let msg = Message {
            exchange: dlx.as_str().into(),
            routing_key: routing_key.as_str().into(),
            raw_properties,
            properties: props,
            body: m.msg.body.clone(),
            expiration: None,
        };
        // A missing dead-letter exchange drops the message silently, as RabbitMQ.
        let keys: SmallVec<[&str; 4]> = keys.iter().map(String::as_str).collect();
        let Ok(targets) = self.route_keys(&vhost, &dlx, &keys, &msg, false) else {
            return;
        };
        let targets: Vec<QueueId> = targets
            .into_iter()
            .filter(|t| {
                self.replicated
                    .queues
                    .get(t)
                    .is_some_and(|tq| !deadletter::is_cycle(&msg.properties, reason, &tq.name))
            })
            .collect();
        self.deliver(&targets, Arc::new(msg), fx);
    }

    pub fn has_vhost(&self, name: &str) -> bool {
        self.replicated.vhosts.contains_key(name)
    }

    fn vhost(&self, vhost: &str) -> Result<&VHost, AmqpError> {
        self.replicated
            .vhosts
            .get(vhost)
            .ok_or_else(|| AmqpError::not_allowed(format!("vhost {vhost} not found")))
    }

    fn vhost_mut(&mut self, vhost: &str) -> Result<&mut VHost, AmqpError> {
        self.replicated
            .vhosts
            .get_mut(vhost)
            .ok_or_else(|| AmqpError::not_allowed(format!("vhost {vhost} not found")))
    }

    // ---------------------------------------------------------------- connections, channels

    /// Register a new connection on a vhost; returns its id.
    pub fn connection_open(&mut self, vhost: &str) -> ConnId {
        self.connection_open_for(vhost, "")
    }

    /// A connection of `user` to `vhost` (see `connection_open`).
    pub fn connection_open_for(&mut self, vhost: &str, user: &str) -> ConnId {
        let id = self.local.next_conn_id;
        self.local.next_conn_id += 1;
        self.local.conns.insert(
            id,
            ConnState {
                vhost: vhost.to_string(),
                user: user.to_string(),
                channels: FxHashMap::default(),
                budget: DELIVERY_BUDGET,
                throttled: false,
            },
        );
        id
    }

    /// The connection went away: close its channels (requeueing what they held) and delete its
    /// exclusive queues.
    pub fn connection_close(&mut self, conn: ConnId, fx: &mut Vec<Effect>) {
        let mut channels: Vec<u16> = match self.local.conns.get(&conn) {
            Some(c) => c.channels.keys().copied().collect(),
            None => return,
        };
        // In channel order, whatever the map's: each close requeues and dispatches, which
        // records ops (and may hand a requeued message to a channel closed next).
        channels.sort_unstable();
        for ch in channels {
            self.channel_close(conn, ch, fx);
        }
        let mut owned: Vec<QueueId> = self
            .replicated
            .queues
            .iter()
            .filter(|(_, q)| q.owner == Some(conn))
            .map(|(id, _)| *id)
            .collect();
        // In id order, whatever the map's.
        owned.sort_unstable();
        for id in owned {
            self.delete_queue(id, fx);
        }
        self.local.conns.remove(&conn);
    }

    pub fn channel_open(&mut self, conn: ConnId, ch: u16) {
        if let Some(c) = self.local.conns.get_mut(&conn) {
            c.channels.insert(ch, ChannelState::new());
        }
    }

    /// Close a channel: its consumers go, its unacked messages return to their queues in their
    /// original places, marked redelivered.
    pub fn channel_close(&mut self, conn: ConnId, ch: u16, fx: &mut Vec<Effect>) {
        let Some(mut state) = self
            .local
            .conns
            .get_mut(&conn)
            .and_then(|c| c.channels.remove(&ch))
        else {
            return;
        };
        // Settled in a transaction never committed: back to their queues like the rest.
        for (tag, u, _) in std::mem::take(&mut state.tx_settled) {
            state.unacked.insert(tag, u);
        }
        if let Some((_, suffix)) = &state.reply_consumer {
            self.local.reply_to.remove(suffix);
        }
        let mut touched: Vec<QueueId> = Vec::new();
        for consumer in &state.consumers {
            let key = ConsumerKey {
                conn,
                channel: ch,
                tag: consumer.tag.clone(),
            };
            if let Some(q) = self.replicated.queues.get_mut(&consumer.queue) {
                q.remove_consumer(&key);
            }
            touched.push(consumer.queue);
        }
        // Requeue newest first so each lands in front of the ones after it.
        let now = self.local.now_ms;
        for (_, u) in state.unacked.into_iter().rev() {
            if let Some(q) = self.replicated.queues.get_mut(&u.queue) {
                q.local.unacked -= 1;
                if !q.requeue(u.qm) {
                    self.local.dirty.push(u.queue);
                }
                touched.push(u.queue);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &id in &touched {
            self.after_requeue(id, now);
        }
        for id in touched {
            self.after_consumer_change(id, fx);
        }
        // What the requeues dropped (expired, over a limit, past a delivery limit).
        self.settle(fx);
    }

    /// After consumers left or messages returned: auto-delete, or dispatch.
    fn after_consumer_change(&mut self, id: QueueId, fx: &mut Vec<Effect>) {
        let now = self.local.now_ms;
        let Some(q) = self.replicated.queues.get_mut(&id) else {
            return;
        };
        if q.local.consumers.is_empty() {
            q.last_used = now;
        }
        if q.auto_delete && q.local.had_consumers && q.local.consumers.is_empty() {
            self.delete_queue(id, fx);
        } else {
            self.dispatch(id, fx);
        }
    }

    fn channel(&mut self, conn: ConnId, ch: u16) -> Result<&mut ChannelState, AmqpError> {
        self.local
            .conns
            .get_mut(&conn)
            .and_then(|c| c.channels.get_mut(&ch))
            .ok_or_else(|| AmqpError::channel_error(format!("channel {ch} is not open")))
    }

    fn resolve_dest(&self, vhost: &str, d: &BindingDest) -> Result<Dest, AmqpError> {
        Ok(match d {
            BindingDest::Queue(name) => Dest::Queue(
                self.vhost(vhost)?
                    .queues
                    .get(name)
                    .copied()
                    .ok_or_else(|| AmqpError::not_found(format!("no {}", qname(vhost, name))))?,
            ),
            // A binding to an exchange that is not there is refused, as one to a missing
            // queue is (the live path checks first; a replayed op must not make one either).
            BindingDest::Exchange(name) => {
                if !self.vhost(vhost)?.exchanges.contains_key(name) {
                    return Err(AmqpError::not_found(format!("no {}", xname(vhost, name))));
                }
                Dest::Exchange(name.clone())
            }
        })
    }

    // ---------------------------------------------------------------- exchanges

    pub fn exchange_declare(
        &mut self,
        vhost: &str,
        d: ExchangeDeclare,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        if d.name.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        let v = self.vhost(vhost)?;
        if d.passive {
            return match v.exchanges.get(&d.name) {
                Some(_) => Ok(()),
                None => Err(AmqpError::not_found(format!(
                    "no {}",
                    xname(vhost, &d.name)
                ))),
            };
        }
        let Some(kind) = ExchangeKind::parse(&d.kind) else {
            return Err(AmqpError::command_invalid(format!(
                "unknown exchange type '{}'",
                d.kind
            )));
        };
        if let Some(x) = v.exchanges.get(&d.name) {
            let what = xname(vhost, &d.name);
            let check = |arg: &str, received: String, current: String| {
                if received == current {
                    Ok(())
                } else {
                    Err(AmqpError::precondition_failed(format!(
                        "inequivalent arg '{arg}' for {what}: received '{received}' but current is '{current}'"
                    )))
                }
            };
            check("type", d.kind.clone(), x.kind.as_str().to_string())?;
            check("durable", d.durable.to_string(), x.durable.to_string())?;
            check(
                "auto_delete",
                d.auto_delete.to_string(),
                x.auto_delete.to_string(),
            )?;
            check("internal", d.internal.to_string(), x.internal.to_string())?;
            if let Some(e) = args::inequivalent(
                "alternate-exchange",
                &what,
                d.arguments.inner().get("alternate-exchange"),
                x.arguments.inner().get("alternate-exchange"),
            ) {
                return Err(e);
            }
            return Ok(());
        }
        if d.name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "exchange name '{}' contains reserved prefix 'amq.*'",
                d.name
            )));
        }
        self.apply(
            &Op::DeclareExchange {
                vhost: vhost.to_string(),
                name: d.name,
                kind: kind.as_str().to_string(),
                durable: d.durable,
                auto_delete: d.auto_delete,
                internal: d.internal,
                arguments: encode_table(&d.arguments),
            },
            fx,
        )
    }

    pub fn exchange_delete(
        &mut self,
        vhost: &str,
        name: &str,
        if_unused: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        if name.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        if name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "deletion of system {} not allowed",
                xname(vhost, name)
            )));
        }
        let v = self.vhost(vhost)?;
        let Some(x) = v.exchanges.get(name) else {
            return Err(AmqpError::not_found(format!("no {}", xname(vhost, name))));
        };
        if if_unused && !x.bindings.is_empty() {
            return Err(AmqpError::precondition_failed(format!(
                "{} in use",
                xname(vhost, name)
            )));
        }
        self.apply(
            &Op::DeleteExchange {
                vhost: vhost.to_string(),
                name: name.to_string(),
            },
            fx,
        )
    }

    /// exchange.bind / exchange.unbind (RabbitMQ's exchange-to-exchange bindings).
    #[allow(clippy::too_many_arguments)]
    pub fn exchange_bind(
        &mut self,
        vhost: &str,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: &FieldTable,
        bind: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        if source.is_empty() || destination.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        let v = self.vhost(vhost)?;
        for x in [destination, source] {
            if !v.exchanges.contains_key(x) {
                if !bind {
                    return Ok(());
                }
                return Err(AmqpError::not_found(format!("no {}", xname(vhost, x))));
            }
        }
        if bind {
            self.validate_binding(vhost, source, arguments)?;
        }
        let op_dest = BindingDest::Exchange(destination.to_string());
        let (routing_key, arguments) = (routing_key.to_string(), encode_table(arguments));
        let op = if bind {
            Op::Bind {
                vhost: vhost.to_string(),
                source: source.to_string(),
                destination: op_dest,
                routing_key,
                arguments,
            }
        } else {
            Op::Unbind {
                vhost: vhost.to_string(),
                source: source.to_string(),
                destination: op_dest,
                routing_key,
                arguments,
            }
        };
        self.apply(&op, fx)
    }

    /// Binding arguments a source exchange type checks (headers: x-match), with RabbitMQ's texts.
    fn validate_binding(
        &self,
        vhost: &str,
        source: &str,
        arguments: &FieldTable,
    ) -> Result<(), AmqpError> {
        let Some(x) = self.vhost(vhost)?.exchanges.get(source) else {
            return Ok(());
        };
        if x.kind != ExchangeKind::Headers {
            return Ok(());
        }
        match arguments.inner().get("x-match") {
            None => Ok(()),
            Some(AMQPValue::LongString(s)) => {
                let v = String::from_utf8_lossy(s.as_bytes());
                if matches!(v.as_ref(), "all" | "any" | "all-with-x" | "any-with-x") {
                    Ok(())
                } else {
                    Err(AmqpError::precondition_failed(format!(
                        "Invalid x-match field value <<\"{v}\">>; expected all, any, all-with-x, or any-with-x"
                    )))
                }
            }
            Some(other) => Err(AmqpError::precondition_failed(format!(
                "Invalid x-match field type {} (value {}); expected longstr",
                type_name(other),
                show_value(Some(other)).trim_matches('\'')
            ))),
        }
    }

    // ---------------------------------------------------------------- queues

    fn queue_id(&self, vhost: &str, name: &str) -> Result<QueueId, AmqpError> {
        self.vhost(vhost)?
            .queues
            .get(name)
            .copied()
            .ok_or_else(|| AmqpError::not_found(format!("no {}", qname(vhost, name))))
    }

    /// A queue this connection may use: exists, and is not another connection's exclusive queue.
    fn usable_queue(&self, conn: ConnId, vhost: &str, name: &str) -> Result<QueueId, AmqpError> {
        let id = self.queue_id(vhost, name)?;
        self.check_exclusive(conn, id)?;
        Ok(id)
    }

    fn check_exclusive(&self, conn: ConnId, id: QueueId) -> Result<(), AmqpError> {
        if let Some(q) = self.replicated.queues.get(&id) {
            if q.exclusive && q.owner != Some(conn) {
                return Err(AmqpError::resource_locked(format!(
                    "cannot obtain exclusive access to locked {}. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration.",
                    qname(&q.vhost, &q.name)
                )));
            }
        }
        Ok(())
    }

    /// Counts for declare-ok (expired heads are dropped first, so they are not counted).
    fn info(&mut self, id: QueueId) -> QueueInfo {
        let now = self.local.now_ms;
        let Some(q) = self.replicated.queues.get_mut(&id) else {
            return QueueInfo {
                name: String::new(),
                message_count: 0,
                consumer_count: 0,
            };
        };
        if q.drop_expired(now) > 0 {
            self.local.dirty.push(id);
        }
        if q.wants_read() {
            self.local.wanting.push(id);
        }
        q.last_used = now;
        QueueInfo {
            name: q.name.to_string(),
            message_count: q.message_count() as u32,
            consumer_count: q.local.consumers.len() as u32,
        }
    }

    pub fn queue_declare(
        &mut self,
        conn: ConnId,
        vhost: &str,
        mut d: QueueDeclare,
        fx: &mut Vec<Effect>,
    ) -> Result<QueueInfo, AmqpError> {
        // Direct reply-to's pseudo-queue always "exists" with one consumer, as in RabbitMQ.
        if d.name == REPLY_TO
            || (d.passive
                && d.name
                    .strip_prefix("amq.rabbitmq.reply-to.")
                    .is_some_and(|s| self.local.reply_to.contains_key(s)))
        {
            return Ok(QueueInfo {
                name: d.name,
                message_count: 0,
                consumer_count: 1,
            });
        }
        if d.passive {
            // RabbitMQ: a passive declare with an empty name names the channel's last queue;
            // the caller resolves that before calling us.
            let id = self.usable_queue(conn, vhost, &d.name)?;
            return Ok(self.info(id));
        }
        if d.name.is_empty() {
            d.name = self
                .local
                .server_name
                .take()
                .unwrap_or_else(|| random_name("amq.gen-"));
        } else if d.name.starts_with("amq.") {
            return Err(AmqpError::access_refused(format!(
                "queue name '{}' contains reserved prefix 'amq.*'",
                d.name
            )));
        }
        if let Some(&id) = self.vhost(vhost)?.queues.get(&d.name) {
            self.check_exclusive(conn, id)?;
            let q = &self.replicated.queues[&id];
            let what = qname(vhost, &d.name);
            for (arg, received, current) in [
                ("durable", d.durable, q.durable),
                ("auto_delete", d.auto_delete, q.auto_delete),
            ] {
                if received != current {
                    return Err(AmqpError::precondition_failed(format!(
                        "inequivalent arg '{arg}' for {what}: received '{received}' but current is '{current}'"
                    )));
                }
            }
            if d.exclusive != q.exclusive {
                return Err(AmqpError::resource_locked(format!(
                    "cannot obtain exclusive access to locked {what}. It could be originally declared on another connection or the exclusive property value does not match that of the original declaration."
                )));
            }
            args::check_equivalent(&what, &d.arguments, &q.arguments)?;
            return Ok(self.info(id));
        }
        // A vhost's max-queues counts every queue in it (exclusive and server-named too).
        if let Some(max) = self.vhost_limit(vhost, "max-queues") {
            if self.vhost(vhost)?.queues.len() as u64 >= max {
                return Err(AmqpError::precondition_failed(format!(
                    "cannot declare queue '{}': queue limit in vhost '{vhost}' ({max}) is reached",
                    d.name
                )));
            }
        }
        args::validate(
            &qname(vhost, &d.name),
            &d.arguments,
            d.durable,
            d.exclusive,
            d.auto_delete,
        )?;
        let name = d.name.clone();
        self.apply(
            &Op::DeclareQueue {
                vhost: vhost.to_string(),
                name: d.name,
                durable: d.durable,
                exclusive: d.exclusive,
                auto_delete: d.auto_delete,
                arguments: encode_table(&d.arguments),
            },
            fx,
        )?;
        let id = self.queue_id(vhost, &name)?;
        if d.exclusive {
            if let Some(q) = self.replicated.queues.get_mut(&id) {
                q.owner = Some(conn);
            }
        }
        Ok(self.info(id))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn queue_bind(
        &mut self,
        conn: ConnId,
        vhost: &str,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: &FieldTable,
        bind: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        if exchange.is_empty() {
            return Err(AmqpError::access_refused(
                "operation not permitted on the default exchange",
            ));
        }
        let exists = self.vhost(vhost)?.exchanges.contains_key(exchange);
        if !bind && (!exists || self.queue_id(vhost, queue).is_err()) {
            // RabbitMQ 3.x: unbinding from or to something missing is a no-op.
            return Ok(());
        }
        self.usable_queue(conn, vhost, queue)?;
        if !exists {
            return Err(AmqpError::not_found(format!(
                "no {}",
                xname(vhost, exchange)
            )));
        }
        if bind {
            self.validate_binding(vhost, exchange, arguments)?;
        }
        let dest = BindingDest::Queue(queue.to_string());
        let (routing_key, arguments) = (routing_key.to_string(), encode_table(arguments));
        let op = if bind {
            Op::Bind {
                vhost: vhost.to_string(),
                source: exchange.to_string(),
                destination: dest,
                routing_key,
                arguments,
            }
        } else {
            Op::Unbind {
                vhost: vhost.to_string(),
                source: exchange.to_string(),
                destination: dest,
                routing_key,
                arguments,
            }
        };
        self.apply(&op, fx)
    }

    pub fn queue_purge(
        &mut self,
        conn: ConnId,
        vhost: &str,
        queue: &str,
        fx: &mut Vec<Effect>,
    ) -> Result<u32, AmqpError> {
        let id = self.usable_queue(conn, vhost, queue)?;
        let Some(q) = self.replicated.queues.get(&id) else {
            return Ok(0);
        };
        let count = q.message_count();
        let op = Op::Purge {
            vhost: q.vhost.clone(),
            queue: q.name.clone(),
        };
        self.apply(&op, fx)?;
        Ok(count as u32)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn queue_delete(
        &mut self,
        conn: ConnId,
        vhost: &str,
        queue: &str,
        if_unused: bool,
        if_empty: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<u32, AmqpError> {
        let id = match self.queue_id(vhost, queue) {
            Ok(id) => id,
            // RabbitMQ answers delete-ok for a queue that does not exist.
            Err(_) => return Ok(0),
        };
        self.check_exclusive(conn, id)?;
        let q = &self.replicated.queues[&id];
        if if_unused && !q.local.consumers.is_empty() {
            return Err(AmqpError::precondition_failed(format!(
                "{} in use",
                qname(vhost, queue)
            )));
        }
        if if_empty && !q.is_empty() {
            return Err(AmqpError::precondition_failed(format!(
                "{} not empty",
                qname(vhost, queue)
            )));
        }
        let count = q.message_count() as u32;
        self.apply(
            &Op::DeleteQueue {
                vhost: vhost.to_string(),
                name: queue.to_string(),
            },
            fx,
        )?;
        Ok(count)
    }

    // ---------------------------------------------------------------- publish

    /// Route a message from `exchange` and enqueue it. Returns the number of queues it reached.
    pub fn publish(
        &mut self,
        vhost: &str,
        msg: Arc<Message>,
        fx: &mut Vec<Effect>,
    ) -> Result<PublishOutcome, AmqpError> {
        // CC and BCC headers add routing keys; BCC is removed from the message (RabbitMQ).
        let headers = msg.properties.headers().as_ref();
        for name in ["CC", "BCC"] {
            match headers.and_then(|h| h.inner().get(name)) {
                None | Some(AMQPValue::FieldArray(_)) => {}
                Some(other) => {
                    return Err(AmqpError::precondition_failed(format!(
                        "invalid message: {{unacceptable_type_in_header,\"{name}\",{}}}",
                        type_name(other)
                    )));
                }
            }
        }
        let cc = deadletter::header_keys(headers, "CC");
        let bcc = deadletter::header_keys(headers, "BCC");
        let has_bcc = headers.is_some_and(|h| h.contains_key("BCC"));
        let msg = if has_bcc {
            let mut h = headers.map(|h| h.inner().clone()).unwrap_or_default();
            h.remove("BCC");
            let props = deadletter::rebuild(&msg.properties, Some(FieldTable::from(h)), true);
            Arc::new(Message {
                exchange: msg.exchange.clone(),
                routing_key: msg.routing_key.clone(),
                raw_properties: warren_protocol::codec::encode_properties(&props),
                properties: props,
                body: msg.body.clone(),
                expiration: msg.expiration,
            })
        } else {
            msg
        };
        if msg.exchange.as_ref().is_empty() {
            if let Some(suffix) = msg.routing_key.strip_prefix("amq.rabbitmq.reply-to.") {
                let delivered = self.deliver_reply(suffix, &msg, fx);
                return Ok(PublishOutcome {
                    routed: delivered as usize,
                    rejected: false,
                    staged: false,
                    held: Targets::new(),
                });
            }
        }
        let targets = {
            let mut keys: SmallVec<[&str; 4]> = SmallVec::new();
            keys.push(msg.routing_key.as_ref());
            keys.extend(cc.iter().chain(&bcc).map(String::as_str));
            self.route_keys(vhost, msg.exchange.as_ref(), &keys, &msg, true)?
        };
        let outcome = self.deliver(&targets, msg, fx);
        self.settle(fx);
        Ok(outcome)
    }

    /// Enqueue a message into `targets`, minding each queue's limits; journals it for the
    /// queues that store it.
    fn deliver(
        &mut self,
        targets: &[QueueId],
        msg: Arc<Message>,
        fx: &mut Vec<Effect>,
    ) -> PublishOutcome {
        let id = self.replicated.next_message_id;
        self.replicated.next_message_id += 1;
        let total = targets.len();
        let size = msg.body.len() as u64;
        let mut rejected = false;
        let mut accepted = Targets::new();
        for t in targets {
            let Some(q) = self.replicated.queues.get_mut(t) else {
                continue;
            };
            if q.overflow != Overflow::DropHead && q.would_overflow(size) {
                rejected = true;
                if q.overflow == Overflow::RejectPublishDlx {
                    q.dropped.push((
                        QueuedMessage {
                            id,
                            msg: msg.clone(),
                            redelivered: false,
                            expires_at: None,
                            returns: 0,
                            stored: false,
                            batch: 0,
                        },
                        DropReason::MaxLen,
                    ));
                    self.local.dirty.push(*t);
                }
                continue;
            }
            accepted.push(*t);
        }
        let targets = &accepted[..];
        // The queues that keep it (and replicate it) get it through `apply`, as a replica
        // does; the others (transient messages, queues that are not stored) are this
        // broker's alone.
        let (mut kept, mut kept_ids, mut local) = (
            warren_storage::QueueLevels::new(),
            Targets::new(),
            Targets::new(),
        );
        let mut vhost = None;
        for t in targets {
            let Some(q) = self.replicated.queues.get(t) else {
                continue;
            };
            if q.keeps(&msg) {
                // Names shared with the queues: no copy per message.
                vhost.get_or_insert_with(|| q.vhost.clone());
                kept.push((q.name.clone(), q.level(&msg) as u8));
                kept_ids.push(*t);
            } else {
                local.push(*t);
            }
        }
        let (mut staged, mut held) = (false, Targets::new());
        if let Some(vhost) = vhost {
            let op = Op::Enqueue {
                vhost,
                queues: kept,
                id,
                timestamp_ms: self.local.now_ms,
                exchange: msg.exchange.clone(),
                routing_key: msg.routing_key.clone(),
                properties: msg.raw_properties.clone(),
                body: msg.body.clone(),
            };
            (staged, held) = self.apply_enqueue(op, &kept_ids, msg.clone());
        }
        if !local.is_empty() {
            let (s, h) = self.enqueue(&local, id, self.local.now_ms, msg.clone());
            staged |= s;
            held.extend(h);
        }
        self.decide_enqueued(targets, &msg, fx);
        PublishOutcome {
            routed: total,
            rejected,
            staged,
            held,
        }
    }

    /// The queues a message goes to (each once), following exchange-to-exchange bindings.
    pub fn route(&self, vhost: &str, exchange: &str, msg: &Message) -> Result<Targets, AmqpError> {
        self.route_keys(vhost, exchange, &[msg.routing_key.as_ref()], msg, true)
    }

    /// Route with several routing keys (CC/BCC, dead-lettering); each queue once. The internal
    /// check applies to client publishes only.
    pub fn route_keys(
        &self,
        vhost: &str,
        exchange: &str,
        keys: &[&str],
        msg: &Message,
        check_internal: bool,
    ) -> Result<Targets, AmqpError> {
        let mut all = Targets::new();
        self.route_all(vhost, exchange, keys, msg, check_internal, &mut all)?;
        if all.len() > 1 {
            all.sort_unstable();
            all.dedup();
        }
        Ok(all)
    }

    /// Every exchange the message reaches (through exchange-to-exchange bindings and alternate
    /// exchanges) is matched against all the keys at once (routing key, CC, BCC), as in
    /// RabbitMQ: a CC key can take it through one binding and the routing key through the next.
    fn route_all(
        &self,
        vhost: &str,
        exchange: &str,
        keys: &[&str],
        msg: &Message,
        check_internal: bool,
        queues: &mut Targets,
    ) -> Result<(), AmqpError> {
        let v = self.vhost(vhost)?;
        if exchange.is_empty() {
            // The default exchange (every vhost has it, never internal), before any map
            // lookup of "": comparing the empty name with the stored one calls memcmp with
            // Rust's dangling pointer of an empty string, and the CPU's masked load of that
            // address takes a fault-suppression assist: 10% of S1's CPU went there.
            for key in keys {
                if let Some(&id) = v.queues.get(*key) {
                    queues.push(id);
                }
            }
            return Ok(());
        }
        let Some(x) = v.exchanges.get(exchange) else {
            return Err(AmqpError::not_found(format!(
                "no {}",
                xname(vhost, exchange)
            )));
        };
        if x.internal && check_internal {
            return Err(AmqpError::access_refused(format!(
                "cannot publish to internal {}",
                xname(vhost, exchange)
            )));
        }
        let headers = msg.properties.headers().as_ref();
        // CC and BCC add keys as the client likes (thousands, repeated): each distinct key
        // routes once, and fanout and headers exchanges, which ignore keys, route once.
        let mut distinct: SmallVec<[&str; 4]> = SmallVec::from_slice(keys);
        if distinct.len() > 1 {
            distinct.sort_unstable();
            distinct.dedup();
        }
        let mut visited = Visited::default();
        visited.insert(exchange);
        let mut pending: SmallVec<[&Exchange; 4]> = SmallVec::new();
        pending.push(x);
        let mut dests: SmallVec<[&Dest; 16]> = SmallVec::new();
        while let Some(x) = pending.pop() {
            dests.clear();
            let keys = match x.kind {
                ExchangeKind::Fanout | ExchangeKind::Headers => &distinct[..distinct.len().min(1)],
                ExchangeKind::Direct | ExchangeKind::Topic => &distinct[..],
            };
            for key in keys {
                x.route(key, headers, &mut dests);
            }
            if dests.is_empty() {
                // RabbitMQ's rule: an exchange whose own bindings match nothing hands the message
                // to its alternate exchange (chains followed, cycles cut by `visited`).
                if let Some(ae) = alternate_exchange(&x.arguments) {
                    if visited.insert(ae) {
                        if let Some(next) = v.exchanges.get(ae) {
                            pending.push(next);
                        }
                    }
                }
                continue;
            }
            for d in dests.iter() {
                match d {
                    Dest::Queue(id) => queues.push(*id),
                    Dest::Exchange(name) => {
                        // Cycles in exchange-to-exchange bindings are cut here.
                        if visited.insert(name.as_str()) {
                            if let Some(next) = v.exchanges.get(name) {
                                pending.push(next);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Put a message (published at `at` ms) into queues: the change alone (`exec` of an
    /// `Op::Enqueue`, and a publish to queues that do not keep it). What the broker serving
    /// clients decides next is `decide_enqueued`. Returns whether its publisher should wait
    /// for the store (`PublishOutcome::staged`) and the queues that hold it past their window
    /// (`PublishOutcome::held`).
    fn enqueue(
        &mut self,
        targets: &[QueueId],
        id: u64,
        at: u64,
        msg: Arc<Message>,
    ) -> (bool, Targets) {
        let mut any_staged = false;
        let mut held = Targets::new();
        for qid in targets {
            let Some(q) = self.replicated.queues.get_mut(qid) else {
                continue;
            };
            let ttl = q.ttl(&msg);
            let expires_at = ttl.map(|t| at.saturating_add(t));
            let stored = self.log.enabled() && q.keeps(&msg);
            let batch = self.log.seq() + 1;
            let qm = QueuedMessage {
                id,
                msg: msg.clone(),
                redelivered: false,
                expires_at,
                returns: 0,
                stored,
                batch: if stored { batch } else { 0 },
            };
            let pushed = q.push(qm, batch, at);
            let staged = pushed == Pushed::Staged;
            if pushed == Pushed::Held {
                held.push(*qid);
            }
            if staged {
                self.local.staging.insert(*qid);
                any_staged |= q.pressure() || !q.local.consumers.is_empty();
            }
            if staged && !stored {
                // Past the window: the store keeps it until the queue drains to it.
                q.spilled = true;
                apply::write_local(
                    &mut self.log,
                    Op::Spill {
                        vhost: q.vhost.clone(),
                        queue: q.name.clone(),
                        key: warren_storage::message_key(q.level(&msg) as u8, id),
                        timestamp_ms: at,
                        exchange: msg.exchange.clone(),
                        routing_key: msg.routing_key.clone(),
                        properties: msg.raw_properties.clone(),
                        body: msg.body.clone(),
                    },
                );
            }
            if expires_at.is_some() {
                self.local.expiring.insert(*qid);
            }
        }
        (any_staged, held)
    }

    /// What the broker serving clients decides once a message is in `targets` (replicas get
    /// each decision as an op of its own): hand it to consumers, then apply the queues'
    /// TTL-0 and drop-head rules (what they drop is settled by the caller).
    fn decide_enqueued(&mut self, targets: &[QueueId], msg: &Message, fx: &mut Vec<Effect>) {
        let at = self.local.now_ms;
        for qid in targets {
            self.dispatch(*qid, fx);
            if let Some(q) = self.replicated.queues.get_mut(qid) {
                // A message whose TTL is 0 reaches a consumer that is ready now, or nobody.
                let mut dropped = if q.ttl(msg) == Some(0) {
                    q.drop_expired(at)
                } else {
                    0
                };
                // drop-head: the new message is in; the oldest go until within the limits.
                if q.overflow == Overflow::DropHead {
                    dropped += q.trim_to_limits();
                    // The next head asked for ahead, read outside the lock (issue 13 point 5).
                    if let Some(plan) = q.prefetch_read() {
                        ReadRequest::ask(*qid, q, plan, at, fx);
                    }
                }
                if dropped > 0 {
                    self.local.dirty.push(*qid);
                }
                if q.wants_read() {
                    self.local.wanting.push(*qid);
                }
            }
        }
    }

    /// Whether a publisher on connection `conn` held by `queues` (`PublishOutcome::held`)
    /// should go on waiting. Not for a queue consumed on that same connection: its acks come
    /// in on the connection that would stop reading.
    pub fn holding(&self, conn: ConnId, queues: &[QueueId]) -> bool {
        queues.iter().any(|q| {
            self.replicated.queues.get(q).is_some_and(|q| {
                q.holding(self.local.now_ms) && q.local.consumers.iter().all(|c| c.key.conn != conn)
            })
        })
    }

    // ---------------------------------------------------------------- consumers

    #[allow(clippy::too_many_arguments)]
    pub fn consume(
        &mut self,
        conn: ConnId,
        ch: u16,
        vhost: &str,
        queue: &str,
        tag: &str,
        no_ack: bool,
        exclusive: bool,
        arguments: &FieldTable,
        fx: &mut Vec<Effect>,
    ) -> Result<String, AmqpError> {
        if queue == REPLY_TO {
            return self.consume_replies(conn, ch, tag, no_ack);
        }
        let id = self.usable_queue(conn, vhost, queue)?;
        let priority = match arguments.inner().get("x-priority") {
            None => 0,
            Some(v) => match args::int_value(v) {
                Some(p) => p.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
                None => {
                    return Err(AmqpError::precondition_failed(format!(
                        "invalid arg 'x-priority' for {}: \"expected integer, got {}\"",
                        qname(vhost, queue),
                        type_name(v)
                    )));
                }
            },
        };
        let tag = if tag.is_empty() {
            random_name("amq.ctag-")
        } else {
            tag.to_string()
        };
        let state = self.channel(conn, ch)?;
        if state.consumers.iter().any(|c| *c.tag == *tag) {
            return Err(AmqpError::not_allowed(format!(
                "attempt to reuse consumer tag '{tag}'"
            )));
        }
        let q = &self.replicated.queues[&id];
        // Quorum queues have no channel-wide prefetch (RabbitMQ: a connection error).
        if q.quorum && self.channel(conn, ch)?.prefetch_channel > 0 {
            return Err(AmqpError::not_implemented(format!(
                "{} does not support global qos",
                qname(vhost, queue)
            )));
        }
        let q = &self.replicated.queues[&id];
        if q.local.exclusive_consumer.is_some() || (exclusive && !q.local.consumers.is_empty()) {
            return Err(AmqpError::access_refused(format!(
                "{} in exclusive use",
                qname(vhost, queue)
            )));
        }
        let state = self.channel(conn, ch)?;
        let prefetch = state.prefetch_consumer;
        let arc_tag: Arc<str> = Arc::from(tag.as_str());
        state.consumers.push(Consumer {
            tag: arc_tag.clone(),
            queue: id,
            no_ack,
            prefetch,
            unacked: 0,
        });
        let key = ConsumerKey {
            conn,
            channel: ch,
            tag: arc_tag,
        };
        let now = self.local.now_ms;
        if let Some(q) = self.replicated.queues.get_mut(&id) {
            if exclusive {
                q.local.exclusive_consumer = Some(key.clone());
            }
            q.add_consumer(QueueConsumer { key, priority });
            q.local.had_consumers = true;
            q.last_used = now;
        }
        self.dispatch(id, fx);
        self.settle(fx);
        Ok(tag)
    }

    /// Direct reply-to: subscribe this channel to the replies sent to its address.
    fn consume_replies(
        &mut self,
        conn: ConnId,
        ch: u16,
        tag: &str,
        no_ack: bool,
    ) -> Result<String, AmqpError> {
        if !no_ack {
            return Err(AmqpError::precondition_failed(
                "reply consumer cannot acknowledge",
            ));
        }
        let tag = if tag.is_empty() {
            random_name("amq.ctag-")
        } else {
            tag.to_string()
        };
        let state = self.channel(conn, ch)?;
        if state.reply_consumer.is_some() {
            return Err(AmqpError::precondition_failed("reply consumer already set"));
        }
        if state.consumers.iter().any(|c| *c.tag == *tag) {
            return Err(AmqpError::not_allowed(format!(
                "attempt to reuse consumer tag '{tag}'"
            )));
        }
        let suffix = random_name("");
        state.reply_consumer = Some((Arc::from(tag.as_str()), suffix.clone()));
        self.local.reply_to.insert(suffix, (conn, ch));
        Ok(tag)
    }

    /// The address a request published with `reply_to = amq.rabbitmq.reply-to` on this channel
    /// carries instead (406 when the channel has no reply consumer, as RabbitMQ).
    pub fn reply_address(&mut self, conn: ConnId, ch: u16) -> Result<String, AmqpError> {
        match &self.channel(conn, ch)?.reply_consumer {
            Some((_, suffix)) => Ok(format!("{REPLY_TO}.{suffix}")),
            None => Err(AmqpError::precondition_failed(
                "fast reply consumer does not exist",
            )),
        }
    }

    /// A reply published to `amq.rabbitmq.reply-to.<suffix>` on the default exchange goes
    /// straight to the requesting channel's reply consumer. Returns whether it was delivered.
    fn deliver_reply(&mut self, suffix: &str, msg: &Arc<Message>, fx: &mut Vec<Effect>) -> bool {
        let Some(&(conn, ch)) = self.local.reply_to.get(suffix) else {
            return false;
        };
        let Some(state) = self
            .local
            .conns
            .get_mut(&conn)
            .and_then(|c| c.channels.get_mut(&ch))
        else {
            return false;
        };
        let Some((tag, _)) = &state.reply_consumer else {
            return false;
        };
        let delivery_tag = state.next_tag;
        state.next_tag += 1;
        fx.push(Effect::Deliver {
            conn,
            channel: ch,
            consumer_tag: tag.clone(),
            delivery_tag,
            redelivered: false,
            msg: msg.clone(),
            batch: 0,
        });
        true
    }

    /// basic.cancel; returns whether the consumer existed.
    pub fn cancel(&mut self, conn: ConnId, ch: u16, tag: &str, fx: &mut Vec<Effect>) -> bool {
        let Ok(state) = self.channel(conn, ch) else {
            return false;
        };
        if state
            .reply_consumer
            .as_ref()
            .is_some_and(|(t, _)| &**t == tag)
        {
            if let Some((_, suffix)) = state.reply_consumer.take() {
                self.local.reply_to.remove(&suffix);
            }
            return true;
        }
        let Some(pos) = state.consumers.iter().position(|c| &*c.tag == tag) else {
            return false;
        };
        let c = state.consumers.remove(pos);
        // Its unacked messages stay unacked on the channel (as in RabbitMQ); they no longer count
        // against a consumer limit.
        let key = ConsumerKey {
            conn,
            channel: ch,
            tag: c.tag.clone(),
        };
        if let Some(q) = self.replicated.queues.get_mut(&c.queue) {
            q.remove_consumer(&key);
        }
        self.after_consumer_change(c.queue, fx);
        true
    }

    /// basic.qos. prefetch_size must be 0 (the caller checks).
    pub fn qos(&mut self, conn: ConnId, ch: u16, count: u16, global: bool, fx: &mut Vec<Effect>) {
        let Ok(state) = self.channel(conn, ch) else {
            return;
        };
        if global {
            state.prefetch_channel = count;
        } else {
            state.prefetch_consumer = count;
        }
        let queues: Vec<QueueId> = state.consumers.iter().map(|c| c.queue).collect();
        for q in queues {
            self.dispatch(q, fx);
        }
    }

    /// channel.flow from the client.
    pub fn flow(&mut self, conn: ConnId, ch: u16, active: bool, fx: &mut Vec<Effect>) {
        let Ok(state) = self.channel(conn, ch) else {
            return;
        };
        state.flow = active;
        if active {
            let queues: Vec<QueueId> = state.consumers.iter().map(|c| c.queue).collect();
            for q in queues {
                self.dispatch(q, fx);
            }
        }
    }

    /// The connection's writer flushed `bytes`: give them back to its delivery budget and resume
    /// deliveries that were held back.
    pub fn refill(&mut self, conn: ConnId, bytes: usize, fx: &mut Vec<Effect>) {
        let Some(c) = self.local.conns.get_mut(&conn) else {
            return;
        };
        c.budget = (c.budget + bytes as i64).min(DELIVERY_BUDGET);
        if c.throttled && c.budget > 0 {
            c.throttled = false;
            let mut queues: Vec<QueueId> = c
                .channels
                .values()
                .flat_map(|s| s.consumers.iter().map(|c| c.queue))
                .collect();
            queues.sort_unstable();
            queues.dedup();
            for q in queues {
                self.dispatch(q, fx);
            }
        }
    }

    /// Hand ready messages of a queue to consumers with credit, round-robin.
    fn dispatch(&mut self, id: QueueId, fx: &mut Vec<Effect>) {
        let now = self.local.now_ms;
        let Broker {
            replicated: Replicated { queues, .. },
            local: Local { conns, dirty, .. },
            ..
        } = self;
        let Some(q) = queues.get_mut(&id) else {
            return;
        };
        // What consumers without acks take leaves the store (recorded after the loop).
        let mut gone = Removals::default();
        // With the node reading for us, nothing here reads the store: a head that must be
        // read first is asked for (`Effect::Read`) and deliveries wait for `read_done`.
        let asks = q.async_reads();
        while !q.is_empty() && !q.local.consumers.is_empty() {
            // Expired messages never reach a consumer (strictly past their time, so a TTL-0
            // message can still go to a consumer that is ready when it arrives).
            let reads = if asks { 0 } else { usize::MAX };
            if q.drop_expired_reading(now.saturating_sub(1), reads) > 0 {
                dirty.push(id);
            }
            if q.is_empty() {
                break;
            }
            if asks {
                if let Some(plan) = q.head_read() {
                    // After a failed read the timer asks again (`retry_reads`), not every
                    // dispatch at once.
                    if !q.read_failed {
                        ReadRequest::ask(id, q, plan, now, fx);
                    }
                    break;
                }
                if q.is_empty() {
                    break;
                }
            }
            let n = q.local.consumers.len();
            let mut chosen = None;
            // Plain queues try consumers round-robin from `next`; with consumer priorities or a
            // single active consumer the queue orders them.
            let ordered = q.single_active || q.local.consumers.iter().any(|c| c.priority != 0);
            let order: Vec<usize> = if ordered { q.candidates() } else { Vec::new() };
            let (next, count) = (q.local.next, if ordered { order.len() } else { n });
            let indexes = (0..count).map(|i| if ordered { order[i] } else { (next + i) % n });
            for idx in indexes {
                let key = &q.local.consumers[idx].key;
                let Some(conn) = conns.get(&key.conn) else {
                    continue;
                };
                if conn.budget <= 0 {
                    continue;
                }
                let Some(ch) = conn.channels.get(&key.channel) else {
                    continue;
                };
                if !ch.flow {
                    continue;
                }
                let Some(c) = ch.consumers.iter().find(|c| *c.tag == *key.tag) else {
                    continue;
                };
                if !c.no_ack && c.prefetch > 0 && c.unacked >= c.prefetch as u32 {
                    continue;
                }
                // The channel-wide limit (basic.qos global) holds back every consumer of the
                // channel while it is reached, no-ack ones included (they do not count against
                // it), as RabbitMQ's limiter does.
                if ch.prefetch_channel > 0 && ch.consumer_unacked >= ch.prefetch_channel as u32 {
                    continue;
                }
                chosen = Some(idx);
                break;
            }
            let Some(idx) = chosen else {
                break;
            };
            q.local.next = (idx + 1) % n;
            let key = q.local.consumers[idx].key.clone();
            let Some(qm) = q.pop() else {
                break;
            };
            let Some(conn) = conns.get_mut(&key.conn) else {
                break;
            };
            conn.budget -= (qm.msg.body.len() + qm.msg.raw_properties.len() + 128) as i64;
            if conn.budget <= 0 && !conn.throttled {
                conn.throttled = true;
                fx.push(Effect::Throttled(key.conn));
            }
            let Some(ch) = conn.channels.get_mut(&key.channel) else {
                break;
            };
            let tag = ch.next_tag;
            ch.next_tag += 1;
            let Some(c) = ch.consumers.iter_mut().find(|c| *c.tag == *key.tag) else {
                break;
            };
            let consumer_tag = c.tag.clone();
            let redelivered = qm.redelivered;
            let batch = qm.batch;
            let msg = q.outgoing(&qm);
            if c.no_ack {
                // Delivered without ack: gone from the queue, so gone from the store.
                gone.add(id, q, &qm);
            } else {
                c.unacked += 1;
                ch.consumer_unacked += 1;
                q.local.unacked += 1;
                ch.unacked.insert(
                    tag,
                    Unacked {
                        queue: id,
                        qm,
                        consumer: Some(consumer_tag.clone()),
                        delivered_at: now,
                    },
                );
            }
            fx.push(Effect::Deliver {
                conn: key.conn,
                channel: key.channel,
                consumer_tag,
                delivery_tag: tag,
                redelivered,
                msg,
                batch,
            });
        }
        if q.released() {
            fx.push(Effect::Drained);
        }
        self.removed(gone);
    }

    // ---------------------------------------------------------------- get, ack, reject

    pub fn get(
        &mut self,
        conn: ConnId,
        ch: u16,
        vhost: &str,
        queue: &str,
        no_ack: bool,
    ) -> Result<Option<GetResult>, AmqpError> {
        let id = self.usable_queue(conn, vhost, queue)?;
        let now = self.local.now_ms;
        let Broker {
            replicated: Replicated { queues, .. },
            local: Local { conns, dirty, .. },
            ..
        } = self;
        let Some(q) = queues.get_mut(&id) else {
            return Ok(None);
        };
        q.last_used = now;
        if q.drop_expired(now) > 0 {
            dirty.push(id);
        }
        let state = conns
            .get_mut(&conn)
            .and_then(|c| c.channels.get_mut(&ch))
            .ok_or_else(|| AmqpError::channel_error(format!("channel {ch} is not open")))?;
        let Some(qm) = q.pop() else {
            return Ok(None);
        };
        let tag = state.next_tag;
        state.next_tag += 1;
        let result = GetResult {
            delivery_tag: tag,
            redelivered: qm.redelivered,
            msg: q.outgoing(&qm),
            message_count: q.message_count() as u32,
            batch: qm.batch,
        };
        if no_ack {
            // Got without ack: gone from the queue, so gone from the store.
            let mut gone = Removals::default();
            gone.add(id, q, &qm);
            self.removed(gone);
        } else {
            q.local.unacked += 1;
            state.unacked.insert(
                tag,
                Unacked {
                    queue: id,
                    qm,
                    consumer: None,
                    delivered_at: now,
                },
            );
        }
        Ok(Some(result))
    }

    /// Take acknowledged (or rejected) deliveries off a channel. `tag` 0 with `multiple` means
    /// all of them. Unknown tags are 406, as in RabbitMQ.
    fn take_unacked(
        &mut self,
        conn: ConnId,
        ch: u16,
        tag: u64,
        multiple: bool,
    ) -> Result<Vec<Unacked>, AmqpError> {
        let state = self.channel(conn, ch)?;
        let taken: Vec<Unacked> = if multiple {
            let upto = if tag == 0 { u64::MAX } else { tag };
            if tag != 0 && !state.unacked.contains_key(&tag) {
                return Err(AmqpError::precondition_failed(format!(
                    "unknown delivery tag {tag}"
                )));
            }
            let keys: Vec<u64> = state.unacked.range(..=upto).map(|(k, _)| *k).collect();
            keys.iter()
                .filter_map(|k| state.unacked.remove(k))
                .collect()
        } else {
            match state.unacked.remove(&tag) {
                Some(u) => vec![u],
                None => {
                    return Err(AmqpError::precondition_failed(format!(
                        "unknown delivery tag {tag}"
                    )))
                }
            }
        };
        for u in &taken {
            if let Some(c) = &u.consumer {
                state.consumer_unacked -= 1;
                if let Some(c) = state.consumers.iter_mut().find(|x| x.tag == *c) {
                    c.unacked -= 1;
                }
            }
        }
        Ok(taken)
    }

    /// basic.ack / nack / reject on a transactional channel: the tags are checked now (406 for
    /// an unknown one, as RabbitMQ) and taken out of the unacked set; `tx_commit` settles them,
    /// `tx_rollback` puts them back. `reject`: None for an ack, Some(requeue) otherwise.
    pub fn tx_settle(
        &mut self,
        conn: ConnId,
        ch: u16,
        tag: u64,
        multiple: bool,
        reject: Option<bool>,
    ) -> Result<(), AmqpError> {
        let state = self.channel(conn, ch)?;
        let tags: Vec<u64> = if multiple {
            if tag != 0 && !state.unacked.contains_key(&tag) {
                return Err(AmqpError::precondition_failed(format!(
                    "unknown delivery tag {tag}"
                )));
            }
            let upto = if tag == 0 { u64::MAX } else { tag };
            state.unacked.range(..=upto).map(|(k, _)| *k).collect()
        } else {
            if !state.unacked.contains_key(&tag) {
                return Err(AmqpError::precondition_failed(format!(
                    "unknown delivery tag {tag}"
                )));
            }
            vec![tag]
        };
        for t in tags {
            if let Some(u) = state.unacked.remove(&t) {
                state.tx_settled.push((t, u, reject));
            }
        }
        Ok(())
    }

    /// tx.commit: settle what the transaction acked, nacked or rejected, in order.
    pub fn tx_commit(
        &mut self,
        conn: ConnId,
        ch: u16,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        let settled = std::mem::take(&mut self.channel(conn, ch)?.tx_settled);
        for (tag, u, reject) in settled {
            self.channel(conn, ch)?.unacked.insert(tag, u);
            match reject {
                None => self.ack(conn, ch, tag, false, fx)?,
                Some(requeue) => self.reject(conn, ch, tag, false, requeue, fx)?,
            }
        }
        Ok(())
    }

    /// tx.rollback: what the transaction settled is unacked again (not redelivered).
    pub fn tx_rollback(&mut self, conn: ConnId, ch: u16) -> Result<(), AmqpError> {
        let state = self.channel(conn, ch)?;
        for (tag, u, _) in std::mem::take(&mut state.tx_settled) {
            state.unacked.insert(tag, u);
        }
        Ok(())
    }

    /// basic.ack.
    pub fn ack(
        &mut self,
        conn: ConnId,
        ch: u16,
        tag: u64,
        multiple: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        let taken = self.take_unacked(conn, ch, tag, multiple)?;
        let mut touched: Vec<QueueId> = Vec::with_capacity(1);
        for u in &taken {
            if let Some(q) = self.replicated.queues.get_mut(&u.queue) {
                q.local.unacked -= 1;
            }
            if !touched.contains(&u.queue) {
                touched.push(u.queue);
            }
        }
        self.record_removals(taken.iter());
        self.dispatch_after_ack(conn, ch, touched, fx);
        Ok(())
    }

    /// Record the removal of settled messages the store holds (`Broker::removed`).
    fn record_removals<'a>(&mut self, settled: impl Iterator<Item = &'a Unacked>) {
        let mut gone = Removals::default();
        for u in settled {
            if let Some(q) = self.replicated.queues.get(&u.queue) {
                gone.add(u.queue, q, &u.qm);
            }
        }
        self.removed(gone);
    }

    /// Dispatch the queues whose messages were settled, and, when a channel-wide limit is in
    /// force, every queue the channel consumes from (the freed credit is shared).
    fn dispatch_after_ack(
        &mut self,
        conn: ConnId,
        ch: u16,
        mut queues: Vec<QueueId>,
        fx: &mut Vec<Effect>,
    ) {
        if let Ok(state) = self.channel(conn, ch) {
            if state.prefetch_channel > 0 {
                queues.extend(state.consumers.iter().map(|c| c.queue));
                queues.sort_unstable();
                queues.dedup();
                // The freed channel credit goes to the channel's queues in turn, not always to
                // the first (RabbitMQ wakes the blocked queues in random order: fair over time).
                if queues.len() > 1 {
                    let start = state.credit_turn % queues.len();
                    queues.rotate_left(start);
                    state.credit_turn = state.credit_turn.wrapping_add(1);
                }
            }
        }
        for id in queues {
            self.dispatch(id, fx);
        }
        self.settle(fx);
    }

    /// basic.nack / basic.reject: requeue at the original place, or drop.
    pub fn reject(
        &mut self,
        conn: ConnId,
        ch: u16,
        tag: u64,
        multiple: bool,
        requeue: bool,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        let taken = self.take_unacked(conn, ch, tag, multiple)?;
        if !requeue {
            self.record_removals(taken.iter());
        }
        let mut touched: Vec<QueueId> = Vec::with_capacity(1);
        if !requeue {
            // Rejected messages go to the dead-letter exchange, in delivery-tag order.
            for u in &taken {
                self.dead_letter(u.queue, &u.qm, DropReason::Rejected, fx);
            }
        }
        let now = self.local.now_ms;
        for u in taken.into_iter().rev() {
            if let Some(q) = self.replicated.queues.get_mut(&u.queue) {
                q.local.unacked -= 1;
                if requeue && !q.requeue(u.qm) {
                    self.local.dirty.push(u.queue);
                }
            }
            if !touched.contains(&u.queue) {
                touched.push(u.queue);
            }
        }
        if requeue {
            for &id in &touched {
                self.after_requeue(id, now);
            }
        }
        self.dispatch_after_ack(conn, ch, touched, fx);
        Ok(())
    }

    /// basic.recover(requeue=true): everything unacked on the channel goes back.
    pub fn recover(
        &mut self,
        conn: ConnId,
        ch: u16,
        fx: &mut Vec<Effect>,
    ) -> Result<(), AmqpError> {
        self.reject(conn, ch, 0, true, true, fx)
    }

    // ---------------------------------------------------------------- introspection

    pub fn queue_info(&mut self, vhost: &str, name: &str) -> Option<QueueInfo> {
        let id = self.queue_id(vhost, name).ok()?;
        Some(self.info(id))
    }

    pub fn exchange_exists(&self, vhost: &str, name: &str) -> bool {
        self.replicated
            .vhosts
            .get(vhost)
            .is_some_and(|v| v.exchanges.contains_key(name))
    }

    pub fn connection_vhost(&self, conn: ConnId) -> Option<&str> {
        self.local.conns.get(&conn).map(|c| c.vhost.as_str())
    }

    /// The channels a connection has open (0 for one not open, or gone).
    pub fn connection_channels(&self, conn: ConnId) -> usize {
        self.local.conns.get(&conn).map_or(0, |c| c.channels.len())
    }

    /// Open connections and their channels, in all vhosts.
    pub fn connection_totals(&self) -> (usize, usize) {
        let channels = self.local.conns.values().map(|c| c.channels.len()).sum();
        (self.local.conns.len(), channels)
    }

    /// The vhosts, sorted by name.
    pub fn vhost_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.replicated.vhosts.keys().cloned().collect();
        names.sort();
        names
    }

    /// The queues of `vhost` (all vhosts when None), sorted by vhost and name, as the
    /// management API shows them.
    pub fn queue_views(&self, vhost: Option<&str>) -> Vec<QueueView> {
        let mut out: Vec<QueueView> = self
            .replicated
            .queues
            .values()
            .filter(|q| vhost.is_none_or(|v| *q.vhost == *v))
            .map(|q| QueueView {
                name: q.name.to_string(),
                vhost: q.vhost.to_string(),
                durable: q.durable,
                exclusive: q.exclusive,
                auto_delete: q.auto_delete,
                arguments: q.arguments.clone(),
                quorum: q.quorum,
                messages_ready: q.message_count() as u64,
                message_bytes_ready: q.ready_bytes(),
                messages_unacknowledged: q.local.unacked as u64,
                consumers: q.local.consumers.len(),
            })
            .collect();
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }

    /// The bindings of `vhost` (all vhosts when None), with the default exchange's implicit
    /// binding to each queue first, as RabbitMQ lists them.
    pub fn binding_views(&self, vhost: Option<&str>) -> Vec<BindingView> {
        let mut out = Vec::new();
        let mut names: Vec<&String> = self
            .replicated
            .vhosts
            .keys()
            .filter(|v| vhost.is_none_or(|want| want == v.as_str()))
            .collect();
        names.sort();
        for vname in names {
            let v = &self.replicated.vhosts[vname];
            let mut queues: Vec<&String> = v.queues.keys().collect();
            queues.sort();
            for q in queues {
                out.push(BindingView {
                    vhost: vname.clone(),
                    source: String::new(),
                    destination: q.clone(),
                    destination_is_queue: true,
                    routing_key: q.clone(),
                    arguments: FieldTable::default(),
                });
            }
            let mut exchanges: Vec<&Exchange> = v.exchanges.values().collect();
            exchanges.sort_by(|a, b| a.name.cmp(&b.name));
            for x in exchanges {
                for b in &x.bindings {
                    let (destination, destination_is_queue) = match &b.dest {
                        Dest::Queue(id) => match self.replicated.queues.get(id) {
                            Some(q) => (q.name.to_string(), true),
                            None => continue,
                        },
                        Dest::Exchange(name) => (name.clone(), false),
                    };
                    out.push(BindingView {
                        vhost: vname.clone(),
                        source: x.name.clone(),
                        destination,
                        destination_is_queue,
                        routing_key: b.routing_key.clone(),
                        arguments: b.arguments.clone(),
                    });
                }
            }
        }
        out
    }

    /// The exchanges of `vhost` (all vhosts when None), sorted by vhost and name.
    pub fn exchange_views(&self, vhost: Option<&str>) -> Vec<ExchangeView> {
        let mut out = Vec::new();
        for (vname, v) in &self.replicated.vhosts {
            if vhost.is_some_and(|want| want != vname) {
                continue;
            }
            for x in v.exchanges.values() {
                out.push(ExchangeView {
                    name: x.name.clone(),
                    vhost: vname.clone(),
                    kind: x.kind.as_str(),
                    durable: x.durable,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: x.arguments.clone(),
                });
            }
        }
        out.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
        out
    }
}

/// A binding as the management API lists it (`destination_is_queue`: else an exchange).
#[derive(Debug, Clone)]
pub struct BindingView {
    pub vhost: String,
    pub source: String,
    pub destination: String,
    pub destination_is_queue: bool,
    pub routing_key: String,
    pub arguments: FieldTable,
}

impl BindingView {
    /// RabbitMQ's `properties_key` of a binding, which names it in a management API path:
    /// "~" for an empty routing key without arguments, the routing key itself, or the key,
    /// "~" and a digest of the arguments.
    pub fn properties_key(&self) -> String {
        if self.arguments.inner().is_empty() {
            if self.routing_key.is_empty() {
                "~".into()
            } else {
                self.routing_key.clone()
            }
        } else {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            format!("{:?}", self.arguments).hash(&mut h);
            format!("{}~{:016x}", self.routing_key, h.finish())
        }
    }
}

/// A queue as the management API lists it.
#[derive(Debug, Clone)]
pub struct QueueView {
    pub name: String,
    pub vhost: String,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: FieldTable,
    pub quorum: bool,
    pub messages_ready: u64,
    /// Body bytes of the ready messages (RabbitMQ's `message_bytes_ready`).
    pub message_bytes_ready: u64,
    pub messages_unacknowledged: u64,
    pub consumers: usize,
}

/// An exchange as the management API lists it.
#[derive(Debug, Clone)]
pub struct ExchangeView {
    pub name: String,
    pub vhost: String,
    pub kind: &'static str,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: FieldTable,
}

#[cfg(test)]
mod tests;

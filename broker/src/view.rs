//! The replicated state of a broker as plain values, to compare two brokers: the one that
//! served clients and one that applied the ops it recorded (`Broker::take_ops`). What is
//! leader-local (connections, channels, consumers, who holds which delivery, paging) is left
//! out; non-durable and exclusive queues, transient messages and their exchanges are local too
//! (a classic queue's transient messages stay on the node that has them, as in RabbitMQ).

use super::exchange::Dest;
use super::{encode_table, Broker};
use bytes::Bytes;
use warren_storage::{BindingDest, Op};

/// A vhost's or user's name and its limits.
pub type NamedLimits = (String, Vec<(String, i64)>);

/// One durable definition or message, in a stable order (see `Broker::replicated_view`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReplicatedView {
    /// (name, description, tags) of every vhost.
    pub vhosts: Vec<(String, String, Vec<String>)>,
    /// (user, vhost, configure, write, read) of every permission.
    pub permissions: Vec<(String, String, String, String, String)>,
    /// (user, vhost, exchange, write, read) of every topic permission.
    pub topic_permissions: Vec<(String, String, String, String, String)>,
    /// Limits by vhost, then by user.
    pub limits: (Vec<NamedLimits>, Vec<NamedLimits>),
    /// (vhost, name, kind, auto_delete, internal, arguments) of durable exchanges.
    pub exchanges: Vec<(String, String, String, bool, bool, Bytes)>,
    /// (vhost, name, auto_delete, arguments) of stored queues, with their persistent ready
    /// messages in delivery order and their count.
    pub queues: Vec<QueueView>,
    /// (vhost, source, destination, destination is a queue, routing key, arguments) of
    /// bindings between durable things.
    pub bindings: Vec<(String, String, String, bool, String, Bytes)>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueView {
    pub vhost: String,
    pub name: String,
    pub auto_delete: bool,
    pub arguments: Bytes,
    pub messages: Vec<MessageView>,
    pub message_count: usize,
}

/// A message as stored: its key (priority level and broker-wide id), where it was published,
/// its properties in wire form and its body.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MessageView {
    pub key: u64,
    pub exchange: String,
    pub routing_key: String,
    pub properties: Bytes,
    pub body: Bytes,
    /// When it expires (ms since the epoch), from the queue's and the message's TTL.
    pub expires_at: Option<u64>,
}

impl Broker {
    /// The replicated state (see the module doc). Reads a paged-out backlog back from the
    /// store: for tests and checks, not for a hot path.
    pub fn replicated_view(&self) -> Result<ReplicatedView, warren_storage::StoreError> {
        let mut view = ReplicatedView {
            vhosts: self
                .vhost_infos()
                .into_iter()
                .map(|v| (v.name, v.description, v.tags))
                .collect(),
            permissions: self
                .permission_list()
                .into_iter()
                .map(|(u, v, p)| (u, v, p.configure.clone(), p.write.clone(), p.read.clone()))
                .collect(),
            limits: (self.vhost_limits(), self.user_limits()),
            topic_permissions: self
                .topic_permission_list()
                .into_iter()
                .map(|(u, v, x, p)| (u, v, x, p.write.clone(), p.read.clone()))
                .collect(),
            exchanges: Vec::new(),
            queues: Vec::new(),
            bindings: Vec::new(),
        };
        for (vname, v) in &self.replicated.vhosts {
            for x in v
                .exchanges
                .values()
                .filter(|x| x.durable && !x.name.is_empty())
            {
                view.exchanges.push((
                    vname.clone(),
                    x.name.clone(),
                    x.kind.as_str().to_string(),
                    x.auto_delete,
                    x.internal,
                    encode_table(&x.arguments),
                ));
                for b in &x.bindings {
                    let (dest, is_queue) = match &b.dest {
                        Dest::Queue(id) => match self.replicated.queues.get(id) {
                            Some(q) if q.is_stored() => (q.name.to_string(), true),
                            _ => continue,
                        },
                        Dest::Exchange(name) => match v.exchanges.get(name) {
                            Some(d) if d.durable => (name.clone(), false),
                            _ => continue,
                        },
                    };
                    view.bindings.push((
                        vname.clone(),
                        x.name.clone(),
                        dest,
                        is_queue,
                        b.routing_key.clone(),
                        encode_table(&b.arguments),
                    ));
                }
            }
        }
        for q in self.replicated.queues.values().filter(|q| q.is_stored()) {
            let messages: Vec<MessageView> = q
                .ready_messages()?
                .into_iter()
                .filter(|(_, m, _)| q.keeps(m))
                .map(|(key, m, expires_at)| MessageView {
                    key,
                    exchange: m.exchange.to_string(),
                    routing_key: m.routing_key.to_string(),
                    properties: m.raw_properties.clone(),
                    body: m.body.to_bytes(),
                    expires_at,
                })
                .collect();
            view.queues.push(QueueView {
                vhost: q.vhost.to_string(),
                name: q.name.to_string(),
                auto_delete: q.auto_delete,
                arguments: encode_table(&q.arguments),
                message_count: messages.len(),
                messages,
            });
        }
        view.exchanges.sort();
        view.queues.sort();
        view.bindings.sort();
        Ok(view)
    }
}

impl Broker {
    /// Ops that rebuild the replicated state on an empty broker: durable exchanges, stored
    /// queues, bindings between them, users, then every stored queue's persistent ready
    /// messages in order (one `Enqueue` each, with the publish time its expiry implies). What
    /// a node that joins a cluster, or one too far behind, starts from before the log's tail
    /// (a logical snapshot: applying `snapshot_ops` and then the ops recorded after it gives
    /// the state of applying everything, `broker::tests`). Messages on disk are read back.
    pub fn snapshot_ops(&self) -> Result<Vec<Op>, warren_storage::StoreError> {
        let mut ops = Vec::new();
        let mut bindings = Vec::new();
        let mut vhosts: Vec<&String> = self.replicated.vhosts.keys().collect();
        vhosts.sort();
        for v in self.vhost_infos() {
            ops.push(Op::PutVhost {
                name: v.name,
                description: v.description,
                tags: v.tags,
            });
        }
        for vname in &vhosts {
            let v = &self.replicated.vhosts[*vname];
            let mut exchanges: Vec<_> = v
                .exchanges
                .values()
                .filter(|x| x.durable && !x.name.is_empty())
                .collect();
            exchanges.sort_by(|a, b| a.name.cmp(&b.name));
            for x in exchanges {
                ops.push(Op::DeclareExchange {
                    vhost: vname.to_string(),
                    name: x.name.clone(),
                    kind: x.kind.as_str().to_string(),
                    durable: true,
                    auto_delete: x.auto_delete,
                    internal: x.internal,
                    arguments: encode_table(&x.arguments),
                });
                for b in &x.bindings {
                    let destination = match &b.dest {
                        Dest::Queue(id) => match self.replicated.queues.get(id) {
                            Some(q) if q.is_stored() => BindingDest::Queue(q.name.to_string()),
                            _ => continue,
                        },
                        Dest::Exchange(name) => match v.exchanges.get(name) {
                            Some(d) if d.durable => BindingDest::Exchange(name.clone()),
                            _ => continue,
                        },
                    };
                    bindings.push(Op::Bind {
                        vhost: vname.to_string(),
                        source: x.name.clone(),
                        destination,
                        routing_key: b.routing_key.clone(),
                        arguments: encode_table(&b.arguments),
                    });
                }
            }
        }
        let mut queues: Vec<(&super::QueueId, &super::Queue)> = self
            .replicated
            .queues
            .iter()
            .filter(|(_, q)| q.is_stored())
            .collect();
        queues.sort_by_key(|(id, _)| **id);
        for (_, q) in &queues {
            ops.push(Op::DeclareQueue {
                vhost: q.vhost.to_string(),
                name: q.name.to_string(),
                durable: true,
                exclusive: false,
                auto_delete: q.auto_delete,
                arguments: encode_table(&q.arguments),
            });
        }
        ops.extend(bindings);
        for (name, u) in &self.replicated.users {
            ops.push(Op::PutUser {
                name: name.clone(),
                password_hash: u.password_hash.clone(),
                tags: u.tags.clone(),
            });
        }
        for (user, vhost, p) in self.permission_list() {
            ops.push(Op::SetPermissions {
                user,
                vhost,
                configure: p.configure.clone(),
                write: p.write.clone(),
                read: p.read.clone(),
            });
        }
        for (vhost, limits) in self.vhost_limits() {
            ops.push(Op::PutVhostLimits { vhost, limits });
        }
        for (user, limits) in self.user_limits() {
            ops.push(Op::PutUserLimits { user, limits });
        }
        for (user, vhost, exchange, p) in self.topic_permission_list() {
            ops.push(Op::SetTopicPermissions {
                user,
                vhost,
                exchange,
                write: p.write.clone(),
                read: p.read.clone(),
            });
        }
        for (_, q) in &queues {
            for (key, m, expires_at) in q.ready_messages()? {
                if !q.keeps(&m) {
                    continue;
                }
                let timestamp_ms = match (expires_at, q.ttl(&m)) {
                    (Some(at), Some(ttl)) => at.saturating_sub(ttl),
                    _ => 0,
                };
                ops.push(Op::Enqueue {
                    vhost: q.vhost.clone(),
                    queues: smallvec::smallvec![(q.name.clone(), warren_storage::key_level(key))],
                    id: warren_storage::key_id(key),
                    timestamp_ms,
                    exchange: m.exchange.clone(),
                    routing_key: m.routing_key.clone(),
                    properties: m.raw_properties.clone(),
                    body: m.body.clone(),
                });
            }
        }
        Ok(ops)
    }
}

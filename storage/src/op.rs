//! The state changes of a broker, as values.
//!
//! An op's binary encoding is in [`crate::op_codec`] (what the committer is to write and the
//! cluster to ship; not wired in yet): a versioned entry of ops, each with an explicit tag given
//! there by a named constant, never by the variant's position. Tags are never renumbered or
//! reused; a new variant needs the next free tag and its encoding there (the encoder's exhaustive
//! `match` does not compile without them) and a golden-byte test. The stores keep their own
//! records of what ops change (`codec`), not the ops' encoding.

use bytes::Bytes;
pub use warren_protocol::Body;

/// A vhost or queue name in the ops every message makes (enqueue, removal, spill): shared with
/// the broker's queue, so building such an op copies no name.
pub type Name = std::sync::Arc<str>;

/// The queues an `Enqueue` stores a message in, with its priority level in each (one, most
/// often: kept inline).
pub type QueueLevels = smallvec::SmallVec<[(Name, u8); 1]>;

/// What a binding points at.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BindingDest {
    Queue(String),
    Exchange(String),
}

/// One state change. Field tables (`arguments`) and message properties are carried in their AMQP
/// wire encoding, opaque to the store.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    DeclareExchange {
        vhost: String,
        name: String,
        kind: String,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: Bytes,
    },
    DeleteExchange {
        vhost: String,
        name: String,
    },
    DeclareQueue {
        vhost: String,
        name: String,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: Bytes,
    },
    DeleteQueue {
        vhost: String,
        name: String,
    },
    Bind {
        vhost: String,
        source: String,
        destination: BindingDest,
        routing_key: String,
        arguments: Bytes,
    },
    Unbind {
        vhost: String,
        source: String,
        destination: BindingDest,
        routing_key: String,
        arguments: Bytes,
    },
    /// A persistent message stored in `queues` under broker-wide id `id` (ids only grow; a queue
    /// delivers in id order, and a requeued message goes back to its id's place). Each queue is
    /// named with the message's priority level in it (0 without x-max-priority): its key there
    /// is `message_key(level, id)`. Routed to several queues, the body is stored once.
    Enqueue {
        vhost: Name,
        queues: QueueLevels,
        id: u64,
        /// When it was published (ms since the epoch): TTLs count from here, also on replay.
        timestamp_ms: u64,
        exchange: Name,
        routing_key: Name,
        properties: Bytes,
        body: Body,
    },
    /// Messages acknowledged (or dropped) from one queue, by key (`message_key`).
    Remove {
        vhost: Name,
        queue: Name,
        keys: Vec<u64>,
        /// The body size of each message of `keys`, in the same order, or empty where the
        /// remover did not know them (a purge with deliveries outstanding; ops of tag 8).
        /// A replica that paged the messages out to its store learns their sizes (for its
        /// byte counts) from here rather than reading each one back: acks stream past a
        /// follower's window of ready messages, since its queues have no consumers.
        sizes: Vec<u64>,
    },
    /// Every message of a queue goes.
    Purge {
        vhost: Name,
        queue: Name,
    },
    /// A message moved out of memory to keep a deep queue's heap bounded: a transient message,
    /// or any message of a queue that is not stored. Written without the write-ahead log and
    /// discarded at recovery; the queue (even a non-durable one) gets storage for it.
    Spill {
        vhost: Name,
        queue: Name,
        key: u64,
        timestamp_ms: u64,
        exchange: Name,
        routing_key: Name,
        properties: Bytes,
        body: Body,
    },
    /// The messages of a queue with keys from `from` to `to` (inclusive) go. `counted`: how
    /// many ready messages that is and their body bytes, where the remover knew (a purge's
    /// part of one priority level): a replica then learns what left its disk part without
    /// reading it.
    RemoveRange {
        vhost: Name,
        queue: Name,
        from: u64,
        to: u64,
        counted: Option<(u64, u64)>,
    },
    /// Create a user or replace its password hash and tags (users are not per vhost).
    PutUser {
        name: String,
        /// RabbitMQ's `password_hash` (base64 of salt and SHA-256, see `codec::UserRecord`).
        password_hash: String,
        tags: Vec<String>,
    },
    /// Delete a user (their connections are closed by whoever made the change).
    DeleteUser {
        name: String,
    },
    /// Create a vhost (with the predeclared `amq.*` exchanges) or replace its metadata.
    PutVhost {
        name: String,
        description: String,
        tags: Vec<String>,
    },
    /// Delete a vhost and everything in it: its queues (with their messages) and exchanges go
    /// as cascades derived in the apply; its connections are closed by whoever made the change.
    DeleteVhost {
        name: String,
    },
    /// Set a user's permissions in a vhost: regular expressions over the names of the queues
    /// and exchanges they may configure, write to and read from ("" matches nothing).
    SetPermissions {
        user: String,
        vhost: String,
        configure: String,
        write: String,
        read: String,
    },
    /// Take a user's permissions in a vhost away (they may no longer open it).
    ClearPermissions {
        user: String,
        vhost: String,
    },
    /// A vhost's limits (`max-connections`, `max-queues`), all of them: an empty list clears
    /// them. A negative value is no limit (RabbitMQ).
    PutVhostLimits {
        vhost: String,
        limits: Vec<(String, i64)>,
    },
    /// A user's limits (`max-connections`, `max-channels`), as `PutVhostLimits`.
    PutUserLimits {
        user: String,
        limits: Vec<(String, i64)>,
    },
    /// A user's topic permissions on a topic exchange of a vhost: expressions over the routing
    /// keys they may publish with (`write`) and bind with (`read`).
    SetTopicPermissions {
        user: String,
        vhost: String,
        exchange: String,
        write: String,
        read: String,
    },
    /// Take a user's topic permissions in a vhost away: on one exchange, or on all ("").
    ClearTopicPermissions {
        user: String,
        vhost: String,
        exchange: String,
    },
}

impl Op {
    /// The vhost the op belongs to.
    pub fn vhost(&self) -> &str {
        match self {
            Op::DeclareExchange { vhost, .. }
            | Op::DeleteExchange { vhost, .. }
            | Op::DeclareQueue { vhost, .. }
            | Op::DeleteQueue { vhost, .. }
            | Op::Bind { vhost, .. }
            | Op::Unbind { vhost, .. } => vhost,
            Op::Enqueue { vhost, .. }
            | Op::Remove { vhost, .. }
            | Op::Purge { vhost, .. }
            | Op::Spill { vhost, .. }
            | Op::RemoveRange { vhost, .. } => vhost,
            // Users belong to no vhost.
            Op::PutUser { .. } | Op::DeleteUser { .. } => "",
            Op::PutVhost { name, .. } | Op::DeleteVhost { name } => name,
            Op::SetPermissions { vhost, .. } | Op::ClearPermissions { vhost, .. } => vhost,
            Op::PutVhostLimits { vhost, .. } => vhost,
            Op::PutUserLimits { .. } => "",
            Op::SetTopicPermissions { vhost, .. } | Op::ClearTopicPermissions { vhost, .. } => {
                vhost
            }
        }
    }
}

impl Op {
    /// The message an `Enqueue` or `Spill` carries, borrowed.
    fn message(&self) -> Option<MessageRef<'_>> {
        match self {
            Op::Enqueue {
                timestamp_ms,
                exchange,
                routing_key,
                properties,
                body,
                ..
            }
            | Op::Spill {
                timestamp_ms,
                exchange,
                routing_key,
                properties,
                body,
                ..
            } => Some(MessageRef {
                tag: if matches!(self, Op::Spill { .. }) {
                    crate::codec::SPILLED_TAG
                } else {
                    crate::codec::VERSION
                },
                timestamp_ms: *timestamp_ms,
                exchange,
                routing_key,
                properties,
                body,
            }),
            _ => None,
        }
    }

    /// The stored value of an `Enqueue`'s or `Spill`'s message, encoded straight from the op
    /// (no record with copied names in between).
    pub fn message_value(&self) -> Option<Bytes> {
        self.message().map(|m| {
            crate::codec::encode_message(
                m.tag,
                m.timestamp_ms,
                m.exchange,
                m.routing_key,
                m.properties,
                m.body,
            )
        })
    }

    /// Like [`Op::message_value`], into `out` (cleared first); false for other ops.
    pub fn message_value_into(&self, out: &mut Vec<u8>) -> bool {
        out.clear();
        self.message()
            .map(|m| {
                crate::codec::encode_message_into(
                    out,
                    m.tag,
                    m.timestamp_ms,
                    m.exchange,
                    m.routing_key,
                    m.properties,
                    m.body,
                )
            })
            .is_some()
    }

    /// The stored form of the message an `Enqueue` or `Spill` carries.
    pub fn message_record(&self) -> Option<crate::codec::MessageRecord> {
        self.message().map(|m| crate::codec::MessageRecord {
            timestamp_ms: m.timestamp_ms,
            exchange: m.exchange.to_string(),
            routing_key: m.routing_key.to_string(),
            properties: m.properties.clone(),
            body: m.body.clone(),
        })
    }
}

/// A message inside an op, with the tag its stored value starts with.
struct MessageRef<'a> {
    tag: u8,
    timestamp_ms: u64,
    exchange: &'a str,
    routing_key: &'a str,
    properties: &'a Bytes,
    body: &'a Body,
}

// Ops rebuilt from stored records (recovery), for store implementations.

/// The op that recreates a stored user (for store implementations, at recovery).
pub fn put_user(name: &str, u: &crate::codec::UserRecord) -> Op {
    Op::PutUser {
        name: name.to_string(),
        password_hash: u.password_hash.clone(),
        tags: u.tags.clone(),
    }
}

/// The op that recreates a stored vhost (for store implementations, at recovery).
pub fn put_vhost(name: &str, v: &crate::codec::VhostRecord) -> Op {
    Op::PutVhost {
        name: name.to_string(),
        description: v.description.clone(),
        tags: v.tags.clone(),
    }
}

/// The op that recreates stored permissions (for store implementations, at recovery).
pub fn set_permissions(vhost: &str, user: &str, p: &crate::codec::PermissionRecord) -> Op {
    Op::SetPermissions {
        user: user.to_string(),
        vhost: vhost.to_string(),
        configure: p.configure.clone(),
        write: p.write.clone(),
        read: p.read.clone(),
    }
}

/// The op that recreates a vhost's stored limits (for store implementations, at recovery).
pub fn put_vhost_limits(vhost: &str, l: &crate::codec::LimitsRecord) -> Op {
    Op::PutVhostLimits {
        vhost: vhost.to_string(),
        limits: l.limits.clone(),
    }
}

/// The op that recreates a user's stored limits (for store implementations, at recovery).
pub fn put_user_limits(user: &str, l: &crate::codec::LimitsRecord) -> Op {
    Op::PutUserLimits {
        user: user.to_string(),
        limits: l.limits.clone(),
    }
}

/// The op that recreates stored topic permissions (for store implementations, at recovery).
pub fn set_topic_permissions(
    vhost: &str,
    user: &str,
    exchange: &str,
    p: &crate::codec::TopicPermissionRecord,
) -> Op {
    Op::SetTopicPermissions {
        user: user.to_string(),
        vhost: vhost.to_string(),
        exchange: exchange.to_string(),
        write: p.write.clone(),
        read: p.read.clone(),
    }
}

/// The op that recreates a stored exchange (for store implementations, at recovery).
pub fn declare_exchange(vhost: &str, name: &str, x: &crate::codec::ExchangeRecord) -> Op {
    Op::DeclareExchange {
        vhost: vhost.to_string(),
        name: name.to_string(),
        kind: x.kind.clone(),
        durable: x.durable,
        auto_delete: x.auto_delete,
        internal: x.internal,
        arguments: x.arguments.clone(),
    }
}

/// The op that recreates a stored queue (for store implementations, at recovery).
pub fn declare_queue(vhost: &str, name: &str, q: &crate::codec::QueueRecord) -> Op {
    Op::DeclareQueue {
        vhost: vhost.to_string(),
        name: name.to_string(),
        durable: q.durable,
        exclusive: q.exclusive,
        auto_delete: q.auto_delete,
        arguments: q.arguments.clone(),
    }
}

/// The op that recreates a stored binding (for store implementations, at recovery).
pub fn bind(b: &crate::codec::BindingKey) -> Op {
    Op::Bind {
        vhost: b.vhost.clone(),
        source: b.source.clone(),
        destination: b.destination.clone(),
        routing_key: b.routing_key.clone(),
        arguments: b.arguments.clone(),
    }
}

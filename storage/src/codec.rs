//! Byte encodings of what the stores keep. Every value starts with a version byte; a version is
//! never reused for another layout (golden-byte tests pin them).

use crate::op::BindingDest;
use bytes::{Buf, BufMut, Bytes, BytesMut};

pub const VERSION: u8 = 1;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("corrupt record: {0}")]
pub struct DecodeError(pub &'static str);

fn put_str(b: &mut impl BufMut, s: &[u8]) {
    b.put_u32(s.len() as u32);
    b.put_slice(s);
}

fn get_bytes(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    if b.remaining() < 4 {
        return Err(DecodeError("truncated length"));
    }
    let n = b.get_u32() as usize;
    if b.remaining() < n {
        return Err(DecodeError("truncated field"));
    }
    Ok(b.split_to(n))
}

fn get_string(b: &mut Bytes) -> Result<String, DecodeError> {
    String::from_utf8(get_bytes(b)?.to_vec()).map_err(|_| DecodeError("bad utf-8"))
}

fn check_version(b: &mut Bytes) -> Result<(), DecodeError> {
    if b.remaining() < 1 {
        return Err(DecodeError("empty record"));
    }
    match b.get_u8() {
        VERSION => Ok(()),
        _ => Err(DecodeError("unknown record version")),
    }
}

/// An exchange definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeRecord {
    pub kind: String,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub arguments: Bytes,
}

impl ExchangeRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        put_str(&mut b, self.kind.as_bytes());
        b.put_u8(self.durable as u8 | (self.auto_delete as u8) << 1 | (self.internal as u8) << 2);
        put_str(&mut b, &self.arguments);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        let kind = get_string(&mut b)?;
        if b.remaining() < 1 {
            return Err(DecodeError("truncated flags"));
        }
        let flags = b.get_u8();
        let arguments = get_bytes(&mut b)?;
        Ok(ExchangeRecord {
            kind,
            durable: flags & 1 != 0,
            auto_delete: flags & 2 != 0,
            internal: flags & 4 != 0,
            arguments,
        })
    }
}

/// A queue definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueRecord {
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub arguments: Bytes,
}

impl QueueRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        b.put_u8(self.durable as u8 | (self.exclusive as u8) << 1 | (self.auto_delete as u8) << 2);
        put_str(&mut b, &self.arguments);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        if b.remaining() < 1 {
            return Err(DecodeError("truncated flags"));
        }
        let flags = b.get_u8();
        let arguments = get_bytes(&mut b)?;
        Ok(QueueRecord {
            durable: flags & 1 != 0,
            exclusive: flags & 2 != 0,
            auto_delete: flags & 4 != 0,
            arguments,
        })
    }
}

/// A user: RabbitMQ's password hash (base64 of a 4-byte salt and the SHA-256 of salt and
/// password, `rabbit_password_hashing_sha256`) and tags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserRecord {
    pub password_hash: String,
    pub tags: Vec<String>,
}

impl UserRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        put_str(&mut b, self.password_hash.as_bytes());
        put_tags(&mut b, &self.tags);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        let password_hash = get_string(&mut b)?;
        let tags = get_tags(&mut b)?;
        Ok(UserRecord {
            password_hash,
            tags,
        })
    }
}

/// A stored vhost: its metadata (the vhost's exchanges and queues are records of their own).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VhostRecord {
    pub description: String,
    pub tags: Vec<String>,
}

impl VhostRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        put_str(&mut b, self.description.as_bytes());
        put_tags(&mut b, &self.tags);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        let description = get_string(&mut b)?;
        let tags = get_tags(&mut b)?;
        Ok(VhostRecord { description, tags })
    }
}

/// A list of tags: a count, then each string.
fn put_tags(b: &mut BytesMut, tags: &[String]) {
    b.put_u32(tags.len() as u32);
    for t in tags {
        put_str(b, t.as_bytes());
    }
}

/// A list written by `put_tags`. Each tag takes at least its 4-byte length: a count past that
/// is damage, not a size to allocate for.
fn get_tags(b: &mut Bytes) -> Result<Vec<String>, DecodeError> {
    if b.remaining() < 4 {
        return Err(DecodeError("truncated tags"));
    }
    let n = b.get_u32() as usize;
    if n > b.remaining() / 4 {
        return Err(DecodeError("bad tag count"));
    }
    (0..n).map(|_| get_string(b)).collect()
}

/// A user's permissions in a vhost (key: `P` + vhost + user).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PermissionRecord {
    pub configure: String,
    pub write: String,
    pub read: String,
}

impl PermissionRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        put_str(&mut b, self.configure.as_bytes());
        put_str(&mut b, self.write.as_bytes());
        put_str(&mut b, self.read.as_bytes());
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        Ok(PermissionRecord {
            configure: get_string(&mut b)?,
            write: get_string(&mut b)?,
            read: get_string(&mut b)?,
        })
    }
}

/// A vhost's or user's limits (keys `L` + vhost, `M` + user): name and value pairs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LimitsRecord {
    pub limits: Vec<(String, i64)>,
}

impl LimitsRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        b.put_u32(self.limits.len() as u32);
        for (name, value) in &self.limits {
            put_str(&mut b, name.as_bytes());
            b.put_i64(*value);
        }
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        if b.remaining() < 4 {
            return Err(DecodeError("truncated limits"));
        }
        let n = b.get_u32() as usize;
        // Each takes at least a 4-byte length and 8 bytes of value.
        if n > b.remaining() / 12 {
            return Err(DecodeError("bad limit count"));
        }
        let mut limits = Vec::with_capacity(n.min(crate::op_codec::RESERVE_AT_MOST));
        for _ in 0..n {
            let name = get_string(&mut b)?;
            if b.remaining() < 8 {
                return Err(DecodeError("truncated limit"));
            }
            limits.push((name, b.get_i64()));
        }
        Ok(LimitsRecord { limits })
    }
}

/// A user's topic permissions on an exchange (key: `T` + vhost + user NUL exchange; a user
/// name never holds a NUL: SASL separates with it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TopicPermissionRecord {
    pub write: String,
    pub read: String,
}

impl TopicPermissionRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(VERSION);
        put_str(&mut b, self.write.as_bytes());
        put_str(&mut b, self.read.as_bytes());
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        Ok(TopicPermissionRecord {
            write: get_string(&mut b)?,
            read: get_string(&mut b)?,
        })
    }
}

/// The name part of a topic permission's key: user NUL exchange.
pub fn topic_permission_name(user: &str, exchange: &str) -> String {
    format!("{user}\0{exchange}")
}

/// (user, exchange) from `topic_permission_name`'s form.
pub fn split_topic_permission_name(name: &str) -> Option<(&str, &str)> {
    name.split_once('\0')
}

/// A binding, encoded whole as a key (its value is empty).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct BindingKey {
    pub vhost: String,
    pub source: String,
    pub destination: BindingDest,
    pub routing_key: String,
    pub arguments: Bytes,
}

/// Key prefixes in the metadata keyspace.
pub const EXCHANGE_PREFIX: u8 = b'X';
pub const QUEUE_PREFIX: u8 = b'Q';
pub const BINDING_PREFIX: u8 = b'B';
/// Users: `U` + an empty vhost + the user name (users are not per vhost).
pub const USER_PREFIX: u8 = b'U';
/// Vhosts: `V` + an empty vhost + the vhost's name.
pub const VHOST_PREFIX: u8 = b'V';
/// Permissions: `P` + the vhost + the user.
pub const PERMISSION_PREFIX: u8 = b'P';
/// Vhost limits: `L` + an empty vhost + the vhost's name.
pub const VHOST_LIMITS_PREFIX: u8 = b'L';
/// User limits: `M` + an empty vhost + the user's name.
pub const USER_LIMITS_PREFIX: u8 = b'M';
/// Topic permissions: `T` + the vhost + user NUL exchange.
pub const TOPIC_PERMISSION_PREFIX: u8 = b'T';

/// `X`/`Q` + vhost + name.
pub fn entity_key(prefix: u8, vhost: &str, name: &str) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(prefix);
    put_str(&mut b, vhost.as_bytes());
    put_str(&mut b, name.as_bytes());
    b.freeze()
}

pub fn decode_entity_key(mut b: Bytes) -> Result<(u8, String, String), DecodeError> {
    if b.remaining() < 1 {
        return Err(DecodeError("empty key"));
    }
    let prefix = b.get_u8();
    Ok((prefix, get_string(&mut b)?, get_string(&mut b)?))
}

impl BindingKey {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(BINDING_PREFIX);
        put_str(&mut b, self.vhost.as_bytes());
        put_str(&mut b, self.source.as_bytes());
        match &self.destination {
            BindingDest::Queue(q) => {
                b.put_u8(b'q');
                put_str(&mut b, q.as_bytes());
            }
            BindingDest::Exchange(x) => {
                b.put_u8(b'x');
                put_str(&mut b, x.as_bytes());
            }
        }
        put_str(&mut b, self.routing_key.as_bytes());
        put_str(&mut b, &self.arguments);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        if b.remaining() < 1 || b.get_u8() != BINDING_PREFIX {
            return Err(DecodeError("not a binding key"));
        }
        let vhost = get_string(&mut b)?;
        let source = get_string(&mut b)?;
        if b.remaining() < 1 {
            return Err(DecodeError("truncated destination"));
        }
        let destination = match b.get_u8() {
            b'q' => BindingDest::Queue(get_string(&mut b)?),
            b'x' => BindingDest::Exchange(get_string(&mut b)?),
            _ => return Err(DecodeError("bad destination kind")),
        };
        Ok(BindingKey {
            vhost,
            source,
            destination,
            routing_key: get_string(&mut b)?,
            arguments: get_bytes(&mut b)?,
        })
    }
}

/// A stored message in one queue, keyed by its id (big-endian, so keys sort in id order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageRecord {
    pub timestamp_ms: u64,
    pub exchange: String,
    pub routing_key: String,
    pub properties: Bytes,
    pub body: warren_protocol::Body,
}

/// How a message sits in a queue's keyspace: the first byte of its value says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageEntry {
    /// A persistent message, whole (version byte 1).
    Whole(MessageRecord),
    /// A persistent message whose body is stored once for several queues, under its id in the
    /// shared keyspace (tag 2, nothing else).
    Shared,
    /// A transient message spilled out of memory (tag 3, then the layout of version 1): gone
    /// after a restart.
    Spilled(MessageRecord),
}

pub const SHARED_TAG: u8 = 2;
pub const SPILLED_TAG: u8 = 3;

impl MessageEntry {
    pub fn decode(b: Bytes) -> Result<Self, DecodeError> {
        match b.first() {
            Some(&VERSION) => Ok(MessageEntry::Whole(MessageRecord::decode(b)?)),
            Some(&SHARED_TAG) if b.len() == 1 => Ok(MessageEntry::Shared),
            Some(&SPILLED_TAG) => {
                let mut b = b;
                b.advance(1);
                Ok(MessageEntry::Spilled(MessageRecord::decode_fields(b)?))
            }
            _ => Err(DecodeError("unknown message entry")),
        }
    }
}

/// The stored value of a message (`tag` [`VERSION`] or [`SPILLED_TAG`]), from its fields
/// (lets the store encode an op's message without building a record first).
pub fn encode_message(
    tag: u8,
    timestamp_ms: u64,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &warren_protocol::Body,
) -> Bytes {
    let mut b = BytesMut::with_capacity(
        32 + exchange.len() + routing_key.len() + properties.len() + body.len(),
    );
    encode_message_into(
        &mut b,
        tag,
        timestamp_ms,
        exchange,
        routing_key,
        properties,
        body,
    );
    b.freeze()
}

/// [`encode_message`] appended to `b` (the store reuses one buffer for a whole batch).
pub fn encode_message_into(
    b: &mut impl BufMut,
    tag: u8,
    timestamp_ms: u64,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &warren_protocol::Body,
) {
    b.put_u8(tag);
    b.put_u64(timestamp_ms);
    put_str(b, exchange.as_bytes());
    put_str(b, routing_key.as_bytes());
    put_str(b, properties);
    for part in body.parts() {
        b.put_slice(part);
    }
}

impl MessageRecord {
    /// A spilled transient message (see [`MessageEntry::Spilled`]).
    pub fn encode_spilled(&self) -> Bytes {
        self.encode_tagged(SPILLED_TAG)
    }

    pub fn encode(&self) -> Bytes {
        self.encode_tagged(VERSION)
    }

    fn encode_tagged(&self, tag: u8) -> Bytes {
        encode_message(
            tag,
            self.timestamp_ms,
            &self.exchange,
            &self.routing_key,
            &self.properties,
            &self.body,
        )
    }

    pub fn decode(mut b: Bytes) -> Result<Self, DecodeError> {
        check_version(&mut b)?;
        Self::decode_fields(b)
    }

    fn decode_fields(mut b: Bytes) -> Result<Self, DecodeError> {
        if b.remaining() < 8 {
            return Err(DecodeError("truncated timestamp"));
        }
        let timestamp_ms = b.get_u64();
        Ok(MessageRecord {
            timestamp_ms,
            exchange: get_string(&mut b)?,
            routing_key: get_string(&mut b)?,
            properties: get_bytes(&mut b)?,
            body: b.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_record_golden_bytes() {
        let u = UserRecord {
            password_hash: "h=".into(),
            tags: vec!["administrator".into()],
        };
        let mut expected = vec![1, 0, 0, 0, 2, b'h', b'=', 0, 0, 0, 1, 0, 0, 0, 13];
        expected.extend_from_slice(b"administrator");
        assert_eq!(&u.encode()[..], &expected[..]);
        assert_eq!(UserRecord::decode(u.encode()), Ok(u));
        // A damaged tag count is refused, not allocated for.
        let bad = Bytes::from_static(&[1, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert!(UserRecord::decode(bad).is_err());
    }

    #[test]
    fn golden_bytes() {
        let m = MessageRecord {
            timestamp_ms: 1,
            exchange: "x".into(),
            routing_key: "k".into(),
            properties: Bytes::from_static(&[0, 0]),
            body: Bytes::from_static(b"hi").into(),
        };
        assert_eq!(
            &m.encode()[..],
            &[
                1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, b'x', 0, 0, 0, 1, b'k', 0, 0, 0, 2, 0, 0,
                b'h', b'i'
            ]
        );
        assert_eq!(MessageRecord::decode(m.encode()), Ok(m.clone()));
        // A body kept as the publisher's frames is stored as the same bytes.
        let parts = MessageRecord {
            body: warren_protocol::Body::from_parts(vec![
                Bytes::from_static(b"h"),
                Bytes::from_static(b"i"),
            ]),
            ..m.clone()
        };
        assert_eq!(parts.encode(), m.encode());
        // The store encodes ops' messages directly: the same bytes as through a record.
        for spill in [false, true] {
            let op = if spill {
                crate::Op::Spill {
                    vhost: "/".into(),
                    queue: "q".into(),
                    key: 5,
                    timestamp_ms: 1,
                    exchange: "x".into(),
                    routing_key: "k".into(),
                    properties: m.properties.clone(),
                    body: parts.body.clone(),
                }
            } else {
                crate::Op::Enqueue {
                    vhost: "/".into(),
                    queues: vec![("q".into(), 0)].into(),
                    id: 5,
                    timestamp_ms: 1,
                    exchange: "x".into(),
                    routing_key: "k".into(),
                    properties: m.properties.clone(),
                    body: parts.body.clone(),
                }
            };
            let record = op.message_record().unwrap();
            let expected = if spill {
                record.encode_spilled()
            } else {
                record.encode()
            };
            assert_eq!(op.message_value(), Some(expected));
        }
        assert_eq!(MessageRecord::decode(parts.encode()), Ok(parts));
        let q = QueueRecord {
            durable: true,
            exclusive: false,
            auto_delete: true,
            arguments: Bytes::from_static(&[0, 0, 0, 0]),
        };
        assert_eq!(&q.encode()[..], &[1, 5, 0, 0, 0, 4, 0, 0, 0, 0]);
        assert_eq!(QueueRecord::decode(q.encode()), Ok(q));
    }

    #[test]
    fn keys_round_trip() {
        let k = BindingKey {
            vhost: "/".into(),
            source: "amq.topic".into(),
            destination: BindingDest::Exchange("x".into()),
            routing_key: "a.#".into(),
            arguments: Bytes::from_static(&[0, 0, 0, 0]),
        };
        assert_eq!(BindingKey::decode(k.encode()), Ok(k));
        let e = entity_key(QUEUE_PREFIX, "/", "q");
        assert_eq!(
            decode_entity_key(e),
            Ok((QUEUE_PREFIX, "/".into(), "q".into()))
        );
        assert!(MessageRecord::decode(Bytes::from_static(&[9])).is_err());
        let m = MessageRecord {
            timestamp_ms: 7,
            exchange: "".into(),
            routing_key: "q".into(),
            properties: Bytes::new(),
            body: Bytes::from_static(b"b").into(),
        };
        assert_eq!(m.encode_spilled()[0], 3);
        assert_eq!(
            MessageEntry::decode(m.encode_spilled()),
            Ok(MessageEntry::Spilled(m.clone()))
        );
        assert_eq!(MessageEntry::decode(m.encode()), Ok(MessageEntry::Whole(m)));
        assert_eq!(
            MessageEntry::decode(Bytes::from_static(&[2])),
            Ok(MessageEntry::Shared)
        );
    }
}

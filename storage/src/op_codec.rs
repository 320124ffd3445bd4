//! The binary encoding of [`Op`]s: what the committer is to write to the op log and what the
//! cluster will ship from the leader to its followers (neither uses it yet: the stores still keep
//! their own records, `codec`).
//!
//! # Entry
//!
//! A batch of ops is one *entry*:
//!
//! ```text
//! entry  = FORMAT (u8, = 1)  count (u32 BE)  op{count}
//! op     = tag (u8)  fields of the variant, in the order of the table below
//! ```
//!
//! Field encodings (all integers big-endian):
//!
//! | type          | bytes                                                           |
//! |---------------|-----------------------------------------------------------------|
//! | `u8`          | 1 byte                                                          |
//! | `u64`         | 8 bytes                                                         |
//! | `bool`        | 1 byte, 0 or 1 (anything else does not decode)                  |
//! | string        | length (u32) + UTF-8 bytes (`String`, or [`Name`] = `Arc<str>`) |
//! | bytes         | length (u32) + bytes (`Bytes`: arguments, properties)           |
//! | [`Body`]      | length (u32) + the body's bytes, its parts back to back         |
//! | `Vec<T>`      | count (u32) + the items                                         |
//! | [`BindingDest`] | kind (u8: 1 queue, 2 exchange) + string                       |
//!
//! # Tags
//!
//! | tag | variant           | fields                                                              |
//! |-----|-------------------|---------------------------------------------------------------------|
//! | 1   | `DeclareExchange` | vhost, name, kind, durable, auto_delete, internal, arguments        |
//! | 2   | `DeleteExchange`  | vhost, name                                                         |
//! | 3   | `DeclareQueue`    | vhost, name, durable, exclusive, auto_delete, arguments             |
//! | 4   | `DeleteQueue`     | vhost, name                                                         |
//! | 5   | `Bind`            | vhost, source, destination, routing_key, arguments                  |
//! | 6   | `Unbind`          | vhost, source, destination, routing_key, arguments                  |
//! | 7   | `Enqueue`         | vhost, queues (count + (name, level u8) each), id, timestamp_ms, exchange, routing_key, properties, body |
//! | 8   | `Remove`          | vhost, queue, keys (count + u64 each); `sizes` empty                |
//! | 9   | `Purge`           | vhost, queue                                                        |
//! | 10  | `Spill`           | vhost, queue, key, timestamp_ms, exchange, routing_key, properties, body |
//! | 11  | `RemoveRange`     | vhost, queue, from, to                                              |
//! | 12  | `PutUser`         | name, password_hash, tags (count + string each)                     |
//! | 13  | `Remove` with sizes | vhost, queue, count, then (key u64, size u64) each                |
//! | 14  | `DeleteUser`      | name                                                                |
//! | 15  | `PutVhost`        | name, description, tags (count + string each)                       |
//! | 16  | `DeleteVhost`     | name                                                                |
//! | 17  | `SetPermissions`  | user, vhost, configure, write, read                                 |
//! | 18  | `ClearPermissions`| user, vhost                                                         |
//! | 19  | `PutVhostLimits`  | vhost, limits (count + (name, i64) each)                            |
//! | 20  | `PutUserLimits`   | user, limits (count + (name, i64) each)                             |
//! | 21  | `SetTopicPermissions` | user, vhost, exchange, write, read                              |
//! | 22  | `ClearTopicPermissions` | user, vhost, exchange                                         |
//! | 23  | `RemoveRange` counted | vhost, queue, from, to, count, bytes (tag 11: not counted)      |
//!
//! Tags are never renumbered and never reused, not even for a variant that is removed: a new
//! variant takes the next free number, and a variant whose fields change gets a new tag (or the
//! entry a new `FORMAT`). Decoding an unknown tag, an unknown format, a bad bool or destination
//! kind, invalid UTF-8, a length or count past the end of the input, or bytes left over after
//! the last op is a [`DecodeError`], never a panic. Counts and lengths are checked against the
//! bytes that remain, and room for a count's items is reserved only up to [`RESERVE_AT_MOST`]
//! (beyond that a vector grows as items actually decode): an item in memory is far larger than
//! its encoding (an `Op` about 170 bytes, 5 at least on the wire), so reserving for a checked
//! count alone let 64 MiB of input ask for gigabytes.
//!
//! Decoding copies only what the op's types own: `arguments`, `properties` and message bodies
//! are [`Bytes`] slices of the input (no copy); strings and names are copied once, after their
//! UTF-8 check. Golden-byte tests below pin the layout of every variant.

use crate::codec::DecodeError;
use crate::op::{BindingDest, Body, Name, Op, QueueLevels};
use bytes::{Buf, BufMut, Bytes, BytesMut};

/// The first byte of an entry: the layout of everything after it.
pub const FORMAT: u8 = 1;

// One tag per variant of `Op`. Never renumbered, never reused; new variants take the next.
pub const TAG_DECLARE_EXCHANGE: u8 = 1;
pub const TAG_DELETE_EXCHANGE: u8 = 2;
pub const TAG_DECLARE_QUEUE: u8 = 3;
pub const TAG_DELETE_QUEUE: u8 = 4;
pub const TAG_BIND: u8 = 5;
pub const TAG_UNBIND: u8 = 6;
pub const TAG_ENQUEUE: u8 = 7;
pub const TAG_REMOVE: u8 = 8;
pub const TAG_PURGE: u8 = 9;
pub const TAG_SPILL: u8 = 10;
pub const TAG_REMOVE_RANGE: u8 = 11;
pub const TAG_PUT_USER: u8 = 12;
/// `Remove` whose `sizes` are known (one per key); tag 8 is one whose `sizes` are not.
pub const TAG_REMOVE_SIZED: u8 = 13;
pub const TAG_DELETE_USER: u8 = 14;
pub const TAG_PUT_VHOST: u8 = 15;
pub const TAG_DELETE_VHOST: u8 = 16;
pub const TAG_SET_PERMISSIONS: u8 = 17;
pub const TAG_CLEAR_PERMISSIONS: u8 = 18;
pub const TAG_PUT_VHOST_LIMITS: u8 = 19;
pub const TAG_PUT_USER_LIMITS: u8 = 20;
pub const TAG_SET_TOPIC_PERMISSIONS: u8 = 21;
pub const TAG_CLEAR_TOPIC_PERMISSIONS: u8 = 22;
pub const TAG_REMOVE_RANGE_COUNTED: u8 = 23;

/// [`BindingDest`] kinds.
pub const DEST_QUEUE: u8 = 1;
pub const DEST_EXCHANGE: u8 = 2;

/// Every tag in use, in order.
const ALL_TAGS: [u8; 23] = [
    TAG_DECLARE_EXCHANGE,
    TAG_DELETE_EXCHANGE,
    TAG_DECLARE_QUEUE,
    TAG_DELETE_QUEUE,
    TAG_BIND,
    TAG_UNBIND,
    TAG_ENQUEUE,
    TAG_REMOVE,
    TAG_PURGE,
    TAG_SPILL,
    TAG_REMOVE_RANGE,
    TAG_PUT_USER,
    TAG_REMOVE_SIZED,
    TAG_DELETE_USER,
    TAG_PUT_VHOST,
    TAG_DELETE_VHOST,
    TAG_SET_PERMISSIONS,
    TAG_CLEAR_PERMISSIONS,
    TAG_PUT_VHOST_LIMITS,
    TAG_PUT_USER_LIMITS,
    TAG_SET_TOPIC_PERMISSIONS,
    TAG_CLEAR_TOPIC_PERMISSIONS,
    TAG_REMOVE_RANGE_COUNTED,
];

// Compile-time: the tags are distinct and non-zero (0 stays free as a "never an op" byte).
const _: () = {
    let mut i = 0;
    while i < ALL_TAGS.len() {
        assert!(ALL_TAGS[i] != 0, "tag 0 is not an op");
        let mut j = i + 1;
        while j < ALL_TAGS.len() {
            assert!(ALL_TAGS[i] != ALL_TAGS[j], "two variants share a tag");
            j += 1;
        }
        i += 1;
    }
};

/// The fewest bytes any op takes (`DeleteUser` with an empty name: a tag and a length):
/// bounds an entry's op count by its size before allocating.
const MIN_OP_LEN: usize = 1 + 4;

/// The tag of an op. The match is exhaustive on purpose (no `_ =>`): a new variant of [`Op`]
/// does not compile until it has a tag here and an encoding in [`encode_op`].
pub fn tag(op: &Op) -> u8 {
    match op {
        Op::DeclareExchange { .. } => TAG_DECLARE_EXCHANGE,
        Op::DeleteExchange { .. } => TAG_DELETE_EXCHANGE,
        Op::DeclareQueue { .. } => TAG_DECLARE_QUEUE,
        Op::DeleteQueue { .. } => TAG_DELETE_QUEUE,
        Op::Bind { .. } => TAG_BIND,
        Op::Unbind { .. } => TAG_UNBIND,
        Op::Enqueue { .. } => TAG_ENQUEUE,
        Op::Remove { keys, sizes, .. } if sized(keys, sizes) => TAG_REMOVE_SIZED,
        Op::Remove { .. } => TAG_REMOVE,
        Op::Purge { .. } => TAG_PURGE,
        Op::Spill { .. } => TAG_SPILL,
        Op::RemoveRange {
            counted: Some(_), ..
        } => TAG_REMOVE_RANGE_COUNTED,
        Op::RemoveRange { .. } => TAG_REMOVE_RANGE,
        Op::PutUser { .. } => TAG_PUT_USER,
        Op::DeleteUser { .. } => TAG_DELETE_USER,
        Op::PutVhost { .. } => TAG_PUT_VHOST,
        Op::DeleteVhost { .. } => TAG_DELETE_VHOST,
        Op::SetPermissions { .. } => TAG_SET_PERMISSIONS,
        Op::ClearPermissions { .. } => TAG_CLEAR_PERMISSIONS,
        Op::PutVhostLimits { .. } => TAG_PUT_VHOST_LIMITS,
        Op::PutUserLimits { .. } => TAG_PUT_USER_LIMITS,
        Op::SetTopicPermissions { .. } => TAG_SET_TOPIC_PERMISSIONS,
        Op::ClearTopicPermissions { .. } => TAG_CLEAR_TOPIC_PERMISSIONS,
    }
}

/// Whether a `Remove` carries a size for each key (tag 13), else none (tag 8).
fn sized(keys: &[u64], sizes: &[u64]) -> bool {
    !keys.is_empty() && sizes.len() == keys.len()
}

// Encoding.

/// An op that cannot be encoded: a field or count past the encoding's u32 lengths.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("an op field of {0} bytes (or items) does not fit the op encoding's u32 length")]
pub struct EncodeError(pub usize);

/// A length or count as its u32 field. Nothing the broker accepts comes near 4 GiB (bodies are
/// capped by `max_message_size`, names are AMQP short strings), but the fields come from
/// clients: a longer one is refused, never written with a wrong length (nor a panic).
fn put_len(b: &mut BytesMut, n: usize) -> Result<(), EncodeError> {
    let len = u32::try_from(n).map_err(|_| EncodeError(n))?;
    b.put_u32(len);
    Ok(())
}

fn put_bytes(b: &mut BytesMut, s: &[u8]) -> Result<(), EncodeError> {
    put_len(b, s.len())?;
    b.put_slice(s);
    Ok(())
}

fn put_bool(b: &mut BytesMut, v: bool) {
    b.put_u8(u8::from(v));
}

fn put_dest(b: &mut BytesMut, d: &BindingDest) -> Result<(), EncodeError> {
    match d {
        BindingDest::Queue(q) => {
            b.put_u8(DEST_QUEUE);
            put_bytes(b, q.as_bytes())
        }
        BindingDest::Exchange(x) => {
            b.put_u8(DEST_EXCHANGE);
            put_bytes(b, x.as_bytes())
        }
    }
}

fn put_body(b: &mut BytesMut, body: &Body) -> Result<(), EncodeError> {
    put_len(b, body.len())?;
    for part in body.parts() {
        b.put_slice(part);
    }
    Ok(())
}

/// A message's fields after its queue(s) and id/key, shared by `Enqueue` and `Spill`.
fn put_message(
    b: &mut BytesMut,
    timestamp_ms: u64,
    exchange: &str,
    routing_key: &str,
    properties: &[u8],
    body: &Body,
) -> Result<(), EncodeError> {
    b.reserve(8 + 16 + exchange.len() + routing_key.len() + properties.len() + body.len());
    b.put_u64(timestamp_ms);
    put_bytes(b, exchange.as_bytes())?;
    put_bytes(b, routing_key.as_bytes())?;
    put_bytes(b, properties)?;
    put_body(b, body)
}

/// Appends one op (tag and fields, no format byte) to `b`. An op on its own is not versioned:
/// stored or shipped, ops always travel inside an entry ([`encode_ops`]).
pub fn encode_op(b: &mut BytesMut, op: &Op) -> Result<(), EncodeError> {
    b.put_u8(tag(op));
    // Exhaustive (no `_ =>`): every variant must have its encoding here.
    match op {
        Op::DeclareExchange {
            vhost,
            name,
            kind,
            durable,
            auto_delete,
            internal,
            arguments,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, name.as_bytes())?;
            put_bytes(b, kind.as_bytes())?;
            put_bool(b, *durable);
            put_bool(b, *auto_delete);
            put_bool(b, *internal);
            put_bytes(b, arguments)?;
        }
        Op::DeleteExchange { vhost, name } | Op::DeleteQueue { vhost, name } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, name.as_bytes())?;
        }
        Op::DeclareQueue {
            vhost,
            name,
            durable,
            exclusive,
            auto_delete,
            arguments,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, name.as_bytes())?;
            put_bool(b, *durable);
            put_bool(b, *exclusive);
            put_bool(b, *auto_delete);
            put_bytes(b, arguments)?;
        }
        Op::Bind {
            vhost,
            source,
            destination,
            routing_key,
            arguments,
        }
        | Op::Unbind {
            vhost,
            source,
            destination,
            routing_key,
            arguments,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, source.as_bytes())?;
            put_dest(b, destination)?;
            put_bytes(b, routing_key.as_bytes())?;
            put_bytes(b, arguments)?;
        }
        Op::Enqueue {
            vhost,
            queues,
            id,
            timestamp_ms,
            exchange,
            routing_key,
            properties,
            body,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_len(b, queues.len())?;
            for (queue, level) in queues {
                put_bytes(b, queue.as_bytes())?;
                b.put_u8(*level);
            }
            b.put_u64(*id);
            put_message(b, *timestamp_ms, exchange, routing_key, properties, body)?;
        }
        Op::Remove {
            vhost,
            queue,
            keys,
            sizes,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, queue.as_bytes())?;
            put_len(b, keys.len())?;
            if sized(keys, sizes) {
                b.reserve(16 * keys.len());
                for (k, size) in keys.iter().zip(sizes) {
                    b.put_u64(*k);
                    b.put_u64(*size);
                }
            } else {
                b.reserve(8 * keys.len());
                for k in keys {
                    b.put_u64(*k);
                }
            }
        }
        Op::Purge { vhost, queue } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, queue.as_bytes())?;
        }
        Op::Spill {
            vhost,
            queue,
            key,
            timestamp_ms,
            exchange,
            routing_key,
            properties,
            body,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, queue.as_bytes())?;
            b.put_u64(*key);
            put_message(b, *timestamp_ms, exchange, routing_key, properties, body)?;
        }
        Op::RemoveRange {
            vhost,
            queue,
            from,
            to,
            counted,
        } => {
            put_bytes(b, vhost.as_bytes())?;
            put_bytes(b, queue.as_bytes())?;
            b.put_u64(*from);
            b.put_u64(*to);
            if let Some((count, bytes)) = counted {
                b.put_u64(*count);
                b.put_u64(*bytes);
            }
        }
        Op::PutUser {
            name,
            password_hash,
            tags,
        } => {
            put_bytes(b, name.as_bytes())?;
            put_bytes(b, password_hash.as_bytes())?;
            put_len(b, tags.len())?;
            for t in tags {
                put_bytes(b, t.as_bytes())?;
            }
        }
        Op::DeleteUser { name } => put_bytes(b, name.as_bytes())?,
        Op::PutVhost {
            name,
            description,
            tags,
        } => {
            put_bytes(b, name.as_bytes())?;
            put_bytes(b, description.as_bytes())?;
            put_len(b, tags.len())?;
            for t in tags {
                put_bytes(b, t.as_bytes())?;
            }
        }
        Op::DeleteVhost { name } => put_bytes(b, name.as_bytes())?,
        Op::SetPermissions {
            user,
            vhost,
            configure,
            write,
            read,
        } => {
            for s in [user, vhost, configure, write, read] {
                put_bytes(b, s.as_bytes())?;
            }
        }
        Op::ClearPermissions { user, vhost } => {
            put_bytes(b, user.as_bytes())?;
            put_bytes(b, vhost.as_bytes())?;
        }
        Op::PutVhostLimits {
            vhost: name,
            limits,
        }
        | Op::PutUserLimits { user: name, limits } => {
            put_bytes(b, name.as_bytes())?;
            put_len(b, limits.len())?;
            for (k, v) in limits {
                put_bytes(b, k.as_bytes())?;
                b.put_i64(*v);
            }
        }
        Op::SetTopicPermissions {
            user,
            vhost,
            exchange,
            write,
            read,
        } => {
            for s in [user, vhost, exchange, write, read] {
                put_bytes(b, s.as_bytes())?;
            }
        }
        Op::ClearTopicPermissions {
            user,
            vhost,
            exchange,
        } => {
            for s in [user, vhost, exchange] {
                put_bytes(b, s.as_bytes())?;
            }
        }
    }
    Ok(())
}

/// Appends the entry of `ops` (format byte, count, ops) to `b`.
pub fn encode_ops_into(b: &mut BytesMut, ops: &[Op]) -> Result<(), EncodeError> {
    b.put_u8(FORMAT);
    put_len(b, ops.len())?;
    for op in ops {
        encode_op(b, op)?;
    }
    Ok(())
}

/// The entry of `ops`: format byte, count, ops.
pub fn encode_ops(ops: &[Op]) -> Result<Bytes, EncodeError> {
    // Sized once: a large buffer grown step by step is allocated afresh at every step.
    let size = ops
        .iter()
        .map(|op| match op {
            Op::Enqueue {
                body,
                properties,
                routing_key,
                ..
            } => body.len() + properties.len() + routing_key.len() + 96,
            _ => 64,
        })
        .sum::<usize>()
        + 16;
    let mut b = BytesMut::with_capacity(size);
    encode_ops_into(&mut b, ops)?;
    Ok(b.freeze())
}

// Decoding: every read checks what remains first.

fn get_u8(b: &mut Bytes, what: &'static str) -> Result<u8, DecodeError> {
    if b.remaining() < 1 {
        return Err(DecodeError(what));
    }
    Ok(b.get_u8())
}

fn get_u64(b: &mut Bytes, what: &'static str) -> Result<u64, DecodeError> {
    if b.remaining() < 8 {
        return Err(DecodeError(what));
    }
    Ok(b.get_u64())
}

/// A message id: below `2^ID_BITS`, as the broker gives them (a key holds the id in those
/// bits, so a larger one would make keys of other messages).
fn get_message_id(b: &mut Bytes) -> Result<u64, DecodeError> {
    let id = get_u64(b, "truncated id")?;
    if id >= 1 << crate::ID_BITS {
        return Err(DecodeError("message id out of range"));
    }
    Ok(id)
}

fn get_len(b: &mut Bytes) -> Result<usize, DecodeError> {
    if b.remaining() < 4 {
        return Err(DecodeError("truncated length"));
    }
    usize::try_from(b.get_u32()).map_err(|_| DecodeError("length does not fit in memory"))
}

/// Items reserved for at most, whatever a count says (see the module's doc): past this, a
/// vector grows as its items decode, so memory follows what the input really holds.
pub const RESERVE_AT_MOST: usize = 1024;

/// Room to reserve for `n` items (`get_count`'s).
fn reserve(n: usize) -> usize {
    n.min(RESERVE_AT_MOST)
}

/// A count of items that take at least `min_item` bytes each, refused when the rest of the
/// input could not hold that many (damage, not a size to allocate for).
fn get_count(b: &mut Bytes, min_item: usize) -> Result<usize, DecodeError> {
    let n = get_len(b)?;
    if n > b.remaining() / min_item {
        return Err(DecodeError("count past the end of the input"));
    }
    Ok(n)
}

/// A length-prefixed field, as a slice of the input (no copy).
fn get_bytes(b: &mut Bytes) -> Result<Bytes, DecodeError> {
    let n = get_len(b)?;
    if b.remaining() < n {
        return Err(DecodeError("truncated field"));
    }
    Ok(b.split_to(n))
}

fn get_string(b: &mut Bytes) -> Result<String, DecodeError> {
    String::from_utf8(get_bytes(b)?.to_vec()).map_err(|_| DecodeError("bad utf-8"))
}

/// The names an entry's ops repeat (its vhost, queues, exchanges, routing keys): each decoded
/// once per entry and shared after, rather than an `Arc<str>` allocated per name per op (a
/// follower decodes every message's op: this was 6% of its CPU).
#[derive(Default)]
struct Names {
    /// The most recently decoded distinct names, oldest first.
    recent: Vec<Name>,
}

/// How many distinct names `Names` keeps (a linear search: short on purpose).
const NAMES_KEPT: usize = 8;

impl Names {
    /// A name, checked as UTF-8 and copied into its `Arc<str>` unless the same bytes were
    /// decoded just before.
    fn get(&mut self, b: &mut Bytes) -> Result<Name, DecodeError> {
        let s = get_bytes(b)?;
        if let Some(n) = self.recent.iter().rev().find(|n| n.as_bytes() == &s[..]) {
            return Ok(n.clone());
        }
        let name = std::str::from_utf8(&s)
            .map(Name::from)
            .map_err(|_| DecodeError("bad utf-8"))?;
        if self.recent.len() == NAMES_KEPT {
            self.recent.remove(0);
        }
        self.recent.push(name.clone());
        Ok(name)
    }
}

fn get_bool(b: &mut Bytes) -> Result<bool, DecodeError> {
    match get_u8(b, "truncated bool")? {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(DecodeError("bad bool")),
    }
}

fn get_dest(b: &mut Bytes) -> Result<BindingDest, DecodeError> {
    match get_u8(b, "truncated destination")? {
        DEST_QUEUE => Ok(BindingDest::Queue(get_string(b)?)),
        DEST_EXCHANGE => Ok(BindingDest::Exchange(get_string(b)?)),
        _ => Err(DecodeError("bad destination kind")),
    }
}

/// Reads one op (tag and fields) from the front of `b`, leaving the rest.
pub fn decode_op(b: &mut Bytes) -> Result<Op, DecodeError> {
    decode_op_in(b, &mut Names::default())
}

fn decode_op_in(b: &mut Bytes, names: &mut Names) -> Result<Op, DecodeError> {
    let op = match get_u8(b, "truncated op")? {
        TAG_DECLARE_EXCHANGE => Op::DeclareExchange {
            vhost: get_string(b)?,
            name: get_string(b)?,
            kind: get_string(b)?,
            durable: get_bool(b)?,
            auto_delete: get_bool(b)?,
            internal: get_bool(b)?,
            arguments: get_bytes(b)?,
        },
        TAG_DELETE_EXCHANGE => Op::DeleteExchange {
            vhost: get_string(b)?,
            name: get_string(b)?,
        },
        TAG_DECLARE_QUEUE => Op::DeclareQueue {
            vhost: get_string(b)?,
            name: get_string(b)?,
            durable: get_bool(b)?,
            exclusive: get_bool(b)?,
            auto_delete: get_bool(b)?,
            arguments: get_bytes(b)?,
        },
        TAG_DELETE_QUEUE => Op::DeleteQueue {
            vhost: get_string(b)?,
            name: get_string(b)?,
        },
        TAG_BIND => Op::Bind {
            vhost: get_string(b)?,
            source: get_string(b)?,
            destination: get_dest(b)?,
            routing_key: get_string(b)?,
            arguments: get_bytes(b)?,
        },
        TAG_UNBIND => Op::Unbind {
            vhost: get_string(b)?,
            source: get_string(b)?,
            destination: get_dest(b)?,
            routing_key: get_string(b)?,
            arguments: get_bytes(b)?,
        },
        TAG_ENQUEUE => {
            let vhost = names.get(b)?;
            // Each queue takes at least its name's length and its level.
            let n = get_count(b, 4 + 1)?;
            let mut queues = QueueLevels::with_capacity(reserve(n));
            for _ in 0..n {
                let queue = names.get(b)?;
                let level = get_u8(b, "truncated level")?;
                queues.push((queue, level));
            }
            Op::Enqueue {
                vhost,
                queues,
                id: get_message_id(b)?,
                timestamp_ms: get_u64(b, "truncated timestamp")?,
                exchange: names.get(b)?,
                routing_key: names.get(b)?,
                properties: get_bytes(b)?,
                body: Body::from(get_bytes(b)?),
            }
        }
        TAG_REMOVE => {
            let vhost = names.get(b)?;
            let queue = names.get(b)?;
            let n = get_count(b, 8)?;
            let mut keys = Vec::with_capacity(reserve(n));
            for _ in 0..n {
                keys.push(get_u64(b, "truncated key")?);
            }
            Op::Remove {
                vhost,
                queue,
                keys,
                sizes: Vec::new(),
            }
        }
        TAG_REMOVE_SIZED => {
            let vhost = names.get(b)?;
            let queue = names.get(b)?;
            let n = get_count(b, 16)?;
            let mut keys = Vec::with_capacity(reserve(n));
            let mut sizes = Vec::with_capacity(reserve(n));
            for _ in 0..n {
                keys.push(get_u64(b, "truncated key")?);
                sizes.push(get_u64(b, "truncated size")?);
            }
            Op::Remove {
                vhost,
                queue,
                keys,
                sizes,
            }
        }
        TAG_PURGE => Op::Purge {
            vhost: names.get(b)?,
            queue: names.get(b)?,
        },
        TAG_SPILL => Op::Spill {
            vhost: names.get(b)?,
            queue: names.get(b)?,
            key: get_u64(b, "truncated key")?,
            timestamp_ms: get_u64(b, "truncated timestamp")?,
            exchange: names.get(b)?,
            routing_key: names.get(b)?,
            properties: get_bytes(b)?,
            body: Body::from(get_bytes(b)?),
        },
        TAG_REMOVE_RANGE => Op::RemoveRange {
            vhost: names.get(b)?,
            queue: names.get(b)?,
            from: get_u64(b, "truncated range")?,
            to: get_u64(b, "truncated range")?,
            counted: None,
        },
        TAG_REMOVE_RANGE_COUNTED => Op::RemoveRange {
            vhost: names.get(b)?,
            queue: names.get(b)?,
            from: get_u64(b, "truncated range")?,
            to: get_u64(b, "truncated range")?,
            counted: Some((
                get_u64(b, "truncated range count")?,
                get_u64(b, "truncated range bytes")?,
            )),
        },
        TAG_PUT_USER => {
            let name = get_string(b)?;
            let password_hash = get_string(b)?;
            let n = get_count(b, 4)?;
            let mut tags = Vec::with_capacity(reserve(n));
            for _ in 0..n {
                tags.push(get_string(b)?);
            }
            Op::PutUser {
                name,
                password_hash,
                tags,
            }
        }
        TAG_DELETE_USER => Op::DeleteUser {
            name: get_string(b)?,
        },
        TAG_PUT_VHOST => {
            let name = get_string(b)?;
            let description = get_string(b)?;
            let n = get_count(b, 4)?;
            let mut tags = Vec::with_capacity(reserve(n));
            for _ in 0..n {
                tags.push(get_string(b)?);
            }
            Op::PutVhost {
                name,
                description,
                tags,
            }
        }
        TAG_DELETE_VHOST => Op::DeleteVhost {
            name: get_string(b)?,
        },
        TAG_SET_PERMISSIONS => Op::SetPermissions {
            user: get_string(b)?,
            vhost: get_string(b)?,
            configure: get_string(b)?,
            write: get_string(b)?,
            read: get_string(b)?,
        },
        TAG_CLEAR_PERMISSIONS => Op::ClearPermissions {
            user: get_string(b)?,
            vhost: get_string(b)?,
        },
        tag @ (TAG_PUT_VHOST_LIMITS | TAG_PUT_USER_LIMITS) => {
            let name = get_string(b)?;
            // Each takes at least a 4-byte length and 8 bytes of value.
            let n = get_count(b, 12)?;
            let mut limits = Vec::with_capacity(reserve(n));
            for _ in 0..n {
                let k = get_string(b)?;
                if b.remaining() < 8 {
                    return Err(DecodeError("truncated limit"));
                }
                limits.push((k, b.get_i64()));
            }
            if tag == TAG_PUT_VHOST_LIMITS {
                Op::PutVhostLimits {
                    vhost: name,
                    limits,
                }
            } else {
                Op::PutUserLimits { user: name, limits }
            }
        }
        TAG_SET_TOPIC_PERMISSIONS => Op::SetTopicPermissions {
            user: get_string(b)?,
            vhost: get_string(b)?,
            exchange: get_string(b)?,
            write: get_string(b)?,
            read: get_string(b)?,
        },
        TAG_CLEAR_TOPIC_PERMISSIONS => Op::ClearTopicPermissions {
            user: get_string(b)?,
            vhost: get_string(b)?,
            exchange: get_string(b)?,
        },
        _ => return Err(DecodeError("unknown op tag")),
    };
    Ok(op)
}

/// The ops of an entry, in order. The whole input must be the entry: bytes after its last op
/// are an error, like any other damage.
pub fn decode_ops(mut b: Bytes) -> Result<Vec<Op>, DecodeError> {
    match get_u8(&mut b, "empty entry")? {
        FORMAT => {}
        _ => return Err(DecodeError("unknown entry format")),
    }
    let n = get_count(&mut b, MIN_OP_LEN)?;
    let mut ops = Vec::with_capacity(reserve(n));
    let mut names = Names::default();
    for _ in 0..n {
        ops.push(decode_op_in(&mut b, &mut names)?);
    }
    if b.has_remaining() {
        return Err(DecodeError("bytes after the last op"));
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from hex digits; spaces, newlines and `|` (field separators) are ignored.
    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s
            .bytes()
            .filter(|c| !c.is_ascii_whitespace() && *c != b'|')
            .collect();
        assert!(digits.len().is_multiple_of(2), "odd number of hex digits");
        digits
            .chunks(2)
            .map(|pair| {
                let pair = std::str::from_utf8(pair).unwrap();
                u8::from_str_radix(pair, 16).unwrap()
            })
            .collect()
    }

    fn entry(ops: &[&[u8]]) -> Vec<u8> {
        let mut v = vec![FORMAT];
        v.extend_from_slice(&(ops.len() as u32).to_be_bytes());
        for op in ops {
            v.extend_from_slice(op);
        }
        v
    }

    /// `op` encodes to exactly `expected` (tag and fields), alone and as an entry of one, and
    /// decodes back from both; every shorter prefix of its entry is an error.
    fn golden(op: Op, expected: &str) {
        let expected = hex(expected);
        let mut b = BytesMut::new();
        encode_op(&mut b, &op).unwrap();
        assert_eq!(&b[..], &expected[..], "encoding of {op:?}");
        assert_eq!(
            decode_op(&mut Bytes::from(expected.clone())).as_ref(),
            Ok(&op)
        );
        let whole = entry(&[&expected]);
        assert_eq!(
            &encode_ops(std::slice::from_ref(&op)).unwrap()[..],
            &whole[..]
        );
        assert_eq!(decode_ops(Bytes::from(whole.clone())), Ok(vec![op]));
        for n in 0..whole.len() {
            assert!(decode_ops(Bytes::copy_from_slice(&whole[..n])).is_err());
        }
    }

    fn args() -> Bytes {
        Bytes::from_static(&[0, 0, 0, 0])
    }

    #[test]
    fn golden_declare_exchange() {
        golden(
            Op::DeclareExchange {
                vhost: "/".into(),
                name: "x".into(),
                kind: "topic".into(),
                durable: true,
                auto_delete: false,
                internal: true,
                arguments: args(),
            },
            "01 | 00000001 2f | 00000001 78 | 00000005 746f706963 | 01 | 00 | 01
             | 00000004 00000000",
        );
    }

    #[test]
    fn golden_delete_exchange() {
        golden(
            Op::DeleteExchange {
                vhost: "/".into(),
                name: "x".into(),
            },
            "02 | 00000001 2f | 00000001 78",
        );
    }

    #[test]
    fn golden_declare_queue() {
        golden(
            Op::DeclareQueue {
                vhost: "/".into(),
                name: "q".into(),
                durable: true,
                exclusive: false,
                auto_delete: true,
                arguments: Bytes::new(),
            },
            "03 | 00000001 2f | 00000001 71 | 01 | 00 | 01 | 00000000",
        );
    }

    #[test]
    fn golden_delete_queue() {
        golden(
            Op::DeleteQueue {
                vhost: "v".into(),
                name: "q".into(),
            },
            "04 | 00000001 76 | 00000001 71",
        );
    }

    #[test]
    fn golden_bind() {
        golden(
            Op::Bind {
                vhost: "/".into(),
                source: "x".into(),
                destination: BindingDest::Queue("q".into()),
                routing_key: "a.#".into(),
                arguments: args(),
            },
            "05 | 00000001 2f | 00000001 78 | 01 00000001 71 | 00000003 612e23
             | 00000004 00000000",
        );
    }

    #[test]
    fn golden_unbind() {
        golden(
            Op::Unbind {
                vhost: "/".into(),
                source: "x".into(),
                destination: BindingDest::Exchange("y".into()),
                routing_key: "".into(),
                arguments: Bytes::new(),
            },
            "06 | 00000001 2f | 00000001 78 | 02 00000001 79 | 00000000 | 00000000",
        );
    }

    #[test]
    fn golden_enqueue() {
        golden(
            Op::Enqueue {
                vhost: "/".into(),
                queues: vec![("q".into(), 0), ("r".into(), 9)].into(),
                id: 0x0102,
                timestamp_ms: 0x0a0b0c0d,
                exchange: "x".into(),
                routing_key: "k".into(),
                properties: Bytes::from_static(&[0x90, 0x00]),
                // Kept as two frames: encoded as the same bytes as one.
                body: Body::from_parts(vec![Bytes::from_static(b"h"), Bytes::from_static(b"i")]),
            },
            "07 | 00000001 2f | 00000002 00000001 71 00 00000001 72 09
             | 0000000000000102 | 000000000a0b0c0d | 00000001 78 | 00000001 6b
             | 00000002 9000 | 00000002 6869",
        );
    }

    #[test]
    fn golden_remove() {
        golden(
            Op::Remove {
                vhost: "/".into(),
                queue: "q".into(),
                keys: vec![1, 0x0900000000000002],
                sizes: vec![],
            },
            "08 | 00000001 2f | 00000001 71 | 00000002 0000000000000001 0900000000000002",
        );
    }

    #[test]
    fn golden_remove_sized() {
        golden(
            Op::Remove {
                vhost: "/".into(),
                queue: "q".into(),
                keys: vec![1, 0x0900000000000002],
                sizes: vec![0x0400, 7],
            },
            "0d | 00000001 2f | 00000001 71 | 00000002 0000000000000001 0000000000000400
             0900000000000002 0000000000000007",
        );
    }

    #[test]
    fn golden_purge() {
        golden(
            Op::Purge {
                vhost: "/".into(),
                queue: "q".into(),
            },
            "09 | 00000001 2f | 00000001 71",
        );
    }

    #[test]
    fn golden_spill() {
        golden(
            Op::Spill {
                vhost: "/".into(),
                queue: "q".into(),
                key: 5,
                timestamp_ms: 1,
                exchange: "".into(),
                routing_key: "q".into(),
                properties: Bytes::new(),
                body: Body::from(Bytes::from_static(b"b")),
            },
            "0a | 00000001 2f | 00000001 71 | 0000000000000005 | 0000000000000001
             | 00000000 | 00000001 71 | 00000000 | 00000001 62",
        );
    }

    #[test]
    fn golden_remove_range() {
        golden(
            Op::RemoveRange {
                vhost: "/".into(),
                queue: "q".into(),
                from: 3,
                to: u64::MAX,
                counted: None,
            },
            "0b | 00000001 2f | 00000001 71 | 0000000000000003 | ffffffffffffffff",
        );
    }

    #[test]
    fn golden_remove_range_counted() {
        golden(
            Op::RemoveRange {
                vhost: "/".into(),
                queue: "q".into(),
                from: 3,
                to: u64::MAX,
                counted: Some((2, 0x0102)),
            },
            "17 | 00000001 2f | 00000001 71 | 0000000000000003 | ffffffffffffffff
             | 0000000000000002 | 0000000000000102",
        );
    }

    #[test]
    fn golden_put_user() {
        golden(
            Op::PutUser {
                name: "guest".into(),
                password_hash: "h=".into(),
                tags: vec!["administrator".into(), "".into()],
            },
            "0c | 00000005 6775657374 | 00000002 683d
             | 00000002 0000000d 61646d696e6973747261746f72 00000000",
        );
    }

    #[test]
    fn golden_delete_user() {
        golden(
            Op::DeleteUser { name: "bob".into() },
            "0e | 00000003 626f62",
        );
    }

    #[test]
    fn golden_put_vhost() {
        golden(
            Op::PutVhost {
                name: "v1".into(),
                description: "d".into(),
                tags: vec!["a".into()],
            },
            "0f | 00000002 7631 | 00000001 64 | 00000001 00000001 61",
        );
    }

    #[test]
    fn golden_delete_vhost() {
        golden(Op::DeleteVhost { name: "v1".into() }, "10 | 00000002 7631");
    }

    #[test]
    fn golden_set_permissions() {
        golden(
            Op::SetPermissions {
                user: "u".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: "".into(),
                read: "^a".into(),
            },
            "11 | 00000001 75 | 00000001 2f | 00000002 2e2a | 00000000 | 00000002 5e61",
        );
    }

    #[test]
    fn golden_clear_permissions() {
        golden(
            Op::ClearPermissions {
                user: "u".into(),
                vhost: "/".into(),
            },
            "12 | 00000001 75 | 00000001 2f",
        );
    }

    #[test]
    fn golden_put_vhost_limits() {
        golden(
            Op::PutVhostLimits {
                vhost: "v".into(),
                limits: vec![("max-queues".into(), -1)],
            },
            "13 | 00000001 76 | 00000001 0000000a 6d61782d717565756573 ffffffffffffffff",
        );
    }

    #[test]
    fn golden_put_user_limits() {
        golden(
            Op::PutUserLimits {
                user: "u".into(),
                limits: vec![],
            },
            "14 | 00000001 75 | 00000000",
        );
    }

    #[test]
    fn golden_set_topic_permissions() {
        golden(
            Op::SetTopicPermissions {
                user: "u".into(),
                vhost: "/".into(),
                exchange: "t".into(),
                write: "^a".into(),
                read: "".into(),
            },
            "15 | 00000001 75 | 00000001 2f | 00000001 74 | 00000002 5e61 | 00000000",
        );
    }

    #[test]
    fn golden_clear_topic_permissions() {
        golden(
            Op::ClearTopicPermissions {
                user: "u".into(),
                vhost: "/".into(),
                exchange: "".into(),
            },
            "16 | 00000001 75 | 00000001 2f | 00000000",
        );
    }

    #[test]
    fn golden_empty_entry() {
        assert_eq!(&encode_ops(&[]).unwrap()[..], &hex("01 00000000")[..]);
        assert_eq!(decode_ops(Bytes::from(hex("01 00000000"))), Ok(vec![]));
    }

    /// One op of every variant.
    fn every_variant() -> Vec<Op> {
        vec![
            Op::DeclareExchange {
                vhost: "/".into(),
                name: "ex".into(),
                kind: "direct".into(),
                durable: false,
                auto_delete: true,
                internal: false,
                arguments: args(),
            },
            Op::DeleteExchange {
                vhost: "/".into(),
                name: "ex".into(),
            },
            Op::DeclareQueue {
                vhost: "vh".into(),
                name: "qü".into(),
                durable: true,
                exclusive: true,
                auto_delete: false,
                arguments: args(),
            },
            Op::DeleteQueue {
                vhost: "vh".into(),
                name: "qü".into(),
            },
            Op::Bind {
                vhost: "/".into(),
                source: "amq.topic".into(),
                destination: BindingDest::Exchange("ex".into()),
                routing_key: "#".into(),
                arguments: Bytes::new(),
            },
            Op::Unbind {
                vhost: "/".into(),
                source: "amq.topic".into(),
                destination: BindingDest::Queue("q".into()),
                routing_key: "a.*".into(),
                arguments: args(),
            },
            Op::Enqueue {
                vhost: "/".into(),
                queues: vec![("q".into(), 3)].into(),
                id: 42,
                timestamp_ms: 1_700_000_000_000,
                exchange: "amq.direct".into(),
                routing_key: "q".into(),
                properties: Bytes::from_static(&[0x10, 0x00, 0x02]),
                body: Body::from(vec![7u8; 300]),
            },
            Op::Remove {
                vhost: "/".into(),
                queue: "q".into(),
                keys: vec![],
                sizes: vec![],
            },
            Op::Purge {
                vhost: "/".into(),
                queue: "q".into(),
            },
            Op::Spill {
                vhost: "/".into(),
                queue: "q".into(),
                key: crate::message_key(3, 43),
                timestamp_ms: 1_700_000_000_001,
                exchange: "".into(),
                routing_key: "q".into(),
                properties: Bytes::new(),
                body: Body::new(),
            },
            Op::RemoveRange {
                vhost: "/".into(),
                queue: "q".into(),
                from: 0,
                to: 10,
                counted: None,
            },
            Op::PutUser {
                name: "u".into(),
                password_hash: "".into(),
                tags: vec![],
            },
            Op::Remove {
                vhost: "/".into(),
                queue: "q".into(),
                keys: vec![crate::message_key(3, 42)],
                sizes: vec![300],
            },
            Op::DeleteUser { name: "u".into() },
            Op::PutVhost {
                name: "v".into(),
                description: "".into(),
                tags: vec![],
            },
            Op::DeleteVhost { name: "v".into() },
            Op::SetPermissions {
                user: "u".into(),
                vhost: "v".into(),
                configure: ".*".into(),
                write: ".*".into(),
                read: ".*".into(),
            },
            Op::ClearPermissions {
                user: "u".into(),
                vhost: "v".into(),
            },
            Op::PutVhostLimits {
                vhost: "v".into(),
                limits: vec![("max-connections".into(), 2)],
            },
            Op::PutUserLimits {
                user: "u".into(),
                limits: vec![("max-channels".into(), 0)],
            },
            Op::SetTopicPermissions {
                user: "u".into(),
                vhost: "v".into(),
                exchange: "t".into(),
                write: ".*".into(),
                read: ".*".into(),
            },
            Op::ClearTopicPermissions {
                user: "u".into(),
                vhost: "v".into(),
                exchange: "t".into(),
            },
            Op::RemoveRange {
                vhost: "/".into(),
                queue: "q".into(),
                from: 0,
                to: 10,
                counted: Some((3, 30)),
            },
        ]
    }

    #[test]
    fn every_variant_has_its_tag() {
        let ops = every_variant();
        let tags: Vec<u8> = ops.iter().map(tag).collect();
        assert_eq!(tags, ALL_TAGS.to_vec());
        assert_eq!(tags, (1..=23).collect::<Vec<u8>>());
    }

    #[test]
    fn batch_round_trip() {
        let ops = every_variant();
        let b = encode_ops(&ops).unwrap();
        assert_eq!(decode_ops(b.clone()), Ok(ops.clone()));
        // Appending to a buffer that already holds something writes the same entry after it.
        let mut out = BytesMut::from(&b"prefix"[..]);
        encode_ops_into(&mut out, &ops).unwrap();
        assert_eq!(&out[6..], &b[..]);
        // One op at a time from the front of the ops, as `decode_ops` reads them.
        let mut rest = b.slice(5..);
        for op in &ops {
            assert_eq!(decode_op(&mut rest).as_ref(), Ok(op));
        }
        assert!(rest.is_empty());
    }

    /// An entry's repeated names are decoded once and shared; different names, and more
    /// distinct names than are kept, still decode to themselves; a bad name is still refused.
    #[test]
    fn names_repeated_in_an_entry_are_shared() {
        let purge = |vhost: &str, queue: &str| Op::Purge {
            vhost: vhost.into(),
            queue: queue.into(),
        };
        let mut ops = vec![purge("/", "a"), purge("/", "a")];
        // More distinct names than are kept, then the first again.
        ops.extend((0..NAMES_KEPT * 2).map(|i| purge("/", &format!("q{i}"))));
        ops.push(purge("/", "a"));
        let got = decode_ops(encode_ops(&ops).unwrap()).unwrap();
        assert_eq!(got, ops);
        let names = |op: &Op| match op {
            Op::Purge { vhost, queue } => (vhost.clone(), queue.clone()),
            _ => unreachable!(),
        };
        let ((v0, q0), (v1, q1)) = (names(&got[0]), names(&got[1]));
        assert!(Name::ptr_eq(&v0, &v1), "the vhost was decoded twice");
        assert!(Name::ptr_eq(&q0, &q1), "the queue was decoded twice");
        let (_, q2) = names(&got[2]);
        assert!(!Name::ptr_eq(&q1, &q2));
        // A name equal to a kept one but for a byte that is not UTF-8 is refused.
        let mut bad = BytesMut::new();
        encode_ops_into(&mut bad, &[purge("/", "ab"), purge("/", "ab")]).unwrap();
        let last = bad.len() - 1;
        bad[last] = 0xff;
        assert_eq!(decode_ops(bad.freeze()), Err(DecodeError("bad utf-8")));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = encode_ops(&every_variant()).unwrap();
        for n in 0..b.len() {
            assert!(decode_ops(b.slice(..n)).is_err(), "prefix of {n} bytes");
        }
        // And a single op cut anywhere.
        let mut one = BytesMut::new();
        for op in every_variant() {
            one.clear();
            encode_op(&mut one, &op).unwrap();
            let one = one.clone().freeze();
            for n in 0..one.len() {
                assert!(decode_op(&mut one.slice(..n)).is_err(), "{op:?} cut at {n}");
            }
        }
    }

    #[test]
    fn damage_is_an_error() {
        let purge = hex("09 00000001 2f 00000001 71");
        let decode = |v: Vec<u8>| decode_ops(Bytes::from(v));
        // Unknown tags: 0, the first free one, the last.
        for t in [0u8, 24, 255] {
            let mut op = purge.clone();
            op[0] = t;
            assert_eq!(decode(entry(&[&op])), Err(DecodeError("unknown op tag")));
        }
        // Unknown format.
        let mut e = entry(&[&purge]);
        e[0] = 2;
        assert_eq!(decode(e), Err(DecodeError("unknown entry format")));
        assert_eq!(decode(vec![]), Err(DecodeError("empty entry")));
        // A bool that is neither 0 nor 1.
        let queue = hex("03 00000001 2f 00000001 71 01 02 00 00000000");
        assert_eq!(decode(entry(&[&queue])), Err(DecodeError("bad bool")));
        // A destination kind that is neither queue nor exchange.
        let bind = hex("05 00000001 2f 00000001 78 03 00000001 71 00000000 00000000");
        assert_eq!(
            decode(entry(&[&bind])),
            Err(DecodeError("bad destination kind"))
        );
        // Invalid UTF-8, in a String and in a Name.
        let bad = hex("02 00000001 ff 00000001 78");
        assert_eq!(decode(entry(&[&bad])), Err(DecodeError("bad utf-8")));
        let bad = hex("09 00000001 2f 00000002 c328");
        assert_eq!(decode(entry(&[&bad])), Err(DecodeError("bad utf-8")));
        // Bytes after the last op, and fewer ops than counted.
        let mut e = entry(&[&purge]);
        e.push(0);
        assert_eq!(decode(e), Err(DecodeError("bytes after the last op")));
        let mut e = entry(&[&purge, &purge]);
        e[4] = 3;
        assert!(decode(e).is_err());
    }

    #[test]
    fn a_length_past_u32_is_refused_when_encoding() {
        let mut b = BytesMut::new();
        let n = u32::MAX as usize + 1;
        assert_eq!(put_len(&mut b, n), Err(EncodeError(n)));
        assert!(b.is_empty(), "nothing written for a refused length");
        assert_eq!(put_len(&mut b, u32::MAX as usize), Ok(()));
    }

    #[test]
    fn hostile_lengths_are_refused_before_allocating() {
        let decode = |s: &str| decode_ops(Bytes::from(hex(s)));
        let past_end = Err(DecodeError("count past the end of the input"));
        // 4 billion ops in a 5-byte entry.
        assert_eq!(decode("01 ffffffff"), past_end);
        assert_eq!(decode("01 ffffffff 09 00000000 00000000"), past_end);
        // A string, a body, a key list, a queue list and a tag list claiming 4 GiB.
        assert_eq!(
            decode("01 00000001 09 ffffffff 2f 00000000 00"),
            Err(DecodeError("truncated field"))
        );
        assert_eq!(
            decode(
                "01 00000001 0a 00000000 00000000 0000000000000000 0000000000000000
                 00000000 00000000 00000000 ffffffff 00"
            ),
            Err(DecodeError("truncated field"))
        );
        assert_eq!(
            decode("01 00000001 08 00000000 00000000 20000000 0000000000000000"),
            past_end
        );
        assert_eq!(
            decode("01 00000001 07 00000000 ffffffff 00000000 00"),
            past_end
        );
        assert_eq!(
            decode("01 00000001 0c 00000000 00000000 40000000 00000000"),
            past_end
        );
    }

    /// A count the input could hold (5 bytes an op at least) is not reserved for as decoded
    /// ops (about 170 bytes each): 8 MiB of input claiming 1.6 million ops asked for 280 MB
    /// before the first op failed to decode. Past the cap, the test binary aborts.
    #[test]
    fn a_count_is_not_reserved_for_beyond_what_decodes() {
        let n: u32 = 1_600_000;
        let mut input = vec![FORMAT];
        input.extend_from_slice(&n.to_be_bytes());
        input.resize(1 + 4 + 5 * n as usize, 0xee);
        let input = Bytes::from(input);
        let decoded = crate::testing::allocating_at_most(&crate::ALLOC, 16 << 20, || {
            decode_ops(input.clone())
        });
        assert_eq!(decoded, Err(DecodeError("unknown op tag")));
    }

    /// An id that does not fit in a key's id bits is damage: as a key it would name another
    /// message (and `id + 1`, the next id, would overflow at the top).
    #[test]
    fn a_message_id_past_the_key_bits_is_refused() {
        let enqueue = |id: &str| {
            decode_ops(Bytes::from(hex(&format!(
                "01 00000001 07 | 00000001 2f | 00000001 00000001 71 00 | {id} | \
                 0000000000000000 | 00000000 | 00000000 | 00000000 | 00000000"
            ))))
        };
        assert!(enqueue("00ffffffffffffff").is_ok());
        for id in ["0100000000000000", "ffffffffffffffff"] {
            assert_eq!(enqueue(id), Err(DecodeError("message id out of range")));
        }
    }

    #[test]
    fn decoded_bytes_share_the_input() {
        let ops = every_variant();
        let b = encode_ops(&ops[6..7]).unwrap();
        let range = b.as_ptr_range();
        let Ok(decoded) = decode_ops(b.clone()) else {
            panic!("does not decode")
        };
        let Op::Enqueue {
            properties, body, ..
        } = &decoded[0]
        else {
            panic!("not an enqueue")
        };
        assert!(range.contains(&properties.as_ptr()));
        assert_eq!(body.parts().len(), 1);
        assert!(range.contains(&body.parts()[0].as_ptr()));
    }

    mod prop {
        use super::super::*;
        use proptest::collection::vec;
        use proptest::prelude::*;

        fn string() -> impl Strategy<Value = String> {
            // Any unicode, short; sometimes empty.
            "\\PC{0,12}"
        }

        fn name() -> impl Strategy<Value = Name> {
            string().prop_map(Name::from)
        }

        fn bytes() -> impl Strategy<Value = Bytes> {
            vec(any::<u8>(), 0..40).prop_map(Bytes::from)
        }

        fn body() -> impl Strategy<Value = Body> {
            // One part or several: the encoding is the same bytes either way.
            vec(vec(any::<u8>(), 0..30), 0..4)
                .prop_map(|parts| Body::from_parts(parts.into_iter().map(Bytes::from).collect()))
        }

        fn dest() -> impl Strategy<Value = BindingDest> {
            prop_oneof![
                string().prop_map(BindingDest::Queue),
                string().prop_map(BindingDest::Exchange),
            ]
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (
                    string(),
                    string(),
                    string(),
                    any::<bool>(),
                    any::<bool>(),
                    any::<bool>(),
                    bytes()
                )
                    .prop_map(
                        |(vhost, name, kind, durable, auto_delete, internal, arguments)| {
                            Op::DeclareExchange {
                                vhost,
                                name,
                                kind,
                                durable,
                                auto_delete,
                                internal,
                                arguments,
                            }
                        }
                    ),
                (string(), string()).prop_map(|(vhost, name)| Op::DeleteExchange { vhost, name }),
                (
                    string(),
                    string(),
                    any::<bool>(),
                    any::<bool>(),
                    any::<bool>(),
                    bytes()
                )
                    .prop_map(
                        |(vhost, name, durable, exclusive, auto_delete, arguments)| {
                            Op::DeclareQueue {
                                vhost,
                                name,
                                durable,
                                exclusive,
                                auto_delete,
                                arguments,
                            }
                        }
                    ),
                (string(), string()).prop_map(|(vhost, name)| Op::DeleteQueue { vhost, name }),
                (string(), string(), dest(), string(), bytes()).prop_map(
                    |(vhost, source, destination, routing_key, arguments)| Op::Bind {
                        vhost,
                        source,
                        destination,
                        routing_key,
                        arguments,
                    }
                ),
                (string(), string(), dest(), string(), bytes()).prop_map(
                    |(vhost, source, destination, routing_key, arguments)| Op::Unbind {
                        vhost,
                        source,
                        destination,
                        routing_key,
                        arguments,
                    }
                ),
                (
                    name(),
                    vec((name(), any::<u8>()), 0..4),
                    0..1u64 << crate::ID_BITS,
                    any::<u64>(),
                    name(),
                    name(),
                    bytes(),
                    body()
                )
                    .prop_map(
                        |(
                            vhost,
                            queues,
                            id,
                            timestamp_ms,
                            exchange,
                            routing_key,
                            properties,
                            body,
                        )| {
                            Op::Enqueue {
                                vhost,
                                queues: queues.into(),
                                id,
                                timestamp_ms,
                                exchange,
                                routing_key,
                                properties,
                                body,
                            }
                        }
                    ),
                (name(), name(), vec(any::<u64>(), 0..10), any::<bool>()).prop_map(
                    |(vhost, queue, keys, sized)| Op::Remove {
                        vhost,
                        queue,
                        sizes: match sized {
                            true => keys.iter().map(|k| k >> 40).collect(),
                            false => Vec::new(),
                        },
                        keys,
                    }
                ),
                (name(), name()).prop_map(|(vhost, queue)| Op::Purge { vhost, queue }),
                (
                    name(),
                    name(),
                    any::<u64>(),
                    any::<u64>(),
                    name(),
                    name(),
                    bytes(),
                    body()
                )
                    .prop_map(
                        |(
                            vhost,
                            queue,
                            key,
                            timestamp_ms,
                            exchange,
                            routing_key,
                            properties,
                            body,
                        )| {
                            Op::Spill {
                                vhost,
                                queue,
                                key,
                                timestamp_ms,
                                exchange,
                                routing_key,
                                properties,
                                body,
                            }
                        }
                    ),
                (
                    name(),
                    name(),
                    any::<u64>(),
                    any::<u64>(),
                    proptest::option::of(any::<(u64, u64)>())
                )
                    .prop_map(|(vhost, queue, from, to, counted)| {
                        Op::RemoveRange {
                            vhost,
                            queue,
                            from,
                            to,
                            counted,
                        }
                    }),
                (string(), string(), vec(string(), 0..4)).prop_map(
                    |(name, password_hash, tags)| Op::PutUser {
                        name,
                        password_hash,
                        tags,
                    }
                ),
                string().prop_map(|name| Op::DeleteUser { name }),
                (string(), string(), vec(string(), 0..4)).prop_map(|(name, description, tags)| {
                    Op::PutVhost {
                        name,
                        description,
                        tags,
                    }
                }),
                string().prop_map(|name| Op::DeleteVhost { name }),
                (string(), string(), string(), string(), string()).prop_map(
                    |(user, vhost, configure, write, read)| Op::SetPermissions {
                        user,
                        vhost,
                        configure,
                        write,
                        read,
                    }
                ),
                (string(), string()).prop_map(|(user, vhost)| Op::ClearPermissions { user, vhost }),
                (string(), vec((string(), any::<i64>()), 0..3))
                    .prop_map(|(vhost, limits)| Op::PutVhostLimits { vhost, limits }),
                (string(), vec((string(), any::<i64>()), 0..3))
                    .prop_map(|(user, limits)| Op::PutUserLimits { user, limits }),
                (string(), string(), string(), string(), string()).prop_map(
                    |(user, vhost, exchange, write, read)| Op::SetTopicPermissions {
                        user,
                        vhost,
                        exchange,
                        write,
                        read,
                    }
                ),
                (string(), string(), string()).prop_map(|(user, vhost, exchange)| {
                    Op::ClearTopicPermissions {
                        user,
                        vhost,
                        exchange,
                    }
                }),
            ]
        }

        proptest! {
            #[test]
            fn round_trip(ops in vec(op(), 0..16)) {
                let b = encode_ops(&ops).unwrap();
                prop_assert_eq!(decode_ops(b.clone()), Ok(ops.clone()));
                // Decoding is the inverse both ways: re-encoding gives the same bytes.
                prop_assert_eq!(encode_ops(&ops).unwrap(), b);
            }

            #[test]
            fn damaged_entries_do_not_panic(
                ops in vec(op(), 1..6),
                at in any::<prop::sample::Index>(),
                byte in any::<u8>(),
            ) {
                // One byte of a valid entry replaced: an error or some ops, never a panic.
                let mut v = encode_ops(&ops).unwrap().to_vec();
                let i = at.index(v.len());
                v[i] = byte;
                let _ = decode_ops(Bytes::from(v));
            }

            #[test]
            fn arbitrary_bytes_do_not_panic(v in vec(any::<u8>(), 0..200)) {
                let _ = decode_ops(Bytes::from(v.clone()));
                let mut with_format = vec![FORMAT];
                with_format.extend_from_slice(&v);
                let _ = decode_ops(Bytes::from(with_format));
            }
        }
    }
}

//! Issue 14 point 9: hostile input, systematically. A mutation fuzzer over recorded client
//! sessions (the frames real clients send, encoded by the same codec), on stable Rust. Each
//! input is a session mutated at the byte level (bit flips, interesting bytes, size fields,
//! cuts, insertions, repeats, splices of other sessions) and at the frame level (frames
//! dropped, repeated, swapped, moved to another channel, cut short, retyped), fed as a socket
//! would feed it to a fresh connection: the frame decoder (`FrameCodec`, with the frame_max the
//! session negotiated), the method and field-table parser (amq-protocol), the content
//! assembler and the connection state machine (`Session::handle`), against a transient broker.
//! After each input the connection is torn down as a closed socket tears it down, and the
//! broker must hold no connection, channel, exclusive queue, consumer or unacknowledged
//! message of it. A panic fails the run naming the input's bytes; a watchdog aborts it naming
//! them when one input takes longer than 10 s (a hang).
//!
//! Not reached here: the store and committer (the broker is transient, so durable declares
//! and confirms are answered at once), flow control and the socket paths (`hostile.rs` covers
//! slow and silent clients), and EXTERNAL (no TLS session).
//!
//! CI runs 20,000 inputs. The documented run (README, "Hostile input"):
//!   WARREN_FUZZ_INPUTS=10000000 cargo test -p warren --test amqp -- fuzz --nocapture
//! with `WARREN_FUZZ_SEED` to vary or replay a run.

use amq_protocol::protocol::{
    basic, channel, confirm, connection, exchange, queue, tx, AMQPClass, BasicProperties,
};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::codec::Decoder;
use warren::conn::session::{Next, Session};
use warren::outbox::Outbox;
use warren::{Config, Shared};
use warren_protocol::{FrameCodec, OutBuffer};

/// A field table with every field type RabbitMQ knows, nested.
fn rich_table() -> FieldTable {
    let mut inner = FieldTable::default();
    inner.insert("n".into(), AMQPValue::LongLongInt(-7));
    let mut t = FieldTable::default();
    t.insert("bool".into(), AMQPValue::Boolean(true));
    t.insert("i8".into(), AMQPValue::ShortShortInt(-3));
    t.insert("u8".into(), AMQPValue::ShortShortUInt(200));
    t.insert("i16".into(), AMQPValue::ShortInt(-300));
    t.insert("u16".into(), AMQPValue::ShortUInt(60000));
    t.insert("i32".into(), AMQPValue::LongInt(-70000));
    t.insert("u32".into(), AMQPValue::LongUInt(4_000_000_000));
    t.insert("i64".into(), AMQPValue::LongLongInt(i64::MIN));
    t.insert("f32".into(), AMQPValue::Float(1.5));
    t.insert("f64".into(), AMQPValue::Double(-2.25));
    t.insert(
        "dec".into(),
        AMQPValue::DecimalValue(amq_protocol::types::DecimalValue {
            scale: 2,
            value: 12345,
        }),
    );
    // (No short string: 's' is a signed 16-bit integer in RabbitMQ's tables, as in
    // amq-protocol's parser.)
    t.insert("long".into(), AMQPValue::LongString("long string".into()));
    t.insert(
        "array".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![
            AMQPValue::LongInt(1),
            AMQPValue::LongString("two".into()),
            AMQPValue::FieldTable(inner.clone()),
        ])),
    );
    t.insert("ts".into(), AMQPValue::Timestamp(1_700_000_000));
    t.insert("table".into(), AMQPValue::FieldTable(inner));
    t.insert("void".into(), AMQPValue::Void);
    t.insert(
        "bytes".into(),
        AMQPValue::ByteArray(vec![0u8, 1, 2, 255].into()),
    );
    t
}

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// The frames of a client's handshake: start-ok (PLAIN), tune-ok, open.
fn handshake(out: &mut OutBuffer) {
    let mut caps = FieldTable::default();
    for cap in [
        "authentication_failure_close",
        "connection.blocked",
        "consumer_cancel_notify",
        "publisher_confirms",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props.insert("product".into(), AMQPValue::LongString("fuzz".into()));
    out.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: props,
            mechanism: "PLAIN".into(),
            response: LongString::from("\0guest\0guest"),
            locale: "en_US".into(),
        })),
    );
    out.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: 4096,
            heartbeat: 0,
        })),
    );
    out.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    );
}

fn publish(
    out: &mut OutBuffer,
    ch: u16,
    exchange: &str,
    key: &str,
    props: &BasicProperties,
    body: &[u8],
) {
    out.method(
        ch,
        &AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: exchange.into(),
            routing_key: key.into(),
            mandatory: true,
            immediate: false,
        })),
    );
    out.content_slice(
        ch,
        &warren_protocol::codec::encode_properties(props),
        body,
        4096,
    );
}

fn close_channel(out: &mut OutBuffer, ch: u16) {
    out.method(
        ch,
        &AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
}

fn close_connection(out: &mut OutBuffer) {
    out.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
}

/// The sessions the mutations start from: what clients send after the protocol header.
fn seeds() -> Vec<Vec<u8>> {
    let q = |name: &str| ShortString::from(name.to_string());
    let open = |out: &mut OutBuffer, ch: u16| {
        out.method(
            ch,
            &AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
    };
    let declare = |out: &mut OutBuffer, ch: u16, name: &str, exclusive: bool, a: FieldTable| {
        out.method(
            ch,
            &AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: q(name),
                passive: false,
                durable: false,
                exclusive,
                auto_delete: false,
                nowait: false,
                arguments: a,
            })),
        )
    };
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_headers(rich_table())
        .with_delivery_mode(2)
        .with_priority(5)
        .with_correlation_id("c1".into())
        .with_reply_to("amq.rabbitmq.reply-to".into())
        .with_expiration("60000".into())
        .with_message_id("m1".into())
        .with_timestamp(1_700_000_000)
        .with_type("k".into())
        .with_user_id("guest".into())
        .with_app_id("fuzz".into());
    let mut sessions = Vec::new();

    // 1. Exchanges, bindings, publishes with confirms, a consumer with acks.
    let mut out = OutBuffer::new();
    handshake(&mut out);
    open(&mut out, 1);
    out.method(
        1,
        &AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    );
    out.method(
        1,
        &AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "fz.topic".into(),
            kind: "topic".into(),
            passive: false,
            durable: false,
            auto_delete: true,
            internal: false,
            nowait: false,
            arguments: args(&[("alternate-exchange", AMQPValue::LongString("fz.alt".into()))]),
        })),
    );
    declare(
        &mut out,
        1,
        "fz.q1",
        true,
        args(&[
            ("x-message-ttl", AMQPValue::LongInt(60000)),
            ("x-max-length", AMQPValue::LongInt(10)),
            ("x-overflow", AMQPValue::LongString("reject-publish".into())),
            ("x-dead-letter-exchange", AMQPValue::LongString("".into())),
            (
                "x-dead-letter-routing-key",
                AMQPValue::LongString("fz.dl".into()),
            ),
            ("x-max-priority", AMQPValue::ShortShortUInt(9)),
        ]),
    );
    out.method(
        1,
        &AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: q("fz.q1"),
            exchange: "fz.topic".into(),
            routing_key: "a.*.#".into(),
            nowait: false,
            arguments: rich_table(),
        })),
    );
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 10,
            global: false,
        })),
    );
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: q("fz.q1"),
            consumer_tag: "ctag".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: args(&[("x-priority", AMQPValue::LongInt(3))]),
        })),
    );
    publish(&mut out, 1, "fz.topic", "a.b.c", &props, &[7u8; 600]);
    publish(
        &mut out,
        1,
        "",
        "fz.q1",
        &BasicProperties::default(),
        b"small",
    );
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    );
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: 2,
            multiple: false,
            requeue: true,
        })),
    );
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: "ctag".into(),
            nowait: false,
        })),
    );
    close_channel(&mut out, 1);
    close_connection(&mut out);
    sessions.push(out.to_vec());

    // 2. Transactions, get, reject, recover, purge, deletes, exchange-to-exchange bindings.
    let mut out = OutBuffer::new();
    handshake(&mut out);
    open(&mut out, 2);
    out.method(2, &AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})));
    declare(&mut out, 2, "", true, FieldTable::default());
    declare(&mut out, 2, "fz.q2", true, FieldTable::default());
    out.method(
        2,
        &AMQPClass::Exchange(exchange::AMQPMethod::Declare(exchange::Declare {
            exchange: "fz.fan".into(),
            kind: "fanout".into(),
            passive: false,
            durable: false,
            auto_delete: true,
            internal: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    out.method(
        2,
        &AMQPClass::Exchange(exchange::AMQPMethod::Bind(exchange::Bind {
            destination: "fz.fan".into(),
            source: "amq.direct".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    out.method(
        2,
        &AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: q("fz.q2"),
            exchange: "fz.fan".into(),
            routing_key: "".into(),
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    publish(&mut out, 2, "amq.direct", "k", &props, b"in a transaction");
    out.method(2, &AMQPClass::Tx(tx::AMQPMethod::Commit(tx::Commit {})));
    out.method(
        2,
        &AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: q("fz.q2"),
            no_ack: false,
        })),
    );
    out.method(
        2,
        &AMQPClass::Basic(basic::AMQPMethod::Reject(basic::Reject {
            delivery_tag: 1,
            requeue: true,
        })),
    );
    out.method(
        2,
        &AMQPClass::Basic(basic::AMQPMethod::Recover(basic::Recover { requeue: true })),
    );
    out.method(2, &AMQPClass::Tx(tx::AMQPMethod::Rollback(tx::Rollback {})));
    out.method(
        2,
        &AMQPClass::Queue(queue::AMQPMethod::Purge(queue::Purge {
            queue: q("fz.q2"),
            nowait: false,
        })),
    );
    out.method(
        2,
        &AMQPClass::Queue(queue::AMQPMethod::Unbind(queue::Unbind {
            queue: q("fz.q2"),
            exchange: "fz.fan".into(),
            routing_key: "".into(),
            arguments: FieldTable::default(),
        })),
    );
    out.method(
        2,
        &AMQPClass::Exchange(exchange::AMQPMethod::Unbind(exchange::Unbind {
            destination: "fz.fan".into(),
            source: "amq.direct".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    out.method(
        2,
        &AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: q("fz.q2"),
            if_unused: false,
            if_empty: false,
            nowait: false,
        })),
    );
    out.method(
        2,
        &AMQPClass::Exchange(exchange::AMQPMethod::Delete(exchange::Delete {
            exchange: "fz.fan".into(),
            if_unused: false,
            nowait: false,
        })),
    );
    out.method(
        2,
        &AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
    );
    close_channel(&mut out, 2);
    close_connection(&mut out);
    sessions.push(out.to_vec());

    // 3. Several channels interleaving contents, heartbeats, direct reply-to, a passive
    // declare of a missing queue (a channel error) and work after it.
    let mut out = OutBuffer::new();
    handshake(&mut out);
    open(&mut out, 1);
    open(&mut out, 3);
    out.heartbeat();
    out.method(
        3,
        &AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: q("amq.rabbitmq.reply-to"),
            consumer_tag: "".into(),
            no_local: false,
            no_ack: true,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    );
    declare(
        &mut out,
        1,
        "fz.q3",
        true,
        args(&[("x-queue-mode", AMQPValue::LongString("lazy".into()))]),
    );
    publish(&mut out, 3, "", "fz.q3", &props, &[1u8; 700]);
    publish(&mut out, 1, "", "fz.q3", &BasicProperties::default(), b"");
    out.method(
        1,
        &AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: q("fz.missing"),
            passive: true,
            ..Default::default()
        })),
    );
    out.method(
        1,
        &AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    );
    open(&mut out, 1);
    out.method(
        1,
        &AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: q("fz.q3"),
            no_ack: true,
        })),
    );
    close_connection(&mut out);
    sessions.push(out.to_vec());

    // 4. A handshake with AMQPLAIN and nothing more.
    let mut out = OutBuffer::new();
    let mut login = Vec::new();
    for (k, v) in [("LOGIN", "guest"), ("PASSWORD", "guest")] {
        login.push(k.len() as u8);
        login.extend_from_slice(k.as_bytes());
        login.push(b'S');
        login.extend_from_slice(&(v.len() as u32).to_be_bytes());
        login.extend_from_slice(v.as_bytes());
    }
    out.method(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: rich_table(),
            mechanism: "AMQPLAIN".into(),
            response: LongString::from(login),
            locale: "en_US".into(),
        })),
    );
    sessions.push(out.to_vec());
    sessions
}

/// Bytes that break things when they land in sizes, types and flags.
const INTERESTING: [u8; 10] = [0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff, 0xce, b'F', b'A', b'S'];

/// Where the frames of `data` lie, as far as their size fields can be followed.
fn frame_spans(data: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let mut at = 0;
    while at + 7 <= data.len() {
        let size = u32::from_be_bytes([data[at + 3], data[at + 4], data[at + 5], data[at + 6]]);
        let end = at + 8 + size as usize;
        if end > data.len() {
            break;
        }
        spans.push(at..end);
        at = end;
    }
    spans
}

/// A mutation of whole frames: dropped, repeated, swapped with the next, moved to another
/// channel, or with its payload cut or grown (its size field kept or fixed).
fn mutate_frames(rng: &mut StdRng, data: &mut Vec<u8>) -> bool {
    let spans = frame_spans(data);
    if spans.len() < 2 {
        return false;
    }
    // Mostly past the handshake (its three frames), so that most inputs reach an open
    // connection and its channels; now and then the handshake itself.
    let first = if spans.len() > 4 && rng.random_range(0..8) != 0 {
        3
    } else {
        0
    };
    let i = rng.random_range(first..spans.len());
    let f = spans[i].clone();
    match rng.random_range(0..6) {
        0 => {
            data.drain(f);
        }
        1 => {
            let copy = data[f.clone()].to_vec();
            let to = spans[rng.random_range(0..spans.len())].start;
            data.splice(to..to, copy);
        }
        2 if i + 1 < spans.len() => {
            let (a, b) = (
                data[f.clone()].to_vec(),
                data[spans[i + 1].clone()].to_vec(),
            );
            let mut both = b;
            both.extend_from_slice(&a);
            data.splice(f.start..spans[i + 1].end, both);
        }
        3 => {
            let ch: u16 = match rng.random_range(0..3) {
                0 => 0,
                1 => rng.random_range(1..20),
                _ => rng.random(),
            };
            data[f.start + 1..f.start + 3].copy_from_slice(&ch.to_be_bytes());
        }
        4 => {
            // The payload cut short, its size field fixed to match (a valid frame with a
            // truncated method, header or body).
            let payload = f.len() - 8;
            if payload > 0 {
                let keep = rng.random_range(0..payload);
                data.drain(f.start + 7 + keep..f.end - 1);
                data[f.start + 3..f.start + 7].copy_from_slice(&(keep as u32).to_be_bytes());
            }
        }
        _ => {
            // A frame type changed (a method where a body was due, a heartbeat with a payload).
            data[f.start] = [1u8, 2, 3, 8, 4, 0][rng.random_range(0..6)];
        }
    }
    true
}

/// One mutation of a session, in place.
fn mutate(rng: &mut StdRng, data: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    if data.is_empty() {
        data.push(rng.random());
        return;
    }
    if rng.random_range(0..3) == 0 && mutate_frames(rng, data) {
        return;
    }
    // As for frames: mostly past the handshake.
    let handshake = frame_spans(data).get(2).map_or(0, |f| f.end);
    let at = if handshake < data.len() && rng.random_range(0..8) != 0 {
        rng.random_range(handshake..data.len())
    } else {
        rng.random_range(0..data.len())
    };
    match rng.random_range(0..9) {
        // Flip a bit.
        0 => data[at] ^= 1 << rng.random_range(0..8),
        // An interesting byte.
        1 => data[at] = INTERESTING[rng.random_range(0..INTERESTING.len())],
        // A random byte.
        2 => data[at] = rng.random(),
        // A big-endian 32-bit size (a frame's, a long string's or a table's).
        3 => {
            let v: u32 = match rng.random_range(0..4) {
                0 => 0,
                1 => u32::MAX,
                2 => rng.random_range(0..70_000),
                _ => rng.random(),
            };
            let end = (at + 4).min(data.len());
            data[at..end].copy_from_slice(&v.to_be_bytes()[..end - at]);
        }
        // Cut it short.
        4 => data.truncate(at),
        // Drop a few bytes.
        5 => {
            let n = rng.random_range(1..=16).min(data.len() - at);
            data.drain(at..at + n);
        }
        // Insert a few random bytes.
        6 => {
            let n = rng.random_range(1..=16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            data.splice(at..at, bytes);
        }
        // Repeat a stretch (a frame sent twice, a method out of order).
        7 => {
            let n = rng.random_range(1..=64).min(data.len() - at);
            let copy = data[at..at + n].to_vec();
            let to = rng.random_range(0..=data.len());
            data.splice(to..to, copy);
        }
        // Splice in a stretch of another session.
        _ => {
            let other = &seeds[rng.random_range(0..seeds.len())];
            if other.is_empty() {
                return;
            }
            let from = rng.random_range(0..other.len());
            let n = rng.random_range(1..=256).min(other.len() - from);
            let to = rng.random_range(0..=data.len());
            data.splice(to..to, other[from..from + n].iter().copied());
        }
    }
}

/// Feed `input` to a fresh connection as its socket would, then tear it down; returns the
/// frames it handled, whether the connection got open, and how many frames it handled open.
fn run_one(shared: &Arc<Shared>, input: &[u8]) -> (u64, bool, u64) {
    let peer: std::net::SocketAddr = "127.0.0.1:40000".parse().expect("addr");
    let outbox = Arc::new(Outbox::new(shared.config.frame_max));
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let mut session = Session::new(shared.clone(), outbox, peer, tx);
    session.start();
    let mut codec = FrameCodec::new(session.frame_max());
    let mut buf = BytesMut::from(input);
    let (mut frames, mut opened, mut open_frames) = (0, false, 0);
    loop {
        codec.frame_max = session.frame_max();
        match codec.decode(&mut buf) {
            Ok(Some(frame)) => {
                frames += 1;
                open_frames += session.is_open() as u64;
                let next = session.handle(frame);
                opened |= session.is_open();
                if matches!(next, Next::Close) {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                session.frame_error(&e);
                break;
            }
        }
    }
    session.teardown();
    (frames, opened, open_frames)
}

/// A transient broker with short handshake limits; replaced now and then so that what inputs
/// leave behind (queues, messages) does not pile up over millions of them.
fn broker() -> Arc<Shared> {
    Shared::new(Config {
        frame_max: 131072,
        ..Default::default()
    })
}

#[test]
fn fuzz_mutated_sessions_never_panic_hang_or_leak() {
    let inputs: u64 = std::env::var("WARREN_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("WARREN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let seeds = seeds();
    // The seeds themselves are well-formed sessions: each opens its connection and is
    // handled to its last frame.
    for s in &seeds[..3] {
        let mut codec = FrameCodec::new(0);
        let mut buf = BytesMut::from(&s[..]);
        let mut frames = 0;
        while let Ok(Some(_)) = codec.decode(&mut buf) {
            frames += 1;
        }
        assert!(buf.is_empty());
        let (handled, opened, _) = run_one(&broker(), s);
        assert_eq!((handled, opened), (frames, true));
    }
    let done = Arc::new(AtomicU64::new(0));
    let current: Arc<parking_lot::Mutex<Vec<u8>>> = Default::default();
    // A watchdog: an input that takes over 10 s is a hang. It writes to the process's stderr
    // itself (a test's own output is captured and printed only at the end, which an abort
    // never reaches), naming the input's bytes.
    let watch = done.clone();
    let stuck = current.clone();
    let watchdog = std::thread::spawn(move || {
        let mut last = (0, Instant::now());
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let now = watch.load(Ordering::Relaxed);
            if now == u64::MAX {
                return;
            }
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(10) {
                let hex: String = stuck.lock().iter().map(|b| format!("{b:02x}")).collect();
                let _ = writeln!(
                    std::io::stderr(),
                    "fuzz: input {now} has run for over 10 s (seed {seed}): a hang; its bytes: {hex}"
                );
                std::process::abort();
            }
        }
    });
    // However the loop ends (a finding panics), the watchdog stops: it must not abort the
    // process later, in another test, and lose the report.
    struct Stop(Arc<AtomicU64>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(u64::MAX, Ordering::Relaxed);
        }
    }
    let _stop = Stop(done.clone());
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let mut shared = broker();
    let (mut frames, mut opened, mut open_frames) = (0u64, 0u64, 0u64);
    for i in 0..inputs {
        if i % 5_000 == 0 && i > 0 {
            shared = broker();
        }
        let mut data = seeds[rng.random_range(0..seeds.len())].clone();
        for _ in 0..rng.random_range(1..=8) {
            mutate(&mut rng, &mut data, &seeds);
        }
        current.lock().clone_from(&data);
        let ran =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_one(&shared, &data)));
        if let Ok((f, o, of)) = ran {
            frames += f;
            opened += o as u64;
            open_frames += of;
        } else {
            let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
            panic!("fuzz: input {i} (seed {seed}) panicked; its bytes: {hex}");
        }
        // Nothing of the connection is left: no connection or channel, no exclusive queue,
        // no consumer, no message held unacknowledged.
        let (conns, channels) = shared.query(|b| b.connection_totals());
        let left = shared.query(|b| {
            b.queue_views(None)
                .into_iter()
                .filter(|q| q.exclusive || q.consumers > 0 || q.messages_unacknowledged > 0)
                .map(|q| q.name)
                .collect::<Vec<_>>()
        });
        if (conns, channels) != (0, 0) || !left.is_empty() {
            let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
            panic!(
                "fuzz: input {i} (seed {seed}) leaked: {conns} connections, {channels} \
                 channels, queues {left:?}; its bytes: {hex}"
            );
        }
        done.store(i + 1, Ordering::Relaxed);
    }
    done.store(u64::MAX, Ordering::Relaxed);
    let _ = watchdog.join();
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "fuzz: {inputs} inputs (seed {seed}) in {secs:.1} s ({:.0}/s), no panic, no hang, \
         no leak; {frames} frames handled, {opened} connections got open and handled \
         {open_frames} frames open",
        inputs as f64 / secs
    );
    // The mutations must leave sessions deep enough: most past the handshake, and many
    // frames handled on open connections (channels, contents, the broker behind them).
    assert!(
        opened * 2 > inputs && open_frames > 4 * inputs,
        "too shallow: {opened} of {inputs} inputs opened a connection, {open_frames} frames \
         handled open"
    );
}

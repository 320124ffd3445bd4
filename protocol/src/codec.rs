//! Frame codec: a `tokio_util` [`Decoder`] over amq-protocol's parsers, and an output buffer
//! that writes frames with amq-protocol's generators.
//!
//! Why not `amq_protocol::frame::parse_frame` directly: it copies every body frame into a
//! `Vec<u8>`, and it cannot tell "frame too large" or "bad frame end" apart from "not enough
//! bytes yet". We read the 7-byte frame header ourselves (type, channel, size), enforce
//! `frame_max` before buffering anything, check the end octet, and only then hand the payload to
//! amq-protocol's `parse_class` / `parse_content_header`. Body payloads are split off the read
//! buffer as `Bytes` without a copy.

use crate::body::Body;
use amq_protocol::frame::parsing::parse_content_header;
use amq_protocol::frame::WriteContext;
use amq_protocol::protocol::{basic, basic::AMQPProperties, constants, parse_class, AMQPClass};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::collections::VecDeque;
use std::io::IoSlice;
use tokio_util::codec::Decoder;

/// The only protocol header we speak, and what we answer to any other.
pub const PROTOCOL_HEADER: [u8; 8] = *b"AMQP\x00\x00\x09\x01";

/// Frame header (type, channel, size) plus the end octet.
pub const FRAME_OVERHEAD: usize = 8;

/// One decoded frame.
///
/// The content header's properties are held inline rather than boxed: a frame is built once and
/// moved a few times, and the box was one heap allocation per published message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Method(u16, AMQPClass),
    /// basic.publish, the one method every message starts with: its names shared (see
    /// [`crate::content::Publish`]). `Frame::into_method` gives the generic form.
    Publish(u16, crate::content::Publish),
    /// A content header. `raw_properties` is the encoded property flags and list exactly as the
    /// publisher sent them; we forward these bytes unchanged so every property and header table
    /// round-trips byte for byte (amq-protocol's `FieldTable` is a sorted map and would reorder).
    Header {
        channel: u16,
        class_id: u16,
        body_size: u64,
        properties: AMQPProperties,
        raw_properties: Bytes,
    },
    Body(u16, Bytes),
    /// A heartbeat; a non-zero channel is a protocol error the connection reports.
    Heartbeat(u16),
}

impl Frame {
    /// A `Publish` as the `Method` it is (other frames unchanged).
    pub fn into_method(self) -> Frame {
        match self {
            Frame::Publish(ch, p) => {
                Frame::Method(ch, AMQPClass::Basic(basic::AMQPMethod::Publish(p.into())))
            }
            other => other,
        }
    }

    pub fn channel(&self) -> u16 {
        match self {
            Frame::Method(ch, _)
            | Frame::Publish(ch, _)
            | Frame::Body(ch, _)
            | Frame::Heartbeat(ch) => *ch,
            Frame::Header { channel, .. } => *channel,
        }
    }
}

/// Why a byte stream is not a valid frame. Every variant is a connection error.
///
/// The texts follow RabbitMQ's (it prints the frame type and payload as Erlang terms), since
/// clients and operators grep for them.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("type {frame_type}, all octets = <<>>: {{frame_too_large,{size},{limit}}}", limit = max.saturating_sub(8))]
    TooLarge { frame_type: u8, size: u32, max: u32 },
    #[error("type {frame_type}, all octets = <<>>: {{invalid_frame_end_marker,{end}}}")]
    BadFrameEnd { frame_type: u8, end: u8 },
    #[error(
        "type {frame_type}, all octets = {}: unknown_frame",
        erlang_binary(payload)
    )]
    UnknownType { frame_type: u8, payload: Bytes },
    #[error("unknown method {class_id}.{method_id}")]
    UnknownMethod { class_id: u16, method_id: u16 },
    #[error("cannot decode {}", erlang_binary(arguments))]
    BadMethod {
        class_id: u16,
        method_id: u16,
        arguments: Bytes,
    },
    #[error("cannot decode content header {}", erlang_binary(payload))]
    BadHeader { payload: Bytes },
    /// Field tables nested deeper than `nesting::MAX_NESTING` (in a method's arguments, or
    /// a content header's headers when `class_id` is 60 and `method_id` 0): refused before
    /// amq-protocol parses them by recursion.
    #[error(
        "field table nested deeper than {} levels",
        crate::nesting::MAX_NESTING
    )]
    TooDeep { class_id: u16, method_id: u16 },
    /// basic.qos with a prefetch size: RabbitMQ refuses it with 540 (amq-protocol drops the
    /// field while parsing, so the codec checks the raw payload).
    #[error("prefetch_size!=0 ({0})")]
    PrefetchSize(u32),
    #[error("io: {0}")]
    Io(String),
}

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        FrameError::Io(e.to_string())
    }
}

/// Decodes frames; `frame_max` is the negotiated limit (0 = none), set after tune-ok.
#[derive(Debug)]
pub struct FrameCodec {
    pub frame_max: u32,
    /// The last basic.publish payload and what it decoded to. Publishers send the same
    /// publish method (exchange, routing key, flags) message after message; parsing it costs
    /// four heap allocations (amq-protocol builds its flag names as strings) and the names
    /// one each; the remembered one is handed out again, its names shared.
    last_publish: Option<(Vec<u8>, crate::content::Publish)>,
}

/// Publish payloads longer than this are not remembered (a short string is at most 255 bytes;
/// two of them plus the fixed fields fit).
const PUBLISH_MEMO_MAX: usize = 600;

impl FrameCodec {
    pub fn new(frame_max: u32) -> Self {
        FrameCodec {
            frame_max,
            last_publish: None,
        }
    }

    /// Decode a method frame; a basic.publish is `Frame::Publish`, the last one reused when
    /// the bytes are the same.
    fn method(&mut self, channel: u16, payload: &Bytes) -> Result<Frame, FrameError> {
        if !payload.starts_with(&[0, 60, 0, 40]) {
            return Ok(Frame::Method(channel, parse_method(payload)?));
        }
        if let Some((raw, publish)) = &self.last_publish {
            if raw[..] == payload[..] {
                return Ok(Frame::Publish(channel, publish.clone()));
            }
        }
        let class = parse_method(payload)?;
        let AMQPClass::Basic(basic::AMQPMethod::Publish(p)) = class else {
            return Ok(Frame::Method(channel, class));
        };
        let p = crate::content::Publish::from(p);
        if payload.len() <= PUBLISH_MEMO_MAX {
            let mut raw = self.last_publish.take().map(|(v, _)| v).unwrap_or_default();
            raw.clear();
            raw.extend_from_slice(payload);
            self.last_publish = Some((raw, p.clone()));
        }
        Ok(Frame::Publish(channel, p))
    }
}

/// Whether amq-protocol knows this (class, method) pair. Lets us answer 540 NOT_IMPLEMENTED for
/// methods that do not exist and 502 SYNTAX_ERROR for known methods with a broken payload.
fn method_known(class_id: u16, method_id: u16) -> bool {
    let methods: &[u16] = match class_id {
        10 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61, 70, 71],
        20 => &[10, 11, 20, 21, 40, 41],
        30 => &[10, 11],
        40 => &[10, 11, 20, 21, 30, 31, 40, 51],
        50 => &[10, 11, 20, 21, 30, 31, 40, 41, 50, 51],
        60 => &[
            10, 11, 20, 21, 30, 31, 40, 50, 60, 70, 71, 72, 80, 90, 100, 110, 111, 120,
        ],
        85 => &[10, 11],
        90 => &[10, 11, 20, 21, 30, 31],
        _ => &[],
    };
    methods.contains(&method_id)
}

/// Format bytes as Erlang prints a binary: `<<"text">>` when printable, else `<<1,2,3>>`
/// (cut after 64 bytes).
pub fn erlang_binary(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(64)];
    let more = if bytes.len() > cut.len() { ",..." } else { "" };
    if !cut.is_empty() && cut.iter().all(|b| (0x20..0x7f).contains(b)) {
        let text: String = cut
            .iter()
            .flat_map(|&b| match b {
                b'"' => vec!['\\', '"'],
                b'\\' => vec!['\\', '\\'],
                b => vec![b as char],
            })
            .collect();
        format!("<<\"{text}\"{more}>>")
    } else {
        let nums: Vec<String> = cut.iter().map(|b| b.to_string()).collect();
        format!("<<{}{more}>>", nums.join(","))
    }
}

/// Parse one method payload (class id, method id, arguments).
pub fn parse_method(payload: &Bytes) -> Result<AMQPClass, FrameError> {
    if payload.len() < 4 {
        return Err(FrameError::BadMethod {
            class_id: 0,
            method_id: 0,
            arguments: payload.clone(),
        });
    }
    let class_id = u16::from_be_bytes([payload[0], payload[1]]);
    let method_id = u16::from_be_bytes([payload[2], payload[3]]);
    if !method_known(class_id, method_id) {
        return Err(FrameError::UnknownMethod {
            class_id,
            method_id,
        });
    }
    if (class_id, method_id) == (60, 10) && payload.len() >= 8 {
        let size = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
        if size != 0 {
            return Err(FrameError::PrefetchSize(size));
        }
    }
    if crate::nesting::method_too_deep(class_id, method_id, &payload[4..]) {
        return Err(FrameError::TooDeep {
            class_id,
            method_id,
        });
    }
    match parse_class(&payload[..]) {
        // Trailing bytes after a complete method are tolerated, as RabbitMQ does.
        Ok((_rest, class)) => Ok(class),
        Err(_) => Err(FrameError::BadMethod {
            class_id,
            method_id,
            arguments: payload.slice(4..),
        }),
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if src.len() < 7 {
            return Ok(None);
        }
        let frame_type = src[0];
        let channel = u16::from_be_bytes([src[1], src[2]]);
        let size = u32::from_be_bytes([src[3], src[4], src[5], src[6]]);
        // RabbitMQ compares the payload size with frame_max (it allows the 8 octets of framing on
        // top, its "fudge"); clients in the wild rely on that leniency, so we do the same.
        if self.frame_max != 0 && size > self.frame_max {
            return Err(FrameError::TooLarge {
                frame_type,
                size,
                max: self.frame_max,
            });
        }
        let total = 7 + size as usize + 1;
        if src.len() < total {
            src.reserve(total - src.len());
            return Ok(None);
        }
        let end = src[total - 1];
        if end != constants::FRAME_END {
            return Err(FrameError::BadFrameEnd { frame_type, end });
        }
        src.advance(7);
        let payload = src.split_to(size as usize).freeze();
        src.advance(1);
        if !matches!(
            frame_type,
            constants::FRAME_METHOD
                | constants::FRAME_HEADER
                | constants::FRAME_BODY
                | constants::FRAME_HEARTBEAT
        ) {
            return Err(FrameError::UnknownType {
                frame_type,
                payload,
            });
        }
        let frame = match frame_type {
            constants::FRAME_METHOD => self.method(channel, &payload)?,
            constants::FRAME_HEADER => {
                if crate::nesting::header_too_deep(&payload[..]) {
                    return Err(FrameError::TooDeep {
                        class_id: 60,
                        method_id: 0,
                    });
                }
                let header = parse_content_header(&payload[..])
                    .map_err(|_| FrameError::BadHeader {
                        payload: payload.clone(),
                    })?
                    .1;
                // class-id (2) + weight (2) + body size (8) precede the property flags.
                Frame::Header {
                    channel,
                    class_id: header.class_id,
                    body_size: header.body_size,
                    properties: header.properties,
                    raw_properties: payload.slice(12..),
                }
            }
            constants::FRAME_BODY => Frame::Body(channel, payload),
            _ => Frame::Heartbeat(channel),
        };
        Ok(Some(frame))
    }
}

/// Body slices at least this long are written from the message's own memory (one entry of a
/// vectored write) instead of being copied into the buffer; shorter ones are cheaper to copy.
pub const SHARE_MIN: usize = 8 * 1024;

/// An output buffer frames are written into before one (vectored) write per batch.
///
/// Methods are generated by amq-protocol. Content headers are written around the publisher's
/// own encoded properties. Body frames are split at `frame_max - 8`; their payloads are copied
/// in when short, and otherwise kept as shared slices of the message body (no copy: the socket
/// write gathers them). It implements [`Buf`], so `write_all_buf` writes it with `writev`.
#[derive(Debug, Default)]
pub struct OutBuffer {
    /// Written before `tail`, in order.
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    chunked: usize,
    /// Frames encoded in place.
    tail: BytesMut,
    /// Reused space the method generator writes into (it takes its buffer by value).
    scratch: Vec<u8>,
}

impl OutBuffer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.chunked + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Everything buffered, as one contiguous copy (tests and tools).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for c in &self.chunks {
            v.extend_from_slice(c);
        }
        v.extend_from_slice(&self.tail);
        v
    }

    pub fn clear(&mut self) {
        self.chunks.clear();
        self.chunked = 0;
        self.tail.clear();
    }

    pub fn raw(&mut self, bytes: &[u8]) {
        self.tail.extend_from_slice(bytes);
    }

    /// Append `bytes` without copying them.
    fn share(&mut self, bytes: Bytes) {
        if !self.tail.is_empty() {
            let head = self.tail.split().freeze();
            self.chunked += head.len();
            self.chunks.push_back(head);
        }
        self.chunked += bytes.len();
        self.chunks.push_back(bytes);
    }

    /// Move the first `n` bytes into `into` (appended there). `n` must not exceed `len()`.
    pub fn move_front(&mut self, mut n: usize, into: &mut OutBuffer) {
        assert!(n <= self.len(), "move_front past the end");
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() <= n {
                let c = self.chunks.pop_front().unwrap_or_default();
                n -= c.len();
                self.chunked -= c.len();
                into.share(c);
            } else {
                let c = front.split_to(n);
                self.chunked -= n;
                n = 0;
                into.share(c);
            }
        }
        if n > 0 {
            into.raw(&self.tail[..n]);
            self.tail.advance(n);
        }
    }

    /// A method frame; the arguments are generated by amq-protocol (without cloning the method).
    pub fn method(&mut self, channel: u16, method: &AMQPClass) {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        // Generation into a Vec only fails on values the spec cannot carry (a short string over
        // 255 bytes): such a frame is dropped.
        if let Ok(ctx) = amq_protocol::protocol::gen_class(method)(WriteContext::from(scratch)) {
            let payload = ctx.into_inner().0;
            self.frame_start(constants::FRAME_METHOD, channel, payload.len());
            self.tail.extend_from_slice(&payload);
            self.tail.put_u8(constants::FRAME_END);
            self.scratch = payload;
        }
    }

    /// basic.deliver, written directly: it is sent once per message, and building an
    /// `AMQPClass` for it would copy the consumer tag, exchange and routing key each time. The
    /// bytes are checked against amq-protocol's generator in the tests below.
    pub fn deliver(
        &mut self,
        channel: u16,
        consumer_tag: &str,
        delivery_tag: u64,
        redelivered: bool,
        exchange: &str,
        routing_key: &str,
    ) {
        let short = |s: &str| s.len().min(255);
        let (t, x, k) = (short(consumer_tag), short(exchange), short(routing_key));
        let size = 4 + 1 + t + 8 + 1 + 1 + x + 1 + k;
        self.frame_start(constants::FRAME_METHOD, channel, size);
        let b = &mut self.tail;
        b.extend_from_slice(&[0, 60, 0, 60]);
        b.put_u8(t as u8);
        b.extend_from_slice(&consumer_tag.as_bytes()[..t]);
        b.put_u64(delivery_tag);
        b.put_u8(redelivered as u8);
        b.put_u8(x as u8);
        b.extend_from_slice(&exchange.as_bytes()[..x]);
        b.put_u8(k as u8);
        b.extend_from_slice(&routing_key.as_bytes()[..k]);
        b.put_u8(constants::FRAME_END);
    }

    /// basic.ack (a publisher confirm), written directly for the same reason as `deliver`:
    /// amq-protocol's generator allocates three times for its one flag. Checked against it in
    /// the tests below.
    pub fn ack(&mut self, channel: u16, delivery_tag: u64, multiple: bool) {
        self.frame_start(constants::FRAME_METHOD, channel, 13);
        let b = &mut self.tail;
        b.extend_from_slice(&[0, 60, 0, 80]);
        b.put_u64(delivery_tag);
        b.put_u8(multiple as u8);
        b.put_u8(constants::FRAME_END);
    }

    pub fn heartbeat(&mut self) {
        self.tail
            .extend_from_slice(&[constants::FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, 206]);
    }

    /// Content header + body frames for a body given as one slice (copied in; tools and tests).
    pub fn content_slice(
        &mut self,
        channel: u16,
        raw_properties: &[u8],
        body: &[u8],
        frame_max: u32,
    ) {
        self.content_header(channel, raw_properties, body.len());
        for part in body.chunks(body_chunk(frame_max)) {
            self.frame_start(constants::FRAME_BODY, channel, part.len());
            self.tail.extend_from_slice(part);
            self.tail.put_u8(constants::FRAME_END);
        }
    }

    /// A frame's type, channel and payload size. Room is reserved for a payload short enough
    /// to be copied in; a longer one is shared (or, from `content_slice`, grows the buffer).
    fn frame_start(&mut self, frame_type: u8, channel: u16, size: usize) {
        let t = &mut self.tail;
        t.reserve(FRAME_OVERHEAD + if size < SHARE_MIN { size } else { 0 });
        t.put_u8(frame_type);
        t.put_u16(channel);
        t.put_u32(size as u32);
    }

    fn content_header(&mut self, channel: u16, raw_properties: &[u8], body_size: usize) {
        self.frame_start(constants::FRAME_HEADER, channel, 12 + raw_properties.len());
        let t = &mut self.tail;
        t.put_u16(60);
        t.put_u16(0);
        t.put_u64(body_size as u64);
        t.extend_from_slice(raw_properties);
        t.put_u8(constants::FRAME_END);
    }

    /// Content header + body frames for one message.
    pub fn content(&mut self, channel: u16, raw_properties: &[u8], body: &Body, frame_max: u32) {
        self.content_header(channel, raw_properties, body.len());
        let chunk = body_chunk(frame_max);
        let mut reader = body.reader();
        while reader.has_remaining() {
            let size = reader.remaining().min(chunk);
            self.frame_start(constants::FRAME_BODY, channel, size);
            let mut left = size;
            while left > 0 {
                if reader.chunk().len().min(left) >= SHARE_MIN {
                    if let Some(piece) = reader.next_slice(left) {
                        left -= piece.len();
                        self.share(piece);
                    }
                } else {
                    let n = reader.chunk().len().min(left);
                    self.tail.extend_from_slice(&reader.chunk()[..n]);
                    reader.advance(n);
                    left -= n;
                }
            }
            self.tail.put_u8(constants::FRAME_END);
        }
    }
}

/// The most body bytes one frame carries under `frame_max` (0 = no limit).
fn body_chunk(frame_max: u32) -> usize {
    if frame_max == 0 {
        usize::MAX
    } else {
        (frame_max as usize).saturating_sub(FRAME_OVERHEAD).max(1)
    }
}

impl Buf for OutBuffer {
    fn remaining(&self) -> usize {
        self.len()
    }

    fn chunk(&self) -> &[u8] {
        match self.chunks.front() {
            Some(c) => c,
            None => &self.tail,
        }
    }

    fn advance(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() <= cnt {
                cnt -= front.len();
                self.chunked -= front.len();
                self.chunks.pop_front();
            } else {
                front.advance(cnt);
                self.chunked -= cnt;
                cnt = 0;
            }
        }
        if cnt > 0 {
            self.tail.advance(cnt);
        }
        if self.tail.is_empty() {
            // Lets the next frame reuse the buffer from its start.
            self.tail.clear();
        }
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for c in &self.chunks {
            if n == dst.len() {
                return n;
            }
            dst[n] = IoSlice::new(c);
            n += 1;
        }
        if n < dst.len() && !self.tail.is_empty() {
            dst[n] = IoSlice::new(&self.tail);
            n += 1;
        }
        n
    }
}

/// Encode a property set (used when the broker itself creates or changes a message).
pub fn encode_properties(props: &AMQPProperties) -> Bytes {
    use amq_protocol::protocol::basic::gen_properties;
    match gen_properties(props)(WriteContext::from(Vec::new())) {
        Ok(ctx) => Bytes::from(ctx.into_inner().0),
        Err(_) => Bytes::from_static(&[0, 0]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::{basic, queue};

    fn encode(class: &AMQPClass) -> Vec<u8> {
        let mut out = OutBuffer::new();
        out.method(1, class);
        out.to_vec()
    }

    fn declare() -> AMQPClass {
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q1".into(),
            durable: true,
            ..Default::default()
        }))
    }

    #[test]
    fn every_split_point_of_a_method_frame_is_partial_then_complete() {
        let bytes = encode(&declare());
        for split in 0..bytes.len() {
            let mut codec = FrameCodec::new(131072);
            let mut buf = BytesMut::from(&bytes[..split]);
            assert_eq!(codec.decode(&mut buf), Ok(None), "split at {split}");
            buf.extend_from_slice(&bytes[split..]);
            assert_eq!(
                codec.decode(&mut buf),
                Ok(Some(Frame::Method(1, declare())))
            );
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn content_frames_round_trip_and_split_at_frame_max() {
        let props = AMQPProperties::default()
            .with_content_type("text/plain".into())
            .with_delivery_mode(2);
        let raw = encode_properties(&props);
        let body = vec![7u8; 10_000];
        let mut out = OutBuffer::new();
        out.content(3, &raw, &Body::from(body.clone()), 4096);
        let mut buf = BytesMut::from(&out.to_vec()[..]);
        let mut codec = FrameCodec::new(4096);
        match codec.decode(&mut buf) {
            Ok(Some(Frame::Header {
                channel,
                class_id,
                body_size,
                properties,
                raw_properties,
            })) => {
                assert_eq!((channel, class_id, body_size), (3, 60, 10_000));
                assert_eq!(properties, props);
                assert_eq!(raw_properties, raw);
            }
            other => panic!("expected header, got {other:?}"),
        }
        let mut got = Vec::new();
        let mut frames = 0;
        while let Ok(Some(Frame::Body(3, part))) = codec.decode(&mut buf) {
            assert!(part.len() <= 4096 - 8);
            got.extend_from_slice(&part);
            frames += 1;
        }
        assert_eq!(frames, 3);
        assert_eq!(got, body);
    }

    /// A body kept as several parts goes out as the same frames as one contiguous body, its
    /// long slices shared rather than copied, and the buffer can be written (Buf) or split
    /// (move_front) at any byte.
    #[test]
    fn segmented_bodies_are_framed_like_contiguous_ones() {
        let raw = encode_properties(&AMQPProperties::default());
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let parts = vec![
            Bytes::copy_from_slice(&data[..20_000]),
            Bytes::copy_from_slice(&data[20_000..20_005]),
            Bytes::copy_from_slice(&data[20_005..]),
        ];
        for frame_max in [4096u32, 131_072, 0] {
            let mut expected = OutBuffer::new();
            expected.heartbeat();
            expected.content_slice(1, &raw, &data, frame_max);
            let expected = expected.to_vec();
            let mut out = OutBuffer::new();
            out.heartbeat();
            out.content(1, &raw, &Body::from_parts(parts.clone()), frame_max);
            assert_eq!(out.len(), expected.len());
            assert_eq!(out.to_vec(), expected, "frame_max {frame_max}");
            if frame_max != 4096 {
                let mut slices = [IoSlice::new(&[]); 16];
                assert!(
                    out.chunks_vectored(&mut slices) > 2,
                    "long parts are shared"
                );
            }
            for split in [
                0,
                1,
                8,
                30,
                20_033,
                20_040,
                expected.len() - 1,
                expected.len(),
            ] {
                let mut rest = OutBuffer::new();
                rest.heartbeat();
                rest.content(1, &raw, &Body::from_parts(parts.clone()), frame_max);
                let mut front = OutBuffer::new();
                rest.move_front(split, &mut front);
                assert_eq!(front.to_vec(), &expected[..split]);
                // Drain `rest` the way a writer does: a few bytes at a time.
                let mut written = Vec::new();
                while rest.has_remaining() {
                    let n = rest.chunk().len().min(3_000);
                    written.extend_from_slice(&rest.chunk()[..n]);
                    rest.advance(n);
                }
                assert_eq!(written, &expected[split..]);
                assert!(rest.is_empty());
            }
        }
    }

    #[test]
    fn repeated_publishes_decode_the_same_as_fresh_ones() {
        let publish = |key: &str, mandatory: bool| {
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "x".into(),
                routing_key: key.into(),
                mandatory,
                ..Default::default()
            }))
        };
        let sequence = [
            publish("a", false),
            publish("a", false),
            publish("a", true),
            publish("b", true),
            declare(),
            publish("b", true),
            publish("a", false),
        ];
        let mut bytes = Vec::new();
        for m in &sequence {
            bytes.extend(encode(m));
        }
        let mut codec = FrameCodec::new(0);
        let mut buf = BytesMut::from(&bytes[..]);
        let mut last: Option<crate::content::Publish> = None;
        for m in &sequence {
            let frame = codec.decode(&mut buf).unwrap().unwrap();
            // A publish comes as `Frame::Publish`; as a method it is what was sent.
            if let Frame::Publish(_, p) = &frame {
                // Repeated bytes share the names of the previous decode.
                if let Some(prev) = &last {
                    if prev == p {
                        assert!(std::sync::Arc::ptr_eq(&prev.routing_key, &p.routing_key));
                    }
                }
                last = Some(p.clone());
            }
            assert_eq!(frame.into_method(), Frame::Method(1, m.clone()));
        }
        assert!(buf.is_empty());
    }

    #[test]
    fn oversize_frame_is_rejected_before_buffering() {
        let mut codec = FrameCodec::new(4096);
        let mut buf = BytesMut::from(&[3u8, 0, 1, 0, 1, 0, 0][..]);
        let err = codec.decode(&mut buf).unwrap_err();
        assert_eq!(
            err,
            FrameError::TooLarge {
                frame_type: 3,
                size: 65536,
                max: 4096
            }
        );
        assert_eq!(
            err.to_string(),
            "type 3, all octets = <<>>: {frame_too_large,65536,4088}"
        );
    }

    #[test]
    fn bad_frame_end_unknown_type_and_unknown_method() {
        let mut bytes = encode(&declare());
        let last = bytes.len() - 1;
        bytes[last] = 0;
        let mut codec = FrameCodec::new(0);
        assert_eq!(
            codec.decode(&mut BytesMut::from(&bytes[..])),
            Err(FrameError::BadFrameEnd {
                frame_type: 1,
                end: 0
            })
        );
        let err = codec
            .decode(&mut BytesMut::from(
                &[9u8, 0, 0, 0, 0, 0, 3, b'a', b'b', b'c', 206][..],
            ))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "type 9, all octets = <<\"abc\">>: unknown_frame"
        );
        let unknown = [1u8, 0, 1, 0, 0, 0, 4, 0, 50, 0, 99, 206];
        assert_eq!(
            codec.decode(&mut BytesMut::from(&unknown[..])),
            Err(FrameError::UnknownMethod {
                class_id: 50,
                method_id: 99
            })
        );
        // queue.declare with a truncated argument list.
        let broken = [1u8, 0, 1, 0, 0, 0, 6, 0, 50, 0, 10, 0, 0, 206];
        let err = codec.decode(&mut BytesMut::from(&broken[..])).unwrap_err();
        assert_eq!(err.to_string(), "cannot decode <<0,0>>");
    }

    #[test]
    fn heartbeat_frames() {
        let mut out = OutBuffer::new();
        out.heartbeat();
        let mut codec = FrameCodec::new(0);
        assert_eq!(
            codec.decode(&mut BytesMut::from(&out.to_vec()[..])),
            Ok(Some(Frame::Heartbeat(0)))
        );
    }

    #[test]
    fn hand_written_deliver_matches_amq_protocol() {
        for (tag, dtag, redelivered, x, k) in [
            ("c", 1u64, true, "", "q"),
            (
                "amq.ctag-abcdefghijklmnopqrstuv",
                u64::MAX,
                false,
                "amq.topic",
                "a.b.c",
            ),
            ("", 0, false, "x", ""),
        ] {
            let mut hand = OutBuffer::new();
            hand.deliver(7, tag, dtag, redelivered, x, k);
            let mut generated = OutBuffer::new();
            generated.method(
                7,
                &AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                    consumer_tag: tag.into(),
                    delivery_tag: dtag,
                    redelivered,
                    exchange: x.into(),
                    routing_key: k.into(),
                })),
            );
            assert_eq!(hand.to_vec(), generated.to_vec(), "{tag} {dtag}");
            // And through amq-protocol's whole-frame generator too.
            let frame = amq_protocol::frame::AMQPFrame::Method(
                7,
                AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                    consumer_tag: tag.into(),
                    delivery_tag: dtag,
                    redelivered,
                    exchange: x.into(),
                    routing_key: k.into(),
                })),
            );
            let whole = amq_protocol::frame::gen_frame(&frame)(WriteContext::from(Vec::new()))
                .unwrap()
                .into_inner()
                .0;
            assert_eq!(hand.to_vec(), whole);
        }
    }

    #[test]
    fn hand_written_ack_matches_amq_protocol() {
        for (tag, multiple) in [(1u64, false), (1 << 40, true), (u64::MAX, false)] {
            let mut hand = OutBuffer::new();
            hand.ack(9, tag, multiple);
            let mut generated = OutBuffer::new();
            generated.method(
                9,
                &AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                    delivery_tag: tag,
                    multiple,
                })),
            );
            assert_eq!(hand.to_vec(), generated.to_vec(), "{tag} {multiple}");
        }
    }

    #[test]
    fn deliver_method_golden_bytes() {
        // Pins the wire encoding of basic.deliver (class 60, method 60).
        let deliver = AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
            consumer_tag: "c".into(),
            delivery_tag: 1,
            redelivered: true,
            exchange: "".into(),
            routing_key: "q".into(),
        }));
        let mut out = OutBuffer::new();
        out.method(1, &deliver);
        assert_eq!(
            out.to_vec(),
            &[
                1, 0, 1, 0, 0, 0, 18, 0, 60, 0, 60, 1, b'c', 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, b'q',
                206
            ]
        );
    }
}

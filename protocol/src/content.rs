//! The publish → content header → body* state machine of one channel.

use crate::body::Body;
use crate::reply::{AmqpError, ReplyCode};
use amq_protocol::protocol::basic::AMQPProperties;
use bytes::{Bytes, BytesMut};
use std::sync::Arc;

/// basic.publish's arguments, its names shared: publishers repeat the same exchange and
/// routing key message after message, and the decoder hands out the same strings each time
/// (see `FrameCodec`), so a publish copies no name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub exchange: Arc<str>,
    pub routing_key: Arc<str>,
    pub mandatory: bool,
    pub immediate: bool,
}

impl From<amq_protocol::protocol::basic::Publish> for Publish {
    fn from(p: amq_protocol::protocol::basic::Publish) -> Self {
        Publish {
            exchange: p.exchange.as_str().into(),
            routing_key: p.routing_key.as_str().into(),
            mandatory: p.mandatory,
            immediate: p.immediate,
        }
    }
}

impl From<Publish> for amq_protocol::protocol::basic::Publish {
    fn from(p: Publish) -> Self {
        amq_protocol::protocol::basic::Publish {
            exchange: p.exchange.as_ref().into(),
            routing_key: p.routing_key.as_ref().into(),
            mandatory: p.mandatory,
            immediate: p.immediate,
        }
    }
}

/// One complete published message as it came off the wire.
#[derive(Debug, Clone)]
pub struct Content {
    pub publish: Publish,
    pub properties: AMQPProperties,
    /// The encoded property flags and list, as the publisher sent them.
    pub raw_properties: Bytes,
    pub body: Body,
}

// Inline properties, as in `Frame::Header`: no allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
enum State {
    #[default]
    Idle,
    AwaitingHeader(Publish),
    AwaitingBody {
        publish: Publish,
        properties: AMQPProperties,
        raw_properties: Bytes,
        expected: u64,
        /// Bytes received so far.
        have: u64,
        /// The body frames' payloads, kept as they are (see [`Body`]); the first apart, so the
        /// common single-frame body costs no allocation.
        first: Bytes,
        more: Vec<Bytes>,
        /// Frames after the first shorter than `COPY_BELOW`, copied together: the next part
        /// of `more` once a longer frame (or the end) comes.
        tail: BytesMut,
    },
}

/// Body frames after the first shorter than this are copied into one buffer rather than
/// kept each as a part: a part costs 32 bytes besides its bytes, and keeps its read buffer
/// alive, so a client sending a large body a byte a frame (a 128 MiB body is 134 million
/// frames) made gigabytes of part list out of it.
const COPY_BELOW: usize = 1024;

/// Assembles content for one channel.
#[derive(Debug, Default)]
pub struct ContentAssembler {
    state: State,
}

const PUBLISH: (u16, u16) = (60, 40);

impl ContentAssembler {
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle)
    }

    /// Drop a partial message (channel closed).
    pub fn reset(&mut self) {
        self.state = State::Idle;
    }

    /// A basic.publish arrived. Any other method while content is pending is the caller's 505.
    pub fn publish(&mut self, publish: Publish) -> Result<(), AmqpError> {
        if !self.is_idle() {
            return Err(self.unexpected());
        }
        self.state = State::AwaitingHeader(publish);
        Ok(())
    }

    /// The error for a method frame arriving while content is expected.
    pub fn unexpected(&self) -> AmqpError {
        let text = match self.state {
            State::AwaitingHeader(_) => {
                "expected content header for class 60, got non content header frame instead"
            }
            _ => "expected content body, got non content body frame instead",
        };
        AmqpError::connection(ReplyCode::UnexpectedFrame, text).on(PUBLISH.0, PUBLISH.1)
    }

    /// A content frame where a method was expected (RabbitMQ names no method).
    fn no_content_expected() -> AmqpError {
        AmqpError::connection(
            ReplyCode::UnexpectedFrame,
            "expected method frame, got non method frame instead",
        )
        .on_no_method()
    }

    pub fn header(
        &mut self,
        class_id: u16,
        body_size: u64,
        properties: AMQPProperties,
        raw_properties: Bytes,
    ) -> Result<Option<Content>, AmqpError> {
        let publish = match std::mem::take(&mut self.state) {
            State::AwaitingHeader(p) => p,
            State::Idle => return Err(Self::no_content_expected()),
            other => {
                self.state = other;
                return Err(self.unexpected());
            }
        };
        if class_id != 60 {
            return Err(AmqpError::connection(
                ReplyCode::UnexpectedFrame,
                format!(
                    "expected content header for class 60, got one for class {class_id} instead"
                ),
            )
            .on(PUBLISH.0, PUBLISH.1));
        }
        if body_size == 0 {
            return Ok(Some(Content {
                publish,
                properties,
                raw_properties,
                body: Body::new(),
            }));
        }
        self.state = State::AwaitingBody {
            publish,
            properties,
            raw_properties,
            expected: body_size,
            have: 0,
            first: Bytes::new(),
            more: Vec::new(),
            tail: BytesMut::new(),
        };
        Ok(None)
    }

    /// Body bytes received so far for the content being assembled (0 when none is).
    pub fn received(&self) -> u64 {
        match &self.state {
            State::AwaitingBody { have, .. } => *have,
            _ => 0,
        }
    }

    pub fn body(&mut self, data: Bytes) -> Result<Option<Content>, AmqpError> {
        let State::AwaitingBody {
            expected,
            have,
            first,
            more,
            tail,
            ..
        } = &mut self.state
        else {
            if self.is_idle() {
                return Err(Self::no_content_expected());
            }
            return Err(self.unexpected());
        };
        let got = *have + data.len() as u64;
        if got > *expected {
            return Err(AmqpError::connection(
                ReplyCode::FrameError,
                format!("content body exceeds declared size {expected} (got at least {got})"),
            ));
        }
        *have = got;
        if first.is_empty() {
            *first = data;
        } else if data.len() < COPY_BELOW {
            tail.extend_from_slice(&data);
        } else {
            if !tail.is_empty() {
                more.push(tail.split().freeze());
            }
            more.push(data);
        }
        if got == *expected {
            if let State::AwaitingBody {
                publish,
                properties,
                raw_properties,
                first,
                mut more,
                tail,
                ..
            } = std::mem::take(&mut self.state)
            {
                if !tail.is_empty() {
                    more.push(tail.freeze());
                }
                let body = if more.is_empty() {
                    Body::from(first)
                } else {
                    more.insert(0, first);
                    Body::from_parts(more)
                };
                return Ok(Some(Content {
                    publish,
                    properties,
                    raw_properties,
                    body,
                }));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publish() -> Publish {
        Publish {
            exchange: "".into(),
            routing_key: "k".into(),
            mandatory: false,
            immediate: false,
        }
    }

    fn awaiting(size: u64) -> ContentAssembler {
        let mut a = ContentAssembler::default();
        a.publish(publish()).unwrap();
        assert!(a
            .header(
                60,
                size,
                AMQPProperties::default(),
                Bytes::from_static(&[0, 0])
            )
            .unwrap()
            .is_none());
        a
    }

    #[test]
    fn body_across_many_frames() {
        let frame = |c: u8| Bytes::from(vec![c; COPY_BELOW]);
        let mut a = awaiting(3 * COPY_BELOW as u64);
        assert!(a.body(frame(b'a')).unwrap().is_none());
        assert!(a.body(frame(b'b')).unwrap().is_none());
        let c = a.body(frame(b'c')).unwrap().unwrap();
        assert_eq!(
            c.body.to_bytes(),
            [frame(b'a'), frame(b'b'), frame(b'c')].concat()
        );
        assert_eq!(
            c.body.parts().len(),
            3,
            "body frames are kept, not concatenated"
        );
        assert!(a.is_idle());
    }

    /// Frames shorter than `COPY_BELOW` after the first are copied together, between the
    /// longer ones kept as they are: 10,000 one-byte frames were 10,000 parts.
    #[test]
    fn small_body_frames_are_copied_together() {
        let big = Bytes::from(vec![b'B'; COPY_BELOW]);
        let mut a = awaiting(1 + 5_000 + COPY_BELOW as u64 + 5_000);
        let mut expected = vec![b'f'];
        assert!(a.body(Bytes::from_static(b"f")).unwrap().is_none());
        for _ in 0..5_000 {
            assert!(a.body(Bytes::from_static(b"x")).unwrap().is_none());
        }
        expected.extend_from_slice(&[b'x'; 5_000]);
        assert!(a.body(big.clone()).unwrap().is_none());
        expected.extend_from_slice(&big);
        let mut done = None;
        for _ in 0..5_000 {
            done = a.body(Bytes::from_static(b"y")).unwrap();
        }
        expected.extend_from_slice(&[b'y'; 5_000]);
        let c = done.unwrap();
        assert_eq!(c.body.to_bytes(), expected);
        assert_eq!(c.body.parts().len(), 4, "first, x's, the long frame, y's");
        assert!(a.is_idle());
    }

    #[test]
    fn empty_body_completes_on_header() {
        let mut a = ContentAssembler::default();
        a.publish(publish()).unwrap();
        let c = a
            .header(
                60,
                0,
                AMQPProperties::default(),
                Bytes::from_static(&[0, 0]),
            )
            .unwrap()
            .unwrap();
        assert!(c.body.is_empty());
    }

    #[test]
    fn out_of_order_frames_are_505() {
        let mut a = ContentAssembler::default();
        let e = a.body(Bytes::from_static(b"x")).unwrap_err();
        assert_eq!(e.code, ReplyCode::UnexpectedFrame);
        let e = a
            .header(60, 1, AMQPProperties::default(), Bytes::new())
            .unwrap_err();
        assert_eq!(e.code, ReplyCode::UnexpectedFrame);
        a.publish(publish()).unwrap();
        assert_eq!(
            a.publish(publish()).unwrap_err().code,
            ReplyCode::UnexpectedFrame
        );
    }

    #[test]
    fn oversize_body_is_rejected() {
        let mut a = ContentAssembler::default();
        a.publish(publish()).unwrap();
        a.header(60, 2, AMQPProperties::default(), Bytes::new())
            .unwrap();
        assert!(a.body(Bytes::from_static(b"abc")).is_err());
    }
}

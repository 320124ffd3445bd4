//! AMQP 0-9-1 framing for Warren: bytes to typed frames and back.
//!
//! No sockets and no broker state live here. The method and property types, their parsers and
//! generators all come from `amq-protocol`; this crate adds what a *server* needs around them:
//! a streaming codec that enforces `frame_max` and keeps content bodies and encoded properties as
//! shared [`bytes::Bytes`] (so a message is never re-encoded on its way through the broker), the
//! publish → header → body state machine, and typed reply codes.

pub mod body;
pub mod codec;
pub mod content;
pub mod nesting;
pub mod reply;

pub use amq_protocol;
pub use amq_protocol::protocol::{AMQPClass, BasicProperties};
pub use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
pub use body::Body;
pub use codec::{Frame, FrameCodec, FrameError, OutBuffer, PROTOCOL_HEADER};
pub use content::{Content, ContentAssembler, Publish};
pub use reply::{AmqpError, ReplyCode};

/// A string the broker holds (a routing key, an exchange or queue name, a consumer tag) as an
/// AMQP short string, cut to 255 bytes on a char boundary when it is longer. Never panics:
/// `ShortString::from` does on a longer string, and names that reach the broker through its
/// arguments (`x-dead-letter-routing-key`) or its HTTP API are not bounded by the wire's limit.
/// basic.deliver is written with the same cut (`OutBuffer::deliver`).
pub fn short(s: &str) -> ShortString {
    let mut end = s.len().min(amq_protocol::types::MAX_SHORT_STRING_LENGTH);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    // Within the limit by construction, so this cannot fail; the fallback keeps it total.
    ShortString::try_new(&s[..end]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::short;

    #[test]
    fn short_strings_are_cut_on_a_char_boundary() {
        assert_eq!(short("abc").as_str(), "abc");
        let long = "k".repeat(300);
        assert_eq!(short(&long).as_str().len(), 255);
        // 254 ASCII bytes and a two-byte char: the char does not fit, so it goes whole.
        let s = format!("{}é", "a".repeat(254));
        assert_eq!(short(&s).as_str(), "a".repeat(254));
        let exact = "z".repeat(255);
        assert_eq!(short(&exact).as_str(), exact);
    }
}

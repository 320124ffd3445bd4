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
pub mod reply;

pub use amq_protocol;
pub use amq_protocol::protocol::{AMQPClass, BasicProperties};
pub use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
pub use body::Body;
pub use codec::{Frame, FrameCodec, FrameError, OutBuffer, PROTOCOL_HEADER};
pub use content::{Content, ContentAssembler, Publish};
pub use reply::{AmqpError, ReplyCode};

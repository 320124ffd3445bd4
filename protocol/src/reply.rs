//! Reply codes, soft (channel) versus hard (connection) errors, and the close methods.

use amq_protocol::protocol::{channel, connection, AMQPClass};
use std::fmt;

/// Reply codes of AMQP 0-9-1 (and the names RabbitMQ prints in reply texts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyCode {
    ContentTooLarge = 311,
    NoRoute = 312,
    NoConsumers = 313,
    ConnectionForced = 320,
    InvalidPath = 402,
    AccessRefused = 403,
    NotFound = 404,
    ResourceLocked = 405,
    PreconditionFailed = 406,
    FrameError = 501,
    SyntaxError = 502,
    CommandInvalid = 503,
    ChannelError = 504,
    UnexpectedFrame = 505,
    ResourceError = 506,
    NotAllowed = 530,
    NotImplemented = 540,
    InternalError = 541,
}

impl ReplyCode {
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The upper-case name RabbitMQ puts in front of reply texts.
    pub fn name(self) -> &'static str {
        match self {
            ReplyCode::ContentTooLarge => "CONTENT_TOO_LARGE",
            ReplyCode::NoRoute => "NO_ROUTE",
            ReplyCode::NoConsumers => "NO_CONSUMERS",
            ReplyCode::ConnectionForced => "CONNECTION_FORCED",
            ReplyCode::InvalidPath => "INVALID_PATH",
            ReplyCode::AccessRefused => "ACCESS_REFUSED",
            ReplyCode::NotFound => "NOT_FOUND",
            ReplyCode::ResourceLocked => "RESOURCE_LOCKED",
            ReplyCode::PreconditionFailed => "PRECONDITION_FAILED",
            ReplyCode::FrameError => "FRAME_ERROR",
            ReplyCode::SyntaxError => "SYNTAX_ERROR",
            ReplyCode::CommandInvalid => "COMMAND_INVALID",
            ReplyCode::ChannelError => "CHANNEL_ERROR",
            ReplyCode::UnexpectedFrame => "UNEXPECTED_FRAME",
            ReplyCode::ResourceError => "RESOURCE_ERROR",
            ReplyCode::NotAllowed => "NOT_ALLOWED",
            ReplyCode::NotImplemented => "NOT_IMPLEMENTED",
            ReplyCode::InternalError => "INTERNAL_ERROR",
        }
    }

    /// Soft codes close a channel by default, hard codes the connection.
    pub fn is_soft(self) -> bool {
        matches!(
            self,
            ReplyCode::ContentTooLarge
                | ReplyCode::NoRoute
                | ReplyCode::NoConsumers
                | ReplyCode::AccessRefused
                | ReplyCode::NotFound
                | ReplyCode::ResourceLocked
                | ReplyCode::PreconditionFailed
        )
    }
}

/// An error with its reply code, the text sent to the peer, the offending method, and whether
/// it closes the channel or the whole connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpError {
    pub code: ReplyCode,
    pub text: String,
    pub class_id: u16,
    pub method_id: u16,
    /// true: connection.close; false: channel.close.
    pub hard: bool,
    /// The offending method is decided (possibly "none", 0/0); `on` leaves it alone.
    pub named: bool,
}

impl AmqpError {
    /// An error whose scope follows its code (soft → channel, hard → connection).
    pub fn new(code: ReplyCode, detail: impl fmt::Display) -> Self {
        AmqpError {
            code,
            text: format!("{} - {}", code.name(), detail),
            class_id: 0,
            method_id: 0,
            hard: !code.is_soft(),
            named: false,
        }
    }

    /// The text without the reply code's name ("PRECONDITION_FAILED - ").
    pub fn detail(&self) -> &str {
        match self.text.split_once(" - ") {
            Some((name, rest)) if name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') => rest,
            _ => self.text.as_str(),
        }
    }

    /// An error that closes the connection whatever its code (e.g. 403 on login).
    pub fn connection(code: ReplyCode, detail: impl fmt::Display) -> Self {
        AmqpError {
            hard: true,
            ..Self::new(code, detail)
        }
    }

    /// Name the method that caused the error (unless one is named already).
    pub fn on(mut self, class_id: u16, method_id: u16) -> Self {
        if !self.named {
            self.class_id = class_id;
            self.method_id = method_id;
            self.named = true;
        }
        self
    }

    /// Report no method (class and method 0), as RabbitMQ does for some errors.
    pub fn on_no_method(self) -> Self {
        self.on(0, 0)
    }

    pub fn on_method(self, method: &AMQPClass) -> Self {
        self.on(method.get_amqp_class_id(), method.get_amqp_method_id())
    }

    pub fn not_found(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::NotFound, detail)
    }
    pub fn precondition_failed(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::PreconditionFailed, detail)
    }
    pub fn access_refused(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::AccessRefused, detail)
    }
    pub fn resource_locked(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::ResourceLocked, detail)
    }
    pub fn not_allowed(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::NotAllowed, detail)
    }
    pub fn not_implemented(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::NotImplemented, detail)
    }
    pub fn channel_error(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::ChannelError, detail)
    }
    pub fn command_invalid(detail: impl fmt::Display) -> Self {
        Self::new(ReplyCode::CommandInvalid, detail)
    }

    /// The close method to send: channel.close for soft errors, connection.close for hard ones.
    pub fn close_method(&self) -> AMQPClass {
        let text = truncate(&self.text);
        if self.hard {
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: self.code.code(),
                reply_text: text.into(),
                class_id: self.class_id,
                method_id: self.method_id,
            }))
        } else {
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: self.code.code(),
                reply_text: text.into(),
                class_id: self.class_id,
                method_id: self.method_id,
            }))
        }
    }
}

/// Reply texts are short strings: at most 255 bytes, cut on a char boundary.
fn truncate(s: &str) -> String {
    if s.len() <= 255 {
        return s.to_string();
    }
    let mut end = 255;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}) on {}.{}",
            self.text,
            self.code.code(),
            self.class_id,
            self.method_id
        )
    }
}

impl std::error::Error for AmqpError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_errors_close_the_channel_hard_the_connection() {
        let e = AmqpError::not_found("no queue 'q' in vhost '/'").on(50, 10);
        assert_eq!(e.text, "NOT_FOUND - no queue 'q' in vhost '/'");
        assert!(matches!(e.close_method(), AMQPClass::Channel(_)));
        let e = AmqpError::channel_error("expected 'channel.open'");
        assert!(matches!(e.close_method(), AMQPClass::Connection(_)));
        let e = AmqpError::connection(ReplyCode::AccessRefused, "login refused");
        assert!(matches!(e.close_method(), AMQPClass::Connection(_)));
    }

    #[test]
    fn long_texts_are_cut_to_a_short_string() {
        let e = AmqpError::not_found("é".repeat(300));
        match e.close_method() {
            AMQPClass::Channel(channel::AMQPMethod::Close(c)) => {
                assert!(c.reply_text.as_str().len() <= 255)
            }
            other => panic!("{other:?}"),
        }
    }
}

//! Warren: an AMQP 0-9-1 message broker.

pub mod broker;

//! One file per AMQP class, one function per method; each is an `impl Session` block.

mod basic;
mod channel;
mod confirm;
pub(crate) mod connection;
mod exchange;
mod queue;
mod tx;

//! Warren's durable state, behind a store trait.
//!
//! This crate knows no AMQP wire type and no socket: the broker hands it [`Op`]s whose
//! arguments and message properties are already encoded bytes, and gets the same ops back on
//! recovery. Live traffic, crash recovery and (later) cluster followers all change the broker's
//! state through one `apply(op)` in the server, so every store only has to keep ops faithfully.

pub mod op;

pub use op::{BindingDest, Op};

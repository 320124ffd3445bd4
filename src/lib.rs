//! Warren: an AMQP 0-9-1 message broker.
//!
//! `broker` is the I/O-free core; `conn` and `handlers` speak the protocol on a socket;
//! `server` accepts connections and owns shared state.

pub mod broker;
pub mod commit;
pub mod config;
pub mod conn;
mod handlers;
pub mod log_limit;
pub mod memory;
pub mod mgmt;
pub mod server;

pub use config::Config;
pub use server::{run, serve, Shared};

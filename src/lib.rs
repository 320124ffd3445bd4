//! Warren: an AMQP 0-9-1 message broker.
//!
//! `broker` is the I/O-free core; `conn` and `handlers` speak the protocol on a socket;
//! `http` is the management API; `registry` lists the connections (what `http` shows and
//! closes); `auth` is the login check both use; `server` accepts connections and owns shared
//! state.

mod auth;
/// The broker core, its own crate (`broker/`): nothing in it can name tokio or RocksDB.
pub use warren_broker as broker;
mod clock;
pub mod cluster;
pub mod commit;
pub mod config;
pub mod conn;
pub mod ctl;
mod handlers;
pub mod http;
pub use warren_broker::log_limit;
pub mod memory;
pub mod node;
pub mod outbox;
pub mod registry;
pub mod server;
pub mod tls;

/// Test builds allocate under a cap that a test may lower (`allocating_at_most`).
#[cfg(test)]
#[global_allocator]
static ALLOC: warren_storage::testing::CappedSystem = warren_storage::testing::capped_system();

pub use config::Config;
pub use node::Shared;
pub use server::{run, serve};

//! Warren's durable state, behind a store trait.
//!
//! This crate knows no AMQP wire type and no socket, and its trait names no RocksDB type: the
//! broker hands a store [`Op`]s whose arguments and message properties are already encoded
//! bytes, and gets ops back on recovery. Live traffic, crash recovery and (later) cluster
//! followers all change the broker's state through one `apply(op)` in the server, so a store
//! only keeps what the ops say, faithfully.
//!
//! Two stores implement the trait: [`mem::MemStore`] (tests, transient brokers) and
//! [`rocks::RocksStore`]; [`testing::conformance`] is one suite both must pass.

pub mod codec;
pub mod mem;
pub mod op;
pub mod rocks;
pub mod testing;

pub use op::{BindingDest, Op};
use std::path::PathBuf;

/// Why a store could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another process holds the data folder.
    #[error("data folder {0} is in use by another process (lock held)")]
    Locked(PathBuf),
    /// The data folder cannot be read as a Warren store; nothing was discarded.
    #[error("data folder {path} is corrupt or unreadable: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    /// No space left: the write did not happen.
    #[error("no space left on the device: {0}")]
    NoSpace(String),
    #[error("storage error: {0}")]
    Io(String),
}

/// Durable state. Implementations must make `write` atomic: after a crash either all of a
/// call's ops are there or none.
pub trait Store: Send + Sync {
    /// Apply `ops` in order. With `sync`, return only once they are on stable storage (fsync).
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError>;

    /// The ops that rebuild the stored state: exchanges, queues, bindings, then each queue's
    /// messages in id order (one `Enqueue` per stored queue entry).
    fn recover(&self) -> Result<Vec<Op>, StoreError>;
}

impl<T: Store + ?Sized> Store for std::sync::Arc<T> {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        (**self).write(ops, sync)
    }

    fn recover(&self) -> Result<Vec<Op>, StoreError> {
        (**self).recover()
    }
}

impl<T: Store + ?Sized> Store for Box<T> {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        (**self).write(ops, sync)
    }

    fn recover(&self) -> Result<Vec<Op>, StoreError> {
        (**self).recover()
    }
}

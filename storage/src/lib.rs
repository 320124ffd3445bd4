//! Warren's durable state, behind a store trait.
//!
//! This crate knows no AMQP wire type and no socket, and its trait names no RocksDB type: the
//! broker hands a store [`Op`]s whose arguments and message properties are already encoded
//! bytes, and gets ops back on recovery. Live traffic, crash recovery and (later) cluster
//! followers all change the broker's state through one `apply(op)` in the server, so a store
//! only keeps what the ops say, faithfully.
//!
//! Two stores implement the trait: [`mem::MemStore`] (tests, transient brokers) here, and
//! `RocksStore` in the `warren-rocks` crate (this crate does not depend on RocksDB);
//! [`testing::conformance`] is one suite both must pass.

pub mod codec;
pub mod mem;
pub mod op;
pub mod op_codec;
pub mod testing;

pub use op::{BindingDest, Name, Op, QueueLevels};

/// Test builds allocate under a cap that a test may lower (`testing::allocating_at_most`).
#[cfg(test)]
#[global_allocator]
pub(crate) static ALLOC: testing::CappedSystem = testing::capped_system();
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

/// Bits of a message key that hold the message id; the byte above holds the priority level.
pub const ID_BITS: u32 = 56;

/// A message's key within its queue: priority level in the top byte, then the broker-wide id,
/// so a queue's keys sort by level, then id (delivery order within a level).
pub fn message_key(level: u8, id: u64) -> u64 {
    (level as u64) << ID_BITS | (id & ((1 << ID_BITS) - 1))
}

/// The id in a message key.
pub fn key_id(key: u64) -> u64 {
    key & ((1 << ID_BITS) - 1)
}

/// The priority level in a message key.
pub fn key_level(key: u64) -> u8 {
    (key >> ID_BITS) as u8
}

/// One message read back from a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub key: u64,
    pub timestamp_ms: u64,
    pub exchange: String,
    pub routing_key: String,
    pub properties: bytes::Bytes,
    pub body: warren_protocol::Body,
}

/// What a queue holds on disk at one priority level: `count` messages with keys from `first`
/// to `last`, `bytes` of bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LevelSummary {
    pub level: u8,
    pub count: u64,
    pub bytes: u64,
    pub first: u64,
    pub last: u64,
    /// Some message of the level carries an `expiration` property (so the broker's expiry
    /// timer must look at this level's head after a restart; without, it need not read it).
    pub may_expire: bool,
}

/// Whether encoded content properties (as published: property flags first) carry an
/// `expiration`.
pub fn has_expiration(properties: &[u8]) -> bool {
    // Property flags, most significant bit first: content-type (15) ... expiration (8).
    properties.first().is_some_and(|flags| flags & 0x01 != 0)
}

/// A stored queue's messages, summed up (recovery reads them back later, a window at a time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSummary {
    pub vhost: String,
    pub name: String,
    pub levels: Vec<LevelSummary>,
}

/// What a store holds at start-up.
#[derive(Debug, Clone, Default)]
pub struct Recovered {
    /// Definitions: exchanges, queues, then bindings.
    pub ops: Vec<Op>,
    /// Every stored queue's messages (transient spills of the previous run are gone).
    pub queues: Vec<QueueSummary>,
}

/// Where [`Store::snapshot_to`] streams a snapshot.
pub trait SnapshotSink {
    /// The snapshot's moment is fixed: what is written from now on is not in it.
    fn taken(&mut self);
    /// The next ops, in order; false stops the snapshot here.
    fn ops(&mut self, ops: Vec<Op>) -> Result<bool, StoreError>;
}

/// Ops per group and body bytes per group [`Store::snapshot_to`] streams (at least one op).
pub const SNAPSHOT_GROUP_OPS: usize = 4096;
pub const SNAPSHOT_GROUP_BYTES: usize = 1 << 20;

/// Durable state. A call's ops are applied in order; after a crash every op is either there or
/// not (ops are not split), and a synced call is there whole.
pub trait Store: Send + Sync {
    /// Apply `ops` in order. With `sync`, return only once they are on stable storage (fsync).
    /// [`Op::Spill`] is written without the write-ahead log.
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError>;

    /// `write`, and in the same atomic write the position `applied` (opaque bytes: the
    /// cluster's last applied log entry), which [`Store::applied`] returns from then on. A
    /// replicated node's store then never holds a change without the position that covers it.
    fn write_applied(&self, ops: &[Op], applied: &[u8], sync: bool) -> Result<(), StoreError>;

    /// The position last written by [`Store::write_applied`] (None: never).
    fn applied(&self) -> Result<Option<Vec<u8>>, StoreError>;

    /// Make every write made so far durable, synced or not. A store that writes without a
    /// log (a cluster node's: its Raft log is the record) may lose unsynced writes in a crash
    /// until this returns, so the Raft log is kept until then.
    fn persist(&self) -> Result<(), StoreError>;

    /// Everything the store keeps that a replica must have, as ops that rebuild it on an
    /// empty store, streamed to `sink` in groups: users, exchanges, queues, bindings, then each
    /// queue's stored messages in key order (one `Enqueue` per queue and message, in groups of
    /// about a MiB). Spilled transient messages are local and left out. Changes nothing
    /// (unlike `recover`). The content is the store's at one moment, inside the call, before
    /// `sink.taken()`: writes may go on once that is called (a cluster's snapshot of a large
    /// store is read out while entries are applied), and are not in it.
    fn snapshot_to(&self, sink: &mut dyn SnapshotSink) -> Result<(), StoreError>;

    /// [`Store::snapshot_to`], collected in memory (for small stores and tests).
    fn snapshot(&self) -> Result<Vec<Op>, StoreError> {
        struct Collect(Vec<Op>);
        impl SnapshotSink for Collect {
            fn taken(&mut self) {}
            fn ops(&mut self, ops: Vec<Op>) -> Result<bool, StoreError> {
                self.0.extend(ops);
                Ok(true)
            }
        }
        let mut c = Collect(Vec::new());
        self.snapshot_to(&mut c)?;
        Ok(c.0)
    }

    /// The stored definitions and a summary of each queue's messages. Transient messages
    /// spilled by the previous run are deleted.
    fn recover(&self) -> Result<Recovered, StoreError>;

    /// Messages of a queue with keys from `from` to `to` (inclusive), in key order: at most
    /// `max_count`, and stopping once `max_bytes` of bodies were read (at least one).
    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError>;

    /// The messages of a queue with these keys, in the order given (None for a key the store
    /// does not hold): point reads, for messages whose neighbours by key are not wanted.
    fn read_keys(
        &self,
        vhost: &str,
        queue: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<StoredMessage>>, StoreError> {
        keys.iter()
            .map(|&k| {
                self.read(vhost, queue, k, k, 1, usize::MAX)
                    .map(|v| v.into_iter().next().filter(|m| m.key == k))
            })
            .collect()
    }
}

impl<T: Store + ?Sized> Store for std::sync::Arc<T> {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        (**self).write(ops, sync)
    }

    fn write_applied(&self, ops: &[Op], applied: &[u8], sync: bool) -> Result<(), StoreError> {
        (**self).write_applied(ops, applied, sync)
    }

    fn applied(&self) -> Result<Option<Vec<u8>>, StoreError> {
        (**self).applied()
    }

    fn persist(&self) -> Result<(), StoreError> {
        (**self).persist()
    }

    fn snapshot_to(&self, sink: &mut dyn SnapshotSink) -> Result<(), StoreError> {
        (**self).snapshot_to(sink)
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        (**self).recover()
    }

    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        (**self).read(vhost, queue, from, to, max_count, max_bytes)
    }

    fn read_keys(
        &self,
        vhost: &str,
        queue: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<StoredMessage>>, StoreError> {
        (**self).read_keys(vhost, queue, keys)
    }
}

impl<T: Store + ?Sized> Store for Box<T> {
    fn write(&self, ops: &[Op], sync: bool) -> Result<(), StoreError> {
        (**self).write(ops, sync)
    }

    fn write_applied(&self, ops: &[Op], applied: &[u8], sync: bool) -> Result<(), StoreError> {
        (**self).write_applied(ops, applied, sync)
    }

    fn applied(&self) -> Result<Option<Vec<u8>>, StoreError> {
        (**self).applied()
    }

    fn persist(&self) -> Result<(), StoreError> {
        (**self).persist()
    }

    fn snapshot_to(&self, sink: &mut dyn SnapshotSink) -> Result<(), StoreError> {
        (**self).snapshot_to(sink)
    }

    fn recover(&self) -> Result<Recovered, StoreError> {
        (**self).recover()
    }

    fn read(
        &self,
        vhost: &str,
        queue: &str,
        from: u64,
        to: u64,
        max_count: usize,
        max_bytes: usize,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        (**self).read(vhost, queue, from, to, max_count, max_bytes)
    }

    fn read_keys(
        &self,
        vhost: &str,
        queue: &str,
        keys: &[u64],
    ) -> Result<Vec<Option<StoredMessage>>, StoreError> {
        (**self).read_keys(vhost, queue, keys)
    }
}

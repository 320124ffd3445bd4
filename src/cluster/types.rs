//! The Raft type configuration of the broker's one replicated log, and what its entries carry.
//! openraft's types stay inside `cluster/`: the rest of the server sees `Batch` and `NodeInfo`.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A node's addresses: its Raft link (from `--peers`), and the AMQP and management addresses
/// clients and operators reach it on (each node fills these in for itself; they travel in the
/// membership, so any node can name every other's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub raft: String,
    #[serde(default)]
    pub amqp: String,
    #[serde(default)]
    pub http: String,
    /// Random, drawn when the node's Raft log is created: a node whose data was wiped comes
    /// back with another one, so the cluster can tell it from the member it was (0: not
    /// known yet).
    #[serde(default)]
    pub incarnation: u64,
}

impl std::fmt::Display for NodeInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "raft {} amqp {} http {}",
            self.raft, self.amqp, self.http
        )
    }
}

/// One entry of the log: a batch of replicated root ops (one group commit of the leader),
/// encoded with `warren_storage::op_codec` so the format is versioned and never panics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// The proposing process (random per start of a node): the leader recognises its own
    /// entries when it applies them, and does not apply them to its broker a second time.
    pub proposer: u64,
    /// The highest journal ticket of the leader this entry covers (its journals wait for it).
    pub ticket: u64,
    /// The leader's broker clock when the ops were made: replicas apply with the same clock,
    /// so nothing clock-dependent in the apply diverges.
    pub clock_ms: u64,
    /// `op_codec::encode_ops` of the ops.
    pub ops: Bytes,
}

/// About how many bytes `entry` takes serialized (a buffer sized once rather than grown
/// step by step: each step of a large one is a fresh allocation, faulted in page by page).
pub fn entry_size_hint(entry: &Entry) -> usize {
    match &entry.payload {
        openraft::EntryPayload::Normal(batch) => batch.ops.len() + 64,
        _ => 256,
    }
}

impl std::fmt::Display for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "batch(ticket {}, {} bytes)", self.ticket, self.ops.len())
    }
}

/// A snapshot as openraft holds it: its file (`snapshot`), open for reading from its start.
#[derive(Debug)]
pub struct SnapshotData {
    pub file: std::fs::File,
    /// A snapshot received from the leader: where its file is until it is installed.
    pub received: Option<Received>,
}

/// The file of a received snapshot, removed when dropped unless `keep` took it (a transfer or
/// an install that failed leaves nothing behind).
#[derive(Debug)]
pub struct Received(Option<PathBuf>);

impl Received {
    pub fn new(path: PathBuf) -> Received {
        Received(Some(path))
    }

    pub fn path(&self) -> Option<&std::path::Path> {
        self.0.as_deref()
    }

    /// The file stays: its path.
    pub fn keep(mut self) -> Option<PathBuf> {
        self.0.take()
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

openraft::declare_raft_types!(
    /// The broker's Raft group.
    pub TypeConfig:
        D = Batch,
        R = (),
        NodeId = u64,
        Node = NodeInfo,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = SnapshotData,
        AsyncRuntime = openraft::TokioRuntime,
        Responder = openraft::impls::OneshotResponder<TypeConfig>,
);

pub type NodeId = u64;
pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type Membership = openraft::Membership<NodeId, NodeInfo>;
pub type StoredMembership = openraft::StoredMembership<NodeId, NodeInfo>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, NodeInfo>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;

/// A snapshot file holding `bytes` (anonymous: gone with its last handle). For tests.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub fn data_of(bytes: &[u8]) -> SnapshotData {
    use std::io::{Seek, Write};
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(bytes).unwrap();
    file.rewind().unwrap();
    SnapshotData {
        file,
        received: None,
    }
}

/// What a snapshot file holds. For tests.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub fn bytes_of(mut data: SnapshotData) -> Vec<u8> {
    use std::io::{Read, Seek};
    let mut out = Vec::new();
    data.file.rewind().unwrap();
    data.file.read_to_end(&mut out).unwrap();
    out
}

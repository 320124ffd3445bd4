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
    /// `op_codec::encode_ops` of the ops. Decoded from a network frame (`decode_sharing`), a
    /// slice of that frame rather than a copy.
    #[serde(deserialize_with = "ops_sharing")]
    pub ops: Bytes,
}

thread_local! {
    /// The frame `decode_sharing` decodes on this thread (None: not decoding one).
    static FRAME: std::cell::RefCell<Option<Bytes>> = const { std::cell::RefCell::new(None) };
}

/// Decodes `T` from `frame` (postcard); the ops of every batch in it are slices of `frame`, not
/// copies (a follower receives every message body this way: one copy of each less).
pub fn decode_sharing<T: serde::de::DeserializeOwned>(frame: Bytes) -> Result<T, postcard::Error> {
    FRAME.with(|f| *f.borrow_mut() = Some(frame.clone()));
    let decoded = postcard::from_bytes::<T>(&frame);
    FRAME.with(|f| f.borrow_mut().take());
    decoded
}

/// `bytes` as a slice of the frame being decoded when they lie within it, else a copy.
fn shared(bytes: &[u8]) -> Bytes {
    FRAME.with(|f| match &*f.borrow() {
        Some(frame) => {
            let start = frame.as_ptr() as usize;
            let at = bytes.as_ptr() as usize;
            // Checked first: `slice_ref` panics on bytes from elsewhere.
            if at >= start && at + bytes.len() <= start + frame.len() {
                frame.slice_ref(bytes)
            } else {
                Bytes::copy_from_slice(bytes)
            }
        }
        None => Bytes::copy_from_slice(bytes),
    })
}

/// Deserializes a batch's ops with `shared` (what `Bytes`'s own impl accepts, otherwise).
fn ops_sharing<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
    struct Ops;
    impl<'de> serde::de::Visitor<'de> for Ops {
        type Value = Bytes;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }
        fn visit_borrowed_bytes<E: serde::de::Error>(self, v: &'de [u8]) -> Result<Bytes, E> {
            Ok(shared(v))
        }
        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
            Ok(Bytes::copy_from_slice(v))
        }
        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
            Ok(Bytes::from(v))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(b) = seq.next_element::<u8>()? {
                v.push(b);
            }
            Ok(Bytes::from(v))
        }
    }
    d.deserialize_bytes(Ops)
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

#[cfg(test)]
mod tests {
    use super::{decode_sharing, Batch};
    use bytes::Bytes;

    fn within(frame: &Bytes, part: &Bytes) -> bool {
        let start = frame.as_ptr() as usize;
        let at = part.as_ptr() as usize;
        at >= start && at + part.len() <= start + frame.len()
    }

    #[test]
    fn a_batch_decoded_from_a_frame_shares_its_memory_and_one_decoded_elsewhere_is_copied() {
        let batches = vec![
            Batch {
                proposer: 1,
                ticket: 2,
                clock_ms: 3,
                ops: Bytes::from(vec![7u8; 4096]),
            },
            Batch {
                proposer: 1,
                ticket: 3,
                clock_ms: 4,
                ops: Bytes::from(vec![9u8; 100]),
            },
        ];
        let frame = Bytes::from(postcard::to_stdvec(&batches).unwrap());
        let shared: Vec<Batch> = decode_sharing(frame.clone()).unwrap();
        assert_eq!(shared, batches);
        assert!(shared.iter().all(|b| within(&frame, &b.ops)));
        // Outside `decode_sharing` (the log store's reads), and after it: copies.
        let copied: Vec<Batch> = postcard::from_bytes(&frame).unwrap();
        assert_eq!(copied, batches);
        assert!(copied.iter().all(|b| !within(&frame, &b.ops)));
        // A frame that does not decode leaves nothing behind for the next decode.
        assert!(decode_sharing::<Vec<Batch>>(frame.slice(..10)).is_err());
        let again: Vec<Batch> = postcard::from_bytes(&frame).unwrap();
        assert!(again.iter().all(|b| !within(&frame, &b.ops)));
    }
}

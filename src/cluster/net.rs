//! The Raft transport: openraft's RPCs between the nodes of one cluster, over TCP.
//!
//! Every frame is `len: u32 BE | body`, the body a postcard encoding of a [`Request`] (client
//! to server) or a [`Response`]. A frame is at most [`MAX_FRAME`] bytes; a longer one (or, before
//! the handshake, one over a few KiB) drops the connection before anything is allocated for it.
//!
//! A connection starts with the client's `Hello` (magic, protocol version, cluster id, sender,
//! addressee); the server answers `HelloOk`, or `Refused { reason }` and closes. Then the client
//! sends one request at a time and reads its response (openraft drives each [`Network`]
//! sequentially through `&mut self`), so there is no request id and no pipelining.
//!
//! The client ([`NetworkFactory`], [`Network`]) connects lazily on the first RPC and keeps the
//! connection; an error, a timeout, or an RPC future dropped part way (openraft puts its own
//! timeout around most RPCs) drops it and the next RPC connects again. A snapshot travels as its
//! file (`snapshot`), on a connection of its own so heartbeats are not held behind it: a
//! `SnapshotBegin` (vote, meta, size), `SnapshotChunk`s of up to [`SNAPSHOT_CHUNK`] bytes read
//! from the file, and a `SnapshotEnd`, answered once the target has installed it. The receiver
//! writes the chunks to a file as they come, so neither side holds a snapshot in memory.
//! The server is [`serve`].

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use openraft::error::{
    Fatal, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError, ReplicationClosed,
    StreamingError, Timeout, Unreachable,
};
use openraft::network::{Backoff, RPCOption, RPCTypes, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{AnyError, OptionalSend};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, timeout_at, Instant};
use tokio_util::codec::{Framed, LengthDelimitedCodec, LengthDelimitedCodecError};
use tracing::{debug, info, warn};

use super::types::{
    LogId, NodeId, NodeInfo, Raft, Received, Snapshot, SnapshotData, SnapshotMeta, TypeConfig, Vote,
};

/// The first four bytes of every `Hello`.
pub const MAGIC: [u8; 4] = *b"WRNR";
/// The protocol version this node speaks (and the only one it accepts). 2: snapshots travel
/// in chunks. 3: entries may hold removals with their messages' sizes (op tag 13), which a
/// node of version 2 cannot decode: it is refused at the handshake instead of stopping its
/// state machine on the first such entry. 4: entries may hold user deletions (op tag 14).
/// 5: entries may hold vhosts (op tags 15 and 16). 6: permissions and limits (17 to 20).
/// 7: topic permissions (21, 22) and a purge's counted key range (23). 8: a handshake's answer
/// names the answering node's voters (`HelloOk::voters`). 9: a Raft error travels as its
/// text (`flat_fatal`), not as openraft's nested error.
pub const VERSION: u16 = 9;
/// The bytes of a snapshot file one `SnapshotChunk` carries at most.
pub const SNAPSHOT_CHUNK: usize = 1 << 20;
/// The longest frame body sent or accepted: 64 MiB.
pub const MAX_FRAME: usize = 64 << 20;

/// The entry bytes one AppendEntries carries at most (unless it is one entry). openraft 0.9
/// gives the whole call one heartbeat interval (it wraps it in a timeout of its own,
/// replication/mod.rs), and a follower catching up was sent up to `max_payload_entries` (64)
/// entries of up to 1 MiB, whose fsync outlasted the heartbeat: the call timed out again and
/// again, and the leader, its acks missing, lost its lease. Past this budget the call answers
/// PayloadTooLarge with the number of entries that fit, which openraft sends instead (and keeps
/// as its hint for the next ten calls).
const APPEND_BYTES: usize = 4 << 20;

/// How many of these entries (their payload sizes, in order) fit in `budget` bytes: at least
/// one.
fn entries_within(sizes: impl Iterator<Item = usize>, budget: usize) -> usize {
    let mut total = 0usize;
    let mut n = 0;
    for size in sizes {
        total = total.saturating_add(size);
        if n > 0 && total > budget {
            break;
        }
        n += 1;
    }
    n
}

fn payload_size(entry: &openraft::Entry<TypeConfig>) -> usize {
    match &entry.payload {
        openraft::EntryPayload::Normal(batch) => batch.ops.len(),
        // A membership or a blank entry is small.
        _ => 64,
    }
}
/// The longest frame accepted before the handshake: a `Hello` is a few dozen bytes, and a peer
/// that has not said who it is must not make the server reserve 64 MiB.
const MAX_HELLO_FRAME: usize = 4 << 10;
/// How long the server waits for a new connection's `Hello`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// An established connection with no request for this long is closed by the server (a client
/// that vanished without a FIN must not hold a task for good); the client reconnects if needed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// The pause after a failed `accept` (out of file descriptors, say) before the next one.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);
/// The backoff openraft applies after an `Unreachable`: 20 ms, doubling up to 100 ms, below
/// the shortest election timeout, so that a peer that comes back hears from the leader before
/// it would campaign (a refused connect costs next to nothing).
const BACKOFF_FIRST: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_millis(100);

/// The first frame of a connection, from the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub magic: [u8; 4],
    pub version: u16,
    /// The cluster id: nodes of different clusters never talk.
    pub cluster: String,
    /// The sending node.
    pub from: NodeId,
    /// The node the sender means to reach: a node whose id differs refuses (a stale address).
    pub to: NodeId,
    /// The sender's incarnation when it asks whether it may take part (`probe`), else 0.
    pub incarnation: u64,
}

impl Hello {
    /// The `Hello` of this protocol version.
    pub fn new(cluster: &str, from: NodeId, to: NodeId) -> Hello {
        Hello {
            magic: MAGIC,
            version: VERSION,
            cluster: cluster.to_owned(),
            from,
            to,
            incarnation: 0,
        }
    }
}

/// Whether a server of cluster `cluster` that is node `me` accepts this `Hello`; `Err` is the
/// reason it refuses, as it is logged and sent back.
pub fn hello_check(hello: &Hello, cluster: &str, me: NodeId) -> Result<(), String> {
    if hello.magic != MAGIC {
        return Err(format!("bad magic {:?}", hello.magic));
    }
    if hello.version != VERSION {
        return Err(version_reason(hello.version));
    }
    if hello.cluster != cluster {
        return Err(format!(
            "cluster id {:?} is not this node's cluster {:?}",
            hello.cluster, cluster
        ));
    }
    if hello.to != me {
        return Err(format!(
            "addressed to node {} but this is node {me}",
            hello.to
        ));
    }
    Ok(())
}

fn version_reason(version: u16) -> String {
    format!("protocol version {version} is not supported (this node speaks {VERSION})")
}

/// What a client sends. `Hello` stays variant 0 in every version: a server reads the magic and
/// the version of a `Hello` it cannot decode whole, to say why it refuses.
#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Hello(Hello),
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    /// A snapshot follows: `size` bytes of its file in `SnapshotChunk`s, then `SnapshotEnd`.
    SnapshotBegin {
        vote: Vote,
        meta: SnapshotMeta,
        size: u64,
    },
    SnapshotChunk(Bytes),
    SnapshotEnd,
    /// Would you vote for me, were I to campaign now? (`PreVote`; answered `PreVoted`.)
    PreVote(PreVote),
}

/// A pre-vote (the Raft thesis, section 9.6), asked before a node may campaign (see
/// `cluster::elections`): openraft 0.9 has none, and a node that had been cut off or paused
/// (SIGSTOP, a stalled VM) came back with a higher term and deposed a leader that a majority
/// followed all along, closing every client connection (seen: one follower stopped for 6 s
/// and continued, under load). A node grants it only when it has not heard from a leader for
/// `Heard::quiet` itself (a leader: when no majority acknowledged it for as long), and the
/// candidate's log is at least as up to date as its own (the last entry's term, then index:
/// the vote's own rule, or a node with a longer log of an older term would gather pre-votes
/// for a campaign no one votes for, while refusing the others theirs). It decides nothing:
/// the vote that follows is openraft's, with all its checks.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreVote {
    pub candidate: NodeId,
    pub last_log_id: Option<LogId>,
}

/// What a server answers.
#[derive(Debug, Serialize, Deserialize)]
enum Response {
    /// The handshake is accepted; `info` is the answering node's addresses (the leader puts
    /// its followers' in the membership from these).
    HelloOk {
        info: Option<NodeInfo>,
        /// What the answering node's membership records of the connecting node (a node that
        /// lost its data learns from it that it was a member).
        #[serde(default)]
        known: Option<NodeInfo>,
        /// The voters of the answering node's membership and their Raft addresses (none: it
        /// belongs to no formed cluster yet). A node whose log is new counts on them which
        /// members could hold a record of it (`may_join`).
        #[serde(default)]
        voters: Vec<(NodeId, String)>,
        /// The answering node's incarnation (0: none yet). A node whose log is new, forming
        /// the cluster, keeps those of the peers that answered it as new too (`formed_with`).
        #[serde(default)]
        incarnation: u64,
        /// The answering node formed the cluster when the connecting node, with the
        /// incarnation its `Hello` gives, answered it as a node whose log is new: it never
        /// took part since, so it has nothing to forget (`may_join`).
        #[serde(default)]
        vouched: bool,
    },
    Refused {
        reason: String,
    },
    AppendEntries(AppendEntriesResponse<NodeId>),
    Vote(VoteResponse<NodeId>),
    Snapshot(SnapshotResponse<NodeId>),
    /// The target's Raft failed the request. `Raft::append_entries` and `Raft::vote` fail with a
    /// `RaftError<NodeId>`, whose only possible case is `Fatal`, and `install_full_snapshot`
    /// with a `Fatal`: the `Fatal` is what travels, flattened (`flat_fatal`).
    RaftError(#[serde(with = "flat_fatal")] Fatal<NodeId>),
    PreVoted {
        granted: bool,
    },
}

impl Response {
    fn name(&self) -> &'static str {
        match self {
            Response::HelloOk { .. } => "HelloOk",
            Response::Refused { .. } => "Refused",
            Response::AppendEntries(_) => "AppendEntries",
            Response::Vote(_) => "Vote",
            Response::Snapshot(_) => "Snapshot",
            Response::RaftError(_) => "RaftError",
            Response::PreVoted { .. } => "PreVoted",
        }
    }
}

type Conn = Framed<TcpStream, LengthDelimitedCodec>;

/// The length prefix of a frame.
const LENGTH_BYTES: usize = 4;

fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(LENGTH_BYTES)
        .big_endian()
        .max_frame_length(max_frame)
        .new_codec()
}

/// Whether a read or write error is the codec refusing a frame over its maximum length.
fn is_too_large(e: &io::Error) -> bool {
    e.get_ref()
        .is_some_and(|inner| inner.is::<LengthDelimitedCodecError>())
}

fn encode<T: Serialize>(msg: &T) -> Result<Bytes, postcard::Error> {
    postcard::to_stdvec(msg).map(Bytes::from)
}

/// Whether an AppendEntries' entries fail to follow its `prev_log_id` one index at a time
/// with log ids that never go back (or reach the last index). openraft 0.9 checks only part
/// of this, with debug assertions: entries with a gap between them were taken and answered
/// `Success` (a log with a hole in it), and a first entry that does not follow panics its core
/// in a debug build and is written in a release one.
fn out_of_order(rpc: &AppendEntriesRequest<TypeConfig>) -> bool {
    let mut prev = rpc.prev_log_id;
    for entry in &rpc.entries {
        let next = prev.map_or(Some(0), |p| p.index.checked_add(1));
        if Some(entry.log_id.index) != next || entry.log_id.index == u64::MAX {
            return true;
        }
        if prev.is_some_and(|p| entry.log_id.leader_id < p.leader_id) {
            return true;
        }
        prev = Some(entry.log_id);
    }
    false
}

/// A `Fatal` on the wire: its kind, and a storage error's text. openraft's own encoding nests
/// `AnyError`s (each may hold another as its source) to any depth, and postcard decodes
/// nesting by recursion with no limit: a peer's answer of a few tens of KiB of nested sources
/// would overflow the stack of the task decoding it, which aborts the process (no panic to
/// catch). The text is all the receiver does anything with (it logs the error).
mod flat_fatal {
    use super::{Fatal, NodeId};
    use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageError, StorageIOError};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    enum Flat {
        Storage(String),
        Panicked,
        Stopped,
    }

    pub fn serialize<S: Serializer>(fatal: &Fatal<NodeId>, s: S) -> Result<S::Ok, S::Error> {
        match fatal {
            Fatal::StorageError(e) => Flat::Storage(e.to_string()),
            Fatal::Panicked => Flat::Panicked,
            Fatal::Stopped => Flat::Stopped,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Fatal<NodeId>, D::Error> {
        Ok(match Flat::deserialize(d)? {
            Flat::Storage(text) => Fatal::StorageError(StorageError::from(StorageIOError::new(
                ErrorSubject::Store,
                ErrorVerb::Write,
                AnyError::error(format!("on the peer: {text}")),
            ))),
            Flat::Panicked => Fatal::Panicked,
            Flat::Stopped => Fatal::Stopped,
        })
    }
}

fn fatal_of(e: RaftError<NodeId>) -> Fatal<NodeId> {
    match e {
        RaftError::APIError(never) => match never {},
        RaftError::Fatal(fatal) => fatal,
    }
}

// ---------------------------------------------------------------------------------------------
// Server

/// Serves the Raft RPCs of node `me` of cluster `cluster` to the connections `listener`
/// accepts, one task per connection. It runs until dropped (abort its task); dropping it also
/// ends every connection it serves.
/// Received snapshots are written in `snapshots` (as `sm::RECEIVING*` files).
pub async fn serve(
    listener: TcpListener,
    raft: Raft,
    cluster: String,
    me: NodeId,
    snapshots: std::path::PathBuf,
) {
    serve_as(listener, raft, cluster, me, snapshots, Local::default()).await
}

/// When this node last accepted an AppendEntries (a leader's heartbeat or entries): a
/// follower hands clients only to a leader it heard from lately (`Replication::leader_info`).
#[derive(Debug)]
pub struct Heard {
    epoch: Instant,
    /// Ms since `epoch` at the last accepted AppendEntries, plus one (0: never).
    at: std::sync::atomic::AtomicU64,
    /// How long a leader heard from counts as alive, for pre-votes (`PreVote`): the shortest
    /// election timeout.
    pub quiet: Duration,
}

impl Default for Heard {
    fn default() -> Self {
        Heard::new(Duration::from_millis(150))
    }
}

impl Heard {
    pub fn new(quiet: Duration) -> Self {
        Heard {
            epoch: Instant::now(),
            at: Default::default(),
            quiet,
        }
    }

    /// Whether an AppendEntries was accepted within `quiet`.
    pub fn lately(&self) -> bool {
        self.since().is_some_and(|d| d < self.quiet)
    }

    fn mark(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64 + 1;
        self.at.fetch_max(ms, std::sync::atomic::Ordering::AcqRel);
    }

    /// How long ago the last AppendEntries was accepted (None: never).
    pub fn since(&self) -> Option<Duration> {
        match self.at.load(std::sync::atomic::Ordering::Acquire) {
            0 => None,
            at => Some(
                self.epoch
                    .elapsed()
                    .saturating_sub(Duration::from_millis(at - 1)),
            ),
        }
    }
}

/// [`serve`], answering each handshake with this node's addresses (`Local::info`), marking in
/// `Local::heard` each AppendEntries accepted, and answering pre-votes from what it knows.
pub async fn serve_as(
    listener: TcpListener,
    raft: Raft,
    cluster: String,
    me: NodeId,
    snapshots: std::path::PathBuf,
    local: Local,
) {
    let cluster: Arc<str> = cluster.into();
    let info = Arc::new(local);
    let snapshots = Arc::new(snapshots);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    conns.spawn(serve_conn(stream, peer, raft.clone(), cluster.clone(), me, info.clone(), snapshots.clone()));
                }
                Err(e) => {
                    warn!("raft: accepting a connection failed: {e}");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            },
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        warn!("raft: a connection task panicked: {e}");
                    }
                }
            }
        }
    }
}

/// The `Hello` in a first frame, or why it is not one.
fn decode_hello(frame: &[u8]) -> Result<Hello, String> {
    match postcard::from_bytes::<Request>(frame) {
        Ok(Request::Hello(hello)) => Ok(hello),
        Ok(_) => Err("the first frame is not a Hello".to_owned()),
        Err(e) => Err(
            // A Hello of another version may not decode whole: name its version if it has one.
            match postcard::take_from_bytes::<(u32, [u8; 4], u16)>(frame) {
                Ok(((0, magic, version), _)) if magic == MAGIC && version != VERSION => {
                    version_reason(version)
                }
                _ => format!("undecodable handshake ({e})"),
            },
        ),
    }
}

/// Tells a refused peer why (best effort: it may be gone or not a Warren node at all).
async fn refuse(framed: &mut Conn, reason: String) {
    if let Ok(frame) = encode(&Response::Refused { reason }) {
        let _ = timeout(HANDSHAKE_TIMEOUT, framed.send(frame)).await;
    }
}

async fn serve_conn(
    stream: TcpStream,
    peer: SocketAddr,
    raft: Raft,
    cluster: Arc<str>,
    me: NodeId,
    info: Arc<Local>,
    snapshots: Arc<std::path::PathBuf>,
) {
    let heard = &info.heard;
    if let Err(e) = stream.set_nodelay(true) {
        debug!("raft: set_nodelay on the connection from {peer}: {e}");
    }
    let mut framed = Framed::new(stream, codec(MAX_HELLO_FRAME));

    let hello = match timeout(HANDSHAKE_TIMEOUT, framed.next()).await {
        Err(_) => {
            warn!(%peer, "raft: refused the connection from {peer}: no handshake within {HANDSHAKE_TIMEOUT:?}");
            return;
        }
        Ok(None) => {
            debug!("raft: the connection from {peer} closed before its handshake");
            return;
        }
        Ok(Some(Err(e))) => {
            let reason = if is_too_large(&e) {
                format!("a handshake frame over {MAX_HELLO_FRAME} bytes (not a Warren Raft peer?)")
            } else {
                format!("reading the handshake: {e}")
            };
            warn!(%peer, "raft: refused the connection from {peer}: {reason}");
            refuse(&mut framed, reason).await;
            return;
        }
        Ok(Some(Ok(frame))) => {
            decode_hello(&frame).and_then(|hello| hello_check(&hello, &cluster, me).map(|()| hello))
        }
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(reason) => {
            warn!(%peer, "raft: refused the connection from {peer}: {reason}");
            refuse(&mut framed, reason).await;
            return;
        }
    };
    let from = hello.from;
    let vouched =
        hello.incarnation != 0 && info.formed_with.lock().get(&from) == Some(&hello.incarnation);
    let (known, voters) = {
        let m = raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        (
            membership.get_node(&from).cloned(),
            membership
                .voter_ids()
                .map(|id| {
                    let raft = membership.get_node(&id).map(|n| n.raft.clone());
                    (id, raft.unwrap_or_default())
                })
                .collect::<Vec<_>>(),
        )
    };
    // A node that does not take part yet gives no membership data: a leader would record its
    // incarnation (`update_addresses`), and a member whose data was lost would then find
    // itself recorded as it is now and vote (`may_join`).
    let undecided = info.undecided.load(std::sync::atomic::Ordering::Acquire);
    let ok = match encode(&Response::HelloOk {
        info: if undecided { None } else { info.info.clone() },
        known,
        voters,
        incarnation: info.info.as_ref().map_or(0, |i| i.incarnation),
        vouched,
    }) {
        Ok(ok) => ok,
        Err(e) => {
            warn!("raft: encoding HelloOk: {e}");
            return;
        }
    };
    if let Err(e) = framed.send(ok).await {
        debug!("raft: answering the handshake of node {from} at {peer}: {e}");
        return;
    }
    if undecided {
        debug!("raft: node {from} at {peer} was answered its handshake only: this node does not take part yet");
        return;
    }
    framed.codec_mut().set_max_frame_length(MAX_FRAME);
    debug!("raft: node {from} connected from {peer}");

    loop {
        let request = match timeout(IDLE_TIMEOUT, framed.next()).await {
            Err(_) => {
                debug!("raft: closing the idle connection of node {from} at {peer}");
                return;
            }
            Ok(None) => {
                debug!("raft: node {from} at {peer} closed its connection");
                return;
            }
            Ok(Some(Err(e))) => {
                if is_too_large(&e) {
                    warn!(%peer, "raft: dropped the connection of node {from} at {peer}: a frame over the {MAX_FRAME} byte limit");
                } else {
                    debug!("raft: reading from node {from} at {peer}: {e}");
                }
                return;
            }
            // The entries' ops are slices of the frame (no copy): it lives as long as they do.
            Ok(Some(Ok(frame))) => {
                let len = frame.len();
                match super::types::decode_sharing::<Request>(frame.freeze()) {
                    Ok(request) => request,
                    Err(e) => {
                        warn!(%peer, "raft: dropped the connection of node {from} at {peer}: undecodable request of {len} bytes ({e})");
                        return;
                    }
                }
            }
        };
        let response = match request {
            Request::Hello(_) => {
                warn!(%peer, "raft: dropped the connection of node {from} at {peer}: a second Hello");
                return;
            }
            Request::AppendEntries(rpc) if out_of_order(&rpc) => {
                warn!(%peer, "raft: dropped the connection of node {from} at {peer}: entries out of order after {:?}", rpc.prev_log_id);
                return;
            }
            Request::AppendEntries(rpc) => match raft.append_entries(rpc).await {
                Ok(resp) => {
                    if matches!(
                        resp,
                        AppendEntriesResponse::Success | AppendEntriesResponse::PartialSuccess(_)
                    ) {
                        heard.mark();
                    }
                    if !matches!(resp, AppendEntriesResponse::HigherVote(_)) {
                        // A leader is heard (even one whose entries do not fit the log yet):
                        // openraft may not campaign from now on, not only from the next check
                        // of `elections` (a heartbeat later). A node frozen (SIGSTOP, a paused
                        // VM) in between woke up allowed to, campaigned at once with a higher
                        // term, and deposed the leader.
                        raft.runtime_config().elect(false);
                    }
                    Response::AppendEntries(resp)
                }
                Err(e) => Response::RaftError(fatal_of(e)),
            },
            Request::Vote(rpc) => match raft.vote(rpc).await {
                Ok(resp) => {
                    if resp.vote_granted {
                        // Its vote is given: the same (a leader is about to be).
                        raft.runtime_config().elect(false);
                    }
                    Response::Vote(resp)
                }
                Err(e) => Response::RaftError(fatal_of(e)),
            },
            Request::SnapshotBegin { vote, meta, size } => {
                let data = match receive_snapshot(&mut framed, &snapshots, size).await {
                    Ok(data) => data,
                    Err(e) => {
                        warn!(%peer, "raft: dropped the connection of node {from} at {peer}: receiving snapshot {}: {e}", meta.snapshot_id);
                        return;
                    }
                };
                let snapshot = Snapshot {
                    meta,
                    snapshot: Box::new(data),
                };
                match raft.install_full_snapshot(vote, snapshot).await {
                    Ok(resp) => Response::Snapshot(resp),
                    Err(fatal) => Response::RaftError(fatal),
                }
            }
            Request::PreVote(p) => Response::PreVoted {
                granted: grants_prevote(&raft, &info, &p),
            },
            Request::SnapshotChunk(_) | Request::SnapshotEnd => {
                warn!(%peer, "raft: dropped the connection of node {from} at {peer}: a snapshot chunk outside a snapshot");
                return;
            }
        };
        let frame = match encode(&response) {
            Ok(frame) => frame,
            Err(e) => {
                warn!("raft: encoding a {} response: {e}", response.name());
                return;
            }
        };
        if let Err(e) = framed.send(frame).await {
            debug!("raft: answering node {from} at {peer}: {e}");
            return;
        }
    }
}

/// Reads a snapshot's chunks into a new file in `dir` until `SnapshotEnd`: exactly `size`
/// bytes, each chunk within `IDLE_TIMEOUT`. The file is removed if anything goes wrong (the
/// `Received` guard).
async fn receive_snapshot(
    framed: &mut Conn,
    dir: &std::path::Path,
    size: u64,
) -> Result<SnapshotData, String> {
    use tokio::io::AsyncWriteExt;
    let path = dir.join(format!(
        "{}{:016x}",
        super::sm::RECEIVING,
        rand::random::<u64>()
    ));
    let file = tokio::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(&path)
        .await
        .map_err(|e| format!("creating {}: {e}", path.display()))?;
    let received = Received::new(path.clone());
    let mut out = tokio::io::BufWriter::with_capacity(SNAPSHOT_CHUNK, file);
    let mut got: u64 = 0;
    loop {
        let frame = match timeout(IDLE_TIMEOUT, framed.next()).await {
            Err(_) => return Err("no chunk in time".into()),
            Ok(None) => return Err("the connection closed".into()),
            Ok(Some(Err(e))) => return Err(format!("reading: {e}")),
            Ok(Some(Ok(frame))) => frame,
        };
        match postcard::from_bytes::<Request>(&frame) {
            Ok(Request::SnapshotChunk(chunk)) => {
                got += chunk.len() as u64;
                if got > size {
                    return Err(format!("more than the {size} bytes announced"));
                }
                out.write_all(&chunk)
                    .await
                    .map_err(|e| format!("writing {}: {e}", path.display()))?;
            }
            Ok(Request::SnapshotEnd) => break,
            Ok(_) => return Err("another request inside a snapshot".into()),
            Err(e) => return Err(format!("an undecodable frame ({e})")),
        }
    }
    if got != size {
        return Err(format!("{got} bytes of the {size} announced"));
    }
    out.flush()
        .await
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    let file = out.into_inner().into_std().await;
    file.sync_all()
        .map_err(|e| format!("syncing {}: {e}", path.display()))?;
    let file =
        std::fs::File::open(&path).map_err(|e| format!("reopening {}: {e}", path.display()))?;
    Ok(SnapshotData {
        file,
        received: Some(received),
    })
}

// ---------------------------------------------------------------------------------------------
// Client

/// Makes the [`Network`] to each peer of node `me` of cluster `cluster`.
#[derive(Debug, Clone)]
pub struct NetworkFactory {
    cluster: String,
    me: NodeId,
    learned: Learned,
    outages: Outages,
}

/// Since when each peer does not answer AppendEntries (see `Network::outage`), shared by
/// every client openraft makes for it (it makes a new one for each replication session).
type Outages = Arc<parking_lot::Mutex<std::collections::BTreeMap<NodeId, Instant>>>;

/// The addresses peers gave in their handshake answers, by node id.
pub type Learned = Arc<parking_lot::Mutex<std::collections::BTreeMap<NodeId, NodeInfo>>>;

impl NetworkFactory {
    pub fn new(cluster: impl Into<String>, me: NodeId) -> NetworkFactory {
        NetworkFactory {
            cluster: cluster.into(),
            me,
            learned: Default::default(),
            outages: Default::default(),
        }
    }

    /// What peers said of themselves when this node connected to them.
    pub fn learned(&self) -> Learned {
        self.learned.clone()
    }
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = Network;

    /// Does not connect: the first RPC does.
    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> Network {
        Network {
            cluster: self.cluster.clone(),
            me: self.me,
            target,
            node: node.clone(),
            conn: None,
            learned: self.learned.clone(),
            scratch: Frame::default(),
            outages: self.outages.clone(),
        }
    }
}

/// The RPCs of one node to one peer (`target`, at `node.raft`).
pub struct Network {
    cluster: String,
    me: NodeId,
    target: NodeId,
    node: NodeInfo,
    /// The connection, when one is open and idle. An RPC takes it out for its whole exchange and
    /// puts it back only once the response is read: an RPC that fails, times out, or whose
    /// future is dropped part way (openraft's own timeout) drops the connection with it, so the
    /// next RPC never reads a stale response: it connects anew. (This is the in-flight flag,
    /// kept by ownership.)
    conn: Option<Conn>,
    learned: Learned,
    /// The frame AppendEntries are encoded into (`encode_request_in`), kept between calls.
    scratch: Frame,
    /// Since when AppendEntries to each peer fail (absent: the last one was answered).
    /// openraft logs an ERROR for each failed call, retried every 100 ms at most while a peer
    /// is down (ten lines a second, for as long as it stays down): those are filtered out
    /// (main.rs, `quiet_rpc_errors`) and this node says it here once per outage instead.
    outages: Outages,
}

/// Why an exchange failed, before it is told in the error type of the RPC at hand.
#[derive(Debug)]
enum CallError {
    /// No connection (refused, reset, closed, handshake refused, no connection in time):
    /// openraft backs off before the next try.
    Unreachable(AnyError),
    /// Another I/O or protocol failure.
    Network(AnyError),
    /// No response within the RPC's hard TTL on an established connection.
    Timeout(Duration),
    /// The request encodes to more than a frame (its length).
    TooLarge(usize),
    /// The target's Raft failed the request.
    Remote(Box<Fatal<NodeId>>),
}

fn io_error(context: impl std::fmt::Display, e: &io::Error) -> CallError {
    let err = AnyError::error(format!("{context}: {e}"));
    match e.kind() {
        io::ErrorKind::ConnectionRefused
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::NotConnected
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::UnexpectedEof
        | io::ErrorKind::HostUnreachable
        | io::ErrorKind::NetworkUnreachable => CallError::Unreachable(err),
        _ => CallError::Network(err),
    }
}

/// A request as it goes on the wire: its length (4 bytes, big-endian, as `codec` frames) and
/// its postcard encoding, without copying the large byte strings it carries (the ops of an
/// AppendEntries' entries, a snapshot chunk): `head` holds every other byte, in order, and
/// `splices` says where in `head` each of those goes (`(offset, bytes)`, offsets ascending).
/// `send_frame` writes the parts with vectored writes, so the bytes on the wire are exactly
/// the postcard encoding of the request. Before, each AppendEntries was encoded whole into a
/// buffer, once per follower: a copy of every message body per follower on the leader, whose
/// CPU bounds a cluster's throughput (issue 15 point 9).
#[derive(Debug, Default)]
struct Frame {
    head: Vec<u8>,
    splices: Vec<(usize, Bytes)>,
}

impl Frame {
    /// The bytes after the length prefix.
    fn body_len(&self) -> usize {
        self.head.len() - LENGTH_BYTES + self.splices.iter().map(|(_, b)| b.len()).sum::<usize>()
    }

    /// The frame's parts in order (none empty).
    fn parts(&self) -> Vec<&[u8]> {
        let mut parts = Vec::with_capacity(2 * self.splices.len() + 1);
        let mut at = 0;
        for (offset, bytes) in &self.splices {
            parts.push(&self.head[at..*offset]);
            parts.push(&bytes[..]);
            at = *offset;
        }
        parts.push(&self.head[at..]);
        parts.retain(|p| !p.is_empty());
        parts
    }

    /// The whole frame in one buffer (tests).
    #[cfg(test)]
    fn to_vec(&self) -> Vec<u8> {
        self.parts().concat()
    }
}

/// Byte strings shorter than this are copied into a frame's head (a splice costs an iovec).
const SPLICE_MIN: usize = 1024;

/// The large byte strings of `request`, in the order its encoding holds them.
fn spliceable(request: &Request) -> Vec<Bytes> {
    match request {
        Request::AppendEntries(r) => r
            .entries
            .iter()
            .filter_map(|e| match &e.payload {
                openraft::EntryPayload::Normal(batch) if batch.ops.len() >= SPLICE_MIN => {
                    Some(batch.ops.clone())
                }
                _ => None,
            })
            .collect(),
        Request::SnapshotChunk(chunk) if chunk.len() >= SPLICE_MIN => vec![chunk.clone()],
        _ => Vec::new(),
    }
}

/// The postcard output of `encode_request_in`: bytes go into `frame.head`, except a slice that
/// is (the same memory as) the next of `candidates`, which becomes a splice.
struct Splicing<'a> {
    frame: Frame,
    candidates: &'a [Bytes],
    next: usize,
}

impl postcard::ser_flavors::Flavor for Splicing<'_> {
    type Output = Frame;

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        if let Some(candidate) = self.candidates.get(self.next) {
            if candidate.as_ptr() == data.as_ptr() && candidate.len() == data.len() {
                self.frame
                    .splices
                    .push((self.frame.head.len(), candidate.clone()));
                self.next += 1;
                return Ok(());
            }
        }
        self.frame.head.extend_from_slice(data);
        Ok(())
    }

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.frame.head.push(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Frame> {
        Ok(self.frame)
    }
}

fn encode_request(request: &Request) -> Result<Frame, CallError> {
    let mut frame = Frame::default();
    encode_request_in(request, &mut frame)?;
    Ok(frame)
}

/// `request` as a `Frame`, into `frame` (cleared first; its head's buffer is reused).
/// AppendEntries keep one frame per peer for this: a fresh buffer of a few hundred KiB for
/// every call came from memory the allocator had handed back to the kernel, which faulted in
/// and zeroed it page by page (profiled: 4% of a leader's CPU, with `LogStore::append`'s).
fn encode_request_in(request: &Request, frame: &mut Frame) -> Result<(), CallError> {
    let candidates = spliceable(request);
    let spliced: usize = candidates.iter().map(Bytes::len).sum();
    let size = match request {
        Request::AppendEntries(r) => {
            r.entries
                .iter()
                .map(super::types::entry_size_hint)
                .sum::<usize>()
                + 256
        }
        Request::SnapshotChunk(chunk) => chunk.len() + 16,
        _ => 256,
    };
    let mut head = std::mem::take(&mut frame.head);
    head.clear();
    head.reserve(size.saturating_sub(spliced) + LENGTH_BYTES);
    head.extend_from_slice(&[0; LENGTH_BYTES]);
    let mut splices = std::mem::take(&mut frame.splices);
    splices.clear();
    let out = Splicing {
        frame: Frame { head, splices },
        candidates: &candidates,
        next: 0,
    };
    let mut out = postcard::serialize_with_flavor(request, out)
        .map_err(|e| CallError::Network(AnyError::error(format!("encode: {e}"))))?;
    let len = out.body_len();
    if len > MAX_FRAME {
        return Err(CallError::TooLarge(len));
    }
    let prefix = u32::try_from(len).map_err(|_| CallError::TooLarge(len))?;
    out.head[..LENGTH_BYTES].copy_from_slice(&prefix.to_be_bytes());
    *frame = out;
    Ok(())
}

/// The most slices one vectored write is given (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Writes a frame of `encode_request` to `conn`'s socket (the client side writes only
/// these, so the codec never holds unsent bytes that this would overtake).
async fn send_frame(conn: &mut Conn, frame: &Frame) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let stream = conn.get_mut();
    if frame.splices.is_empty() {
        stream.write_all(&frame.head).await?;
        return stream.flush().await;
    }
    let parts = frame.parts();
    let mut slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = rest.len().min(IOV_MAX);
        let written = stream.write_vectored(&rest[..n]).await?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        io::IoSlice::advance_slices(&mut rest, written);
    }
    stream.flush().await
}

/// What a server knows of its own node: its addresses (None: answers no `info`), when it last
/// heard from a leader, and its log (None: pre-votes compare no log).
#[derive(Default)]
pub struct Local {
    pub info: Option<NodeInfo>,
    pub heard: Arc<Heard>,
    pub log: Option<super::log_store::LogStore>,
    /// While set (a node whose log is new, until it knows it may take part: `may_join`),
    /// a connection is closed once its handshake is answered: no vote, pre-vote or entry.
    pub undecided: Arc<std::sync::atomic::AtomicBool>,
    /// The peers (and their incarnations) that answered this node as nodes whose log is new
    /// when it formed the cluster (`may_join`).
    pub formed_with: Arc<parking_lot::Mutex<std::collections::BTreeMap<NodeId, u64>>>,
}

/// Whether this node would vote for the candidate of `p` (see `PreVote`).
fn grants_prevote(raft: &Raft, local: &Local, p: &PreVote) -> bool {
    let heard = &local.heard;
    let (leading, acked_ms) = {
        let m = raft.metrics();
        let m = m.borrow();
        (
            m.state == openraft::ServerState::Leader,
            m.millis_since_quorum_ack,
        )
    };
    let last = match local
        .log
        .as_ref()
        .map(super::log_store::LogStore::last_log_id)
    {
        Some(Ok(last)) => last,
        None => None,
        Some(Err(e)) => {
            warn!("raft: a pre-vote refused: the log's last entry cannot be read ({e})");
            return false;
        }
    };
    let quiet = u64::try_from(heard.quiet.as_millis()).unwrap_or(u64::MAX);
    // A leader that a majority acknowledged lately, or a follower that heard one, knows of a
    // leader alive: no pre-vote from it.
    let leader_alive = heard.lately() || (leading && acked_ms.is_some_and(|ms| ms < quiet));
    let granted = !leader_alive && p.last_log_id >= last;
    debug!(
        candidate = p.candidate,
        granted, leading, "raft: pre-vote asked"
    );
    granted
}

/// Ask node `to` at `addr` for a pre-vote (`PreVote`) as node `me`, on a connection of its own
/// (an election is rare; the RPC connections stay with openraft's calls). Err: no answer.
pub async fn prevote(
    addr: &str,
    cluster: &str,
    me: NodeId,
    to: NodeId,
    p: &PreVote,
) -> Result<bool, String> {
    let (mut conn, _, _) = connect(addr, &Hello::new(cluster, me, to))
        .await
        .map_err(|e| format!("{e:?}"))?;
    let frame = encode_request(&Request::PreVote(p.clone())).map_err(|e| format!("{e:?}"))?;
    match exchange(&mut conn, &frame, to).await {
        Ok(Response::PreVoted { granted }) => Ok(granted),
        Ok(other) => Err(format!("answered {}", other.name())),
        Err(e) => Err(format!("{e:?}")),
    }
}

/// What a probed node answered (`probe`).
#[derive(Debug)]
pub struct Probed {
    /// What its membership records of the probing node (None: not a member there).
    pub known: Option<NodeInfo>,
    /// Its membership's voters and their Raft addresses (none: it belongs to no formed
    /// cluster).
    pub voters: Vec<(NodeId, String)>,
    /// Its incarnation (0: none yet).
    pub incarnation: u64,
    /// It formed the cluster with the probing node's incarnation among the new ones.
    pub vouched: bool,
}

/// Say hello to node `to` at `addr` as node `me` of incarnation `incarnation`, and hang up.
/// Err: no answer or a refusal.
pub async fn probe(
    addr: &str,
    cluster: &str,
    me: NodeId,
    to: NodeId,
    incarnation: u64,
) -> Result<Probed, String> {
    let hello = Hello {
        incarnation,
        ..Hello::new(cluster, me, to)
    };
    match connect(addr, &hello).await {
        Ok((_, _, answer)) => Ok(answer),
        Err(e) => Err(format!("{e:?}")),
    }
}

/// Connects to `addr` and says `hello`; a refusal is logged here (with the peer's reason).
async fn connect(addr: &str, hello: &Hello) -> Result<(Conn, Option<NodeInfo>, Probed), CallError> {
    let target = hello.to;
    let unreachable = |what: String| CallError::Unreachable(AnyError::error(what));
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| unreachable(format!("connecting to node {target} at {addr}: {e}")))?;
    if let Err(e) = stream.set_nodelay(true) {
        debug!("raft: set_nodelay on the connection to node {target} at {addr}: {e}");
    }
    let mut conn = Framed::new(stream, codec(MAX_FRAME));
    let frame = encode_request(&Request::Hello(hello.clone()))?;
    send_frame(&mut conn, &frame)
        .await
        .map_err(|e| unreachable(format!("handshake with node {target} at {addr}: {e}")))?;
    let reason = match conn.next().await {
        Some(Ok(frame)) => match postcard::from_bytes::<Response>(&frame) {
            Ok(Response::HelloOk {
                info,
                known,
                voters,
                incarnation,
                vouched,
            }) => {
                let answer = Probed {
                    known,
                    voters,
                    incarnation,
                    vouched,
                };
                return Ok((conn, info, answer));
            }
            Ok(Response::Refused { reason }) => reason,
            Ok(other) => format!("answered the handshake with {}", other.name()),
            Err(e) => format!("undecodable handshake answer ({e})"),
        },
        Some(Err(e)) => {
            return Err(unreachable(format!(
                "handshake with node {target} at {addr}: {e}"
            )))
        }
        None => "closed the connection during the handshake".to_owned(),
    };
    warn!("raft: node {target} at {addr} refused our connection: {reason}");
    Err(unreachable(format!(
        "node {target} at {addr} refused the connection: {reason}"
    )))
}

/// Sends one request on `conn` and reads its response.
async fn exchange(conn: &mut Conn, frame: &Frame, target: NodeId) -> Result<Response, CallError> {
    send_frame(conn, frame)
        .await
        .map_err(|e| io_error(format_args!("sending to node {target}"), &e))?;
    match conn.next().await {
        Some(Ok(frame)) => postcard::from_bytes(&frame).map_err(|e| {
            CallError::Network(AnyError::error(format!(
                "undecodable response from node {target} ({e})"
            )))
        }),
        Some(Err(e)) => Err(io_error(
            format_args!("reading the response of node {target}"),
            &e,
        )),
        None => Err(CallError::Unreachable(AnyError::error(format!(
            "node {target} closed the connection"
        )))),
    }
}

impl Network {
    fn hello(&self) -> Hello {
        Hello::new(&self.cluster, self.me, self.target)
    }

    /// A new connection to the target, by `deadline`.
    async fn open(&self, deadline: Instant, ttl: Duration) -> Result<Conn, CallError> {
        match timeout_at(deadline, connect(&self.node.raft, &self.hello())).await {
            Ok(Ok((conn, info, _))) => {
                if let Some(info) = info {
                    self.learned.lock().insert(self.target, info);
                }
                Ok(conn)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(CallError::Unreachable(AnyError::error(format!(
                "no connection to node {} at {} within {ttl:?}",
                self.target, self.node.raft
            )))),
        }
    }

    /// One request and its response on the cached connection (opened if there is none), all
    /// within `ttl`.
    async fn call(&mut self, frame: &Frame, ttl: Duration) -> Result<Response, CallError> {
        let deadline = Instant::now() + ttl;
        let mut conn = match self.conn.take() {
            Some(conn) => conn,
            None => self.open(deadline, ttl).await?,
        };
        let response = timeout_at(deadline, exchange(&mut conn, frame, self.target))
            .await
            .map_err(|_| CallError::Timeout(ttl))??;
        self.conn = Some(conn);
        Ok(response)
    }

    /// The error for a response that is not the one the request asks for.
    fn unexpected(&mut self, response: Response) -> CallError {
        match response {
            Response::RaftError(fatal) => CallError::Remote(Box::new(fatal)),
            other => {
                self.conn = None;
                CallError::Network(AnyError::error(format!(
                    "node {} answered with an unexpected {}",
                    self.target,
                    other.name()
                )))
            }
        }
    }

    fn too_large(&self, what: &str, len: usize) -> AnyError {
        AnyError::error(format!(
            "{what} to node {} encodes to {len} bytes, over the {MAX_FRAME} byte frame limit",
            self.target
        ))
    }

    fn rpc_error(
        &self,
        e: CallError,
        action: RPCTypes,
    ) -> RPCError<NodeId, NodeInfo, RaftError<NodeId>> {
        match e {
            CallError::Unreachable(e) => RPCError::Unreachable(Unreachable::from(e)),
            CallError::Network(e) => RPCError::Network(NetworkError::from(e)),
            CallError::TooLarge(len) => {
                RPCError::Network(NetworkError::from(self.too_large(&action.to_string(), len)))
            }
            CallError::Timeout(timeout) => RPCError::Timeout(Timeout {
                action,
                id: self.me,
                target: self.target,
                timeout,
            }),
            CallError::Remote(fatal) => RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.node.clone(),
                RaftError::Fatal(*fatal),
            )),
        }
    }

    /// Say when AppendEntries to the target start failing (once per outage, with the first
    /// error) and when it answers again.
    fn outage(&self, error: Option<&RPCError<NodeId, NodeInfo, RaftError<NodeId>>>) {
        let mut outages = self.outages.lock();
        match (error, outages.get(&self.target).copied()) {
            (Some(e), None) => {
                warn!(
                    target = self.target,
                    addr = %self.node.raft,
                    "raft: node {} does not answer ({e}); retrying, said again once it answers",
                    self.target
                );
                outages.insert(self.target, Instant::now());
            }
            (Some(e), Some(_)) => debug!(target = self.target, "raft: AppendEntries: {e}"),
            (None, Some(since)) => {
                info!(
                    target = self.target,
                    "raft: node {} answers again, after {:.1} s",
                    self.target,
                    since.elapsed().as_secs_f64()
                );
                outages.remove(&self.target);
            }
            (None, None) => {}
        }
    }

    fn streaming_error(&self, e: CallError) -> StreamingError<TypeConfig, Fatal<NodeId>> {
        match e {
            CallError::Unreachable(e) => StreamingError::Unreachable(Unreachable::from(e)),
            CallError::Network(e) => StreamingError::Network(NetworkError::from(e)),
            CallError::TooLarge(len) => {
                StreamingError::Network(NetworkError::from(self.too_large("a snapshot", len)))
            }
            CallError::Timeout(timeout) => StreamingError::Timeout(Timeout {
                action: RPCTypes::InstallSnapshot,
                id: self.me,
                target: self.target,
                timeout,
            }),
            CallError::Remote(fatal) => StreamingError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.node.clone(),
                *fatal,
            )),
        }
    }
}

impl RaftNetwork<TypeConfig> for Network {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        let entries = rpc.entries.len();
        let fit = entries_within(rpc.entries.iter().map(payload_size), APPEND_BYTES);
        if fit < entries {
            debug!(
                target = self.target,
                entries, fit, "raft: AppendEntries over the byte budget; asking for fewer"
            );
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(fit as u64),
            ));
        }
        let mut frame = std::mem::take(&mut self.scratch);
        match encode_request_in(&Request::AppendEntries(rpc), &mut frame) {
            Ok(()) => {}
            Err(CallError::TooLarge(len)) => {
                let err = self.too_large(&format!("AppendEntries of {entries} entries"), len);
                warn!("raft: {err}");
                // openraft retries a PayloadTooLarge at once, with at most the hinted number of
                // entries, even when that is the same single entry again: one entry too large
                // is Unreachable, so it backs off instead of spinning.
                return Err(if entries > 1 {
                    RPCError::PayloadTooLarge(
                        PayloadTooLarge::new_entries_hint((entries / 2) as u64)
                            .with_source_error(&err),
                    )
                } else {
                    RPCError::Unreachable(Unreachable::from(err))
                });
            }
            Err(e) => return Err(self.rpc_error(e, RPCTypes::AppendEntries)),
        };
        let response = self.call(&frame, option.hard_ttl()).await;
        // Kept for the next call unless one unusually large request grew it far past the
        // byte budget of a call.
        if frame.head.capacity() <= 2 * APPEND_BYTES {
            frame.splices.clear();
            self.scratch = frame;
        }
        let result = match response {
            Ok(Response::AppendEntries(resp)) => Ok(resp),
            Ok(other) => {
                let e = self.unexpected(other);
                Err(self.rpc_error(e, RPCTypes::AppendEntries))
            }
            Err(e) => Err(self.rpc_error(e, RPCTypes::AppendEntries)),
        };
        self.outage(result.as_ref().err());
        result
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        // Never a PayloadTooLarge for a vote: openraft panics on one (a vote is tiny anyway).
        let response = match encode_request(&Request::Vote(rpc)) {
            Ok(frame) => self.call(&frame, option.hard_ttl()).await,
            Err(e) => Err(e),
        };
        match response {
            Ok(Response::Vote(resp)) => Ok(resp),
            Ok(other) => {
                let e = self.unexpected(other);
                Err(self.rpc_error(e, RPCTypes::Vote))
            }
            Err(e) => Err(self.rpc_error(e, RPCTypes::Vote)),
        }
    }

    /// Sends the snapshot's file in chunks, on a connection of its own (opened for it and
    /// closed after), within `option.hard_ttl()` (openraft's `install_snapshot_timeout`), which
    /// covers the transfer and the target's install.
    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let ttl = option.hard_ttl();
        let deadline = Instant::now() + ttl;
        let target = self.target;
        let SnapshotData { file, .. } = *snapshot.snapshot;
        let meta = snapshot.meta;
        let send = async {
            use tokio::io::AsyncReadExt;
            let size = file
                .metadata()
                .map_err(|e| {
                    CallError::Network(AnyError::error(format!("the snapshot file: {e}")))
                })?
                .len();
            let mut conn = self.open(deadline, ttl).await?;
            let begin = encode_request(&Request::SnapshotBegin { vote, meta, size })?;
            let to =
                |e: io::Error| io_error(format_args!("sending a snapshot to node {target}"), &e);
            timeout_at(deadline, async {
                send_frame(&mut conn, &begin).await.map_err(to)?;
                let mut file = tokio::fs::File::from_std(file);
                let mut sent = 0u64;
                loop {
                    let mut chunk = vec![0u8; SNAPSHOT_CHUNK];
                    let mut n = 0;
                    while n < chunk.len() {
                        let read = file.read(&mut chunk[n..]).await.map_err(|e| {
                            CallError::Network(AnyError::error(format!(
                                "reading the snapshot file: {e}"
                            )))
                        })?;
                        if read == 0 {
                            break;
                        }
                        n += read;
                    }
                    if n == 0 {
                        break;
                    }
                    chunk.truncate(n);
                    sent += n as u64;
                    let frame = encode_request(&Request::SnapshotChunk(Bytes::from(chunk)))?;
                    send_frame(&mut conn, &frame).await.map_err(to)?;
                }
                if sent != size {
                    return Err(CallError::Network(AnyError::error(format!(
                        "the snapshot file gave {sent} bytes, not {size}"
                    ))));
                }
                exchange(&mut conn, &encode_request(&Request::SnapshotEnd)?, target).await
            })
            .await
            .map_err(|_| CallError::Timeout(ttl))?
        };
        let response = tokio::select! {
            response = send => response,
            closed = cancel => return Err(StreamingError::Closed(closed)),
        };
        match response {
            Ok(Response::Snapshot(resp)) => Ok(resp),
            Ok(Response::RaftError(fatal)) => {
                Err(self.streaming_error(CallError::Remote(Box::new(fatal))))
            }
            Ok(other) => Err(
                self.streaming_error(CallError::Network(AnyError::error(format!(
                    "node {target} answered a snapshot with an unexpected {}",
                    other.name()
                )))),
            ),
            Err(e) => Err(self.streaming_error(e)),
        }
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::successors(Some(BACKOFF_FIRST), |d| {
            Some((*d * 2).min(BACKOFF_MAX))
        }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cluster::types::StoredMembership;
    use crate::cluster::types::{bytes_of, data_of};
    use crate::cluster::types::{Batch, Entry, LogId, Membership, SnapshotData, StorageError};
    use bytes::BytesMut;
    use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
    use openraft::{
        CommittedLeaderId, Config, EntryPayload, LogState, RaftLogReader, RaftSnapshotBuilder,
        ServerState, StorageIOError,
    };
    use parking_lot::Mutex;
    use std::collections::{BTreeMap, BTreeSet};
    use std::fmt::Debug;
    use std::ops::RangeBounds;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_util::codec::Decoder;

    /// The bound on every wait of these tests.
    const WAIT: Duration = Duration::from_secs(10);

    // --- A minimal in-memory log store and state machine --------------------------------------

    #[derive(Default)]
    struct LogInner {
        log: BTreeMap<u64, Entry>,
        vote: Option<Vote>,
        committed: Option<LogId>,
        purged: Option<LogId>,
        /// While set, appends are not reported flushed: their callbacks wait here (a disk
        /// whose fsync stalls).
        held: Option<Vec<LogFlushed<TypeConfig>>>,
    }

    #[derive(Clone, Default)]
    struct MemLog(Arc<Mutex<LogInner>>);

    impl MemLog {
        /// From now on, appends stay unflushed until `release_flushes`.
        fn hold_flushes(&self) {
            self.0.lock().held.get_or_insert_with(Vec::new);
        }

        /// Report every held append flushed, and flush the next ones at once again.
        fn release_flushes(&self) {
            let held = self.0.lock().held.take().unwrap_or_default();
            for callback in held {
                callback.log_io_completed(Ok(()));
            }
        }
    }

    impl RaftLogReader<TypeConfig> for MemLog {
        async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
            &mut self,
            range: RB,
        ) -> Result<Vec<Entry>, StorageError> {
            Ok(self
                .0
                .lock()
                .log
                .range(range)
                .map(|(_, e)| e.clone())
                .collect())
        }
    }

    impl RaftLogStorage<TypeConfig> for MemLog {
        type LogReader = MemLog;

        async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
            let inner = self.0.lock();
            let last = inner.log.values().next_back().map(|e| e.log_id);
            Ok(LogState {
                last_purged_log_id: inner.purged,
                last_log_id: last.or(inner.purged),
            })
        }

        async fn get_log_reader(&mut self) -> MemLog {
            self.clone()
        }

        async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
            self.0.lock().vote = Some(*vote);
            Ok(())
        }

        async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
            Ok(self.0.lock().vote)
        }

        async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
            self.0.lock().committed = committed;
            Ok(())
        }

        async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
            Ok(self.0.lock().committed)
        }

        async fn append<I>(
            &mut self,
            entries: I,
            callback: LogFlushed<TypeConfig>,
        ) -> Result<(), StorageError>
        where
            I: IntoIterator<Item = Entry> + OptionalSend,
            I::IntoIter: OptionalSend,
        {
            {
                let mut inner = self.0.lock();
                for entry in entries {
                    inner.log.insert(entry.log_id.index, entry);
                }
                if let Some(held) = inner.held.as_mut() {
                    held.push(callback);
                    return Ok(());
                }
            }
            callback.log_io_completed(Ok(()));
            Ok(())
        }

        async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
            self.0.lock().log.split_off(&log_id.index);
            Ok(())
        }

        async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
            let mut inner = self.0.lock();
            inner.log = inner.log.split_off(&(log_id.index + 1));
            inner.purged = Some(log_id);
            Ok(())
        }
    }

    /// What the test state machine holds: the tickets of the batches applied, in order.
    #[derive(Clone, Default, Serialize, Deserialize)]
    struct SmState {
        applied: Option<LogId>,
        membership: StoredMembership,
        tickets: Vec<u64>,
    }

    #[derive(Default)]
    struct SmInner {
        state: SmState,
        snapshot: Option<(SnapshotMeta, Vec<u8>)>,
        built: u64,
        installed: u64,
    }

    #[derive(Clone, Default)]
    struct MemSm(Arc<Mutex<SmInner>>);

    impl MemSm {
        fn tickets(&self) -> Vec<u64> {
            self.0.lock().state.tickets.clone()
        }

        fn installed(&self) -> u64 {
            self.0.lock().installed
        }
    }

    fn sm_error(e: &serde_json::Error) -> StorageError {
        StorageError::from(StorageIOError::read_state_machine(AnyError::new(e)))
    }

    impl RaftSnapshotBuilder<TypeConfig> for MemSm {
        async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
            let mut inner = self.0.lock();
            let data = serde_json::to_vec(&inner.state).map_err(|e| sm_error(&e))?;
            inner.built += 1;
            let meta = SnapshotMeta {
                last_log_id: inner.state.applied,
                last_membership: inner.state.membership.clone(),
                snapshot_id: format!(
                    "{}-{}",
                    inner.state.applied.map_or(0, |l| l.index),
                    inner.built
                ),
            };
            inner.snapshot = Some((meta.clone(), data.clone()));
            Ok(Snapshot {
                meta,
                snapshot: Box::new(data_of(&data)),
            })
        }
    }

    impl RaftStateMachine<TypeConfig> for MemSm {
        type SnapshotBuilder = MemSm;

        async fn applied_state(
            &mut self,
        ) -> Result<(Option<LogId>, StoredMembership), StorageError> {
            let inner = self.0.lock();
            Ok((inner.state.applied, inner.state.membership.clone()))
        }

        async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError>
        where
            I: IntoIterator<Item = Entry> + OptionalSend,
            I::IntoIter: OptionalSend,
        {
            let mut inner = self.0.lock();
            let mut applied = 0;
            for entry in entries {
                inner.state.applied = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => {}
                    EntryPayload::Normal(batch) => inner.state.tickets.push(batch.ticket),
                    EntryPayload::Membership(m) => {
                        inner.state.membership = StoredMembership::new(Some(entry.log_id), m)
                    }
                }
                applied += 1;
            }
            Ok(vec![(); applied])
        }

        async fn get_snapshot_builder(&mut self) -> MemSm {
            self.clone()
        }

        async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
            Ok(Box::new(data_of(b"")))
        }

        async fn install_snapshot(
            &mut self,
            meta: &SnapshotMeta,
            snapshot: Box<SnapshotData>,
        ) -> Result<(), StorageError> {
            let data = bytes_of(*snapshot);
            let state: SmState = serde_json::from_slice(&data).map_err(|e| sm_error(&e))?;
            let mut inner = self.0.lock();
            inner.state = state;
            inner.snapshot = Some((meta.clone(), data));
            inner.installed += 1;
            Ok(())
        }

        async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
            Ok(self
                .0
                .lock()
                .snapshot
                .as_ref()
                .map(|(meta, data)| Snapshot {
                    meta: meta.clone(),
                    snapshot: Box::new(data_of(data)),
                }))
        }
    }

    // --- Nodes --------------------------------------------------------------------------------

    struct TestNode {
        id: NodeId,
        raft: Raft,
        node: NodeInfo,
        log: MemLog,
        sm: MemSm,
        server: tokio::task::JoinHandle<()>,
    }

    impl Drop for TestNode {
        fn drop(&mut self) {
            self.server.abort();
        }
    }

    fn config() -> Arc<Config> {
        let config = Config {
            cluster_name: "test".to_owned(),
            heartbeat_interval: 50,
            election_timeout_min: 150,
            election_timeout_max: 300,
            // openraft's 200 ms default covers the whole transfer and install.
            install_snapshot_timeout: 5_000,
            max_in_snapshot_log_to_keep: 0,
            ..Default::default()
        };
        Arc::new(config.validate().unwrap())
    }

    /// A Raft node serving on a port of its own (not initialized).
    async fn start_node(id: NodeId, cluster: &str) -> TestNode {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = NodeInfo {
            raft: listener.local_addr().unwrap().to_string(),
            ..Default::default()
        };
        let sm = MemSm::default();
        let log = MemLog::default();
        let network = NetworkFactory::new(cluster, id);
        let raft = Raft::new(id, config(), network, log.clone(), sm.clone())
            .await
            .unwrap();
        let server = tokio::spawn(serve(
            listener,
            raft.clone(),
            cluster.to_owned(),
            id,
            std::env::temp_dir(),
        ));
        TestNode {
            id,
            raft,
            node,
            log,
            sm,
            server,
        }
    }

    /// Nodes 1, 2, 3, initialized (through node 1) as the voters of one cluster.
    async fn start_cluster(cluster: &str) -> Vec<TestNode> {
        let mut nodes = Vec::new();
        for id in 1..=3 {
            nodes.push(start_node(id, cluster).await);
        }
        let members: BTreeMap<NodeId, NodeInfo> =
            nodes.iter().map(|n| (n.id, n.node.clone())).collect();
        nodes[0].raft.initialize(members).await.unwrap();
        nodes
    }

    /// Waits until exactly one node is leader and every node names it: its index in `nodes`.
    async fn wait_leader(nodes: &[TestNode]) -> usize {
        let found = timeout(WAIT, async {
            loop {
                let metrics: Vec<_> = nodes
                    .iter()
                    .map(|n| n.raft.metrics().borrow().clone())
                    .collect();
                let leaders: Vec<usize> = (0..nodes.len())
                    .filter(|&i| metrics[i].state == ServerState::Leader)
                    .collect();
                if let [leader] = leaders[..] {
                    let id = nodes[leader].id;
                    if metrics.iter().all(|m| m.current_leader == Some(id)) {
                        return leader;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        found.expect("exactly one leader, named by every node, within 10 s")
    }

    fn batch(ticket: u64) -> Batch {
        Batch {
            ticket,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_elect_one_leader_and_replicate() {
        let nodes = start_cluster("t-elect").await;
        let leader = wait_leader(&nodes).await;
        let written = timeout(WAIT, nodes[leader].raft.client_write(batch(42)))
            .await
            .unwrap()
            .unwrap();
        let index = written.log_id.index;
        for n in &nodes {
            n.raft
                .wait(Some(WAIT))
                .applied_index_at_least(Some(index), "the write applied")
                .await
                .unwrap();
            assert_eq!(n.sm.tickets(), vec![42], "node {}", n.id);
        }
    }

    /// The leader hands an entry to its followers without waiting for its own log's flush
    /// (vendor/openraft/WARREN.md), so a leader whose disk stalls still commits on a majority
    /// of the others, and counts itself again once its flush is done. openraft 0.9 as
    /// published waits for the flush before replicating: this write never commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leader_replicates_before_its_own_flush() {
        let nodes = start_cluster("t-flush").await;
        let leader = wait_leader(&nodes).await;
        let raft = nodes[leader].raft.clone();
        timeout(WAIT, raft.client_write(batch(1)))
            .await
            .unwrap()
            .unwrap();
        nodes[leader].log.hold_flushes();
        let written = timeout(WAIT, raft.client_write(batch(2)))
            .await
            .expect("committed by the followers while the leader's flush is held")
            .unwrap();
        for n in &nodes {
            n.raft
                .wait(Some(WAIT))
                .applied_index_at_least(Some(written.log_id.index), "the write applied")
                .await
                .unwrap();
            assert_eq!(n.sm.tickets(), vec![1, 2], "node {}", n.id);
        }
        // Its own log does not count while unflushed: with one follower gone as well, nothing
        // commits until the flush is done.
        let follower = (0..nodes.len()).find(|&i| i != leader).unwrap();
        nodes[follower].raft.shutdown().await.unwrap();
        let pending = tokio::spawn({
            let raft = raft.clone();
            async move { raft.client_write(batch(3)).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !pending.is_finished(),
            "committed on one follower and an unflushed leader"
        );
        nodes[leader].log.release_flushes();
        timeout(WAIT, pending)
            .await
            .expect("committed once the leader's flush is done")
            .unwrap()
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_learner_catches_up_by_snapshot() {
        let mut nodes = start_cluster("t-snap").await;
        let leader = wait_leader(&nodes).await;
        let raft = nodes[leader].raft.clone();
        let mut last = None;
        for ticket in 1..=5 {
            let written = timeout(WAIT, raft.client_write(batch(ticket)))
                .await
                .unwrap()
                .unwrap();
            last = Some(written.log_id);
        }
        let last = last.unwrap();
        raft.trigger().snapshot().await.unwrap();
        raft.wait(Some(WAIT))
            .metrics(
                |m| m.snapshot.is_some_and(|s| s.index >= last.index),
                "snapshot built",
            )
            .await
            .unwrap();
        raft.trigger().purge_log(last.index).await.unwrap();
        raft.wait(Some(WAIT))
            .metrics(
                |m| m.purged.is_some_and(|p| p.index >= last.index),
                "log purged",
            )
            .await
            .unwrap();

        // The leader has none of the log the learner lacks: only a snapshot brings it up.
        let learner = start_node(4, "t-snap").await;
        timeout(WAIT, raft.add_learner(4, learner.node.clone(), true))
            .await
            .unwrap()
            .unwrap();
        learner
            .raft
            .wait(Some(WAIT))
            .applied_index_at_least(Some(last.index), "the learner caught up")
            .await
            .unwrap();
        assert!(
            learner.sm.installed() >= 1,
            "the learner installed a snapshot"
        );
        assert_eq!(learner.sm.tickets(), vec![1, 2, 3, 4, 5]);
        nodes.push(learner);
    }

    // --- Refusals -----------------------------------------------------------------------------

    /// Log output (WARN and up) of the current thread, for assertions.
    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Logs {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock()).into_owned()
        }

        #[track_caller]
        fn assert_line(&self, parts: &[&str]) {
            let text = self.text();
            assert!(
                text.lines()
                    .any(|l| l.contains("WARN") && parts.iter().all(|p| l.contains(p))),
                "no WARN line with {parts:?} in:\n{text}"
            );
        }
    }

    /// Captures this thread's logs (the tests using it run on a current-thread runtime, so the
    /// server's tasks log on this thread too).
    fn capture_logs() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(body);
        frame
    }

    fn hello_frame(hello: Hello) -> Vec<u8> {
        frame(&postcard::to_stdvec(&Request::Hello(hello)).unwrap())
    }

    /// The frames in `buf`, decoded.
    fn responses(mut buf: &[u8]) -> Vec<Response> {
        let mut out = Vec::new();
        while buf.len() >= 4 {
            let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            out.push(postcard::from_bytes(&buf[4..4 + len]).unwrap());
            buf = &buf[4 + len..];
        }
        out
    }

    /// What the server sends until it closes (a reset counts as a close: the server may close
    /// with bytes of ours unread).
    async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
        let mut buf = Vec::new();
        match timeout(WAIT, stream.read_to_end(&mut buf)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
            Err(_) => panic!("the server did not close the connection"),
        }
        buf
    }

    /// Sends `bytes` on a new connection: its local address, and what the server answered
    /// before it closed.
    async fn raw(addr: &str, bytes: &[u8]) -> (SocketAddr, Vec<Response>) {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let local = stream.local_addr().unwrap();
        stream.write_all(bytes).await.unwrap();
        let answer = read_to_close(&mut stream).await;
        (local, responses(&answer))
    }

    #[track_caller]
    fn assert_refused(answer: &[Response], want: &str) {
        match answer {
            [Response::Refused { reason }] => assert!(reason.contains(want), "{reason}"),
            other => panic!("expected a refusal for {want:?}, got {other:?}"),
        }
    }

    fn vote_request(from: NodeId) -> VoteRequest<NodeId> {
        VoteRequest::new(Vote::new(1, from), None)
    }

    #[tokio::test]
    async fn refuses_bad_handshakes_and_keeps_serving() {
        let (logs, _guard) = capture_logs();
        let server = start_node(1, "t-hello").await;
        let addr = server.node.raft.clone();

        // Garbage: an HTTP request, whose first four bytes read as a 1.2 GB length.
        let (peer, answer) = raw(&addr, b"GET / HTTP/1.1\r\nHost: warren\r\n\r\n").await;
        assert!(
            matches!(answer[..], [] | [Response::Refused { .. }]),
            "{answer:?}"
        );
        logs.assert_line(&[&peer.to_string(), "refused", "handshake frame over"]);

        // Garbage in a well-formed frame.
        let (peer, answer) = raw(&addr, &frame(&[0xff; 12])).await;
        assert_refused(&answer, "undecodable handshake");
        logs.assert_line(&[&peer.to_string(), "refused", "undecodable handshake"]);

        // A first frame that is not a Hello.
        let vote = postcard::to_stdvec(&Request::Vote(vote_request(2))).unwrap();
        let (_, answer) = raw(&addr, &frame(&vote)).await;
        assert_refused(&answer, "not a Hello");

        // Another protocol version, and a bad magic.
        let mut hello = Hello::new("t-hello", 2, 1);
        hello.version = VERSION + 1;
        let (_, answer) = raw(&addr, &hello_frame(hello)).await;
        assert_refused(&answer, &format!("version {}", VERSION + 1));
        let mut hello = Hello::new("t-hello", 2, 1);
        hello.magic = *b"AMQP";
        let (_, answer) = raw(&addr, &hello_frame(hello)).await;
        assert_refused(&answer, "magic");

        // Another cluster, another addressee.
        let (peer, answer) = raw(&addr, &hello_frame(Hello::new("other", 2, 1))).await;
        assert_refused(&answer, "cluster id \"other\"");
        logs.assert_line(&[&peer.to_string(), "refused", "cluster id \"other\""]);
        let (peer, answer) = raw(&addr, &hello_frame(Hello::new("t-hello", 2, 7))).await;
        assert_refused(&answer, "addressed to node 7");
        logs.assert_line(&[&peer.to_string(), "refused", "addressed to node 7"]);

        // The same through the client: Unreachable (openraft backs off), logged on this side.
        let mut net = NetworkFactory::new("other", 2)
            .new_client(1, &server.node)
            .await;
        let err = net
            .vote(vote_request(2), RPCOption::new(WAIT))
            .await
            .unwrap_err();
        assert!(matches!(err, RPCError::Unreachable(_)), "{err}");
        logs.assert_line(&[&addr, "node 1", "refused our connection", "cluster id"]);
        let mut net = NetworkFactory::new("t-hello", 2)
            .new_client(7, &server.node)
            .await;
        let err = net
            .vote(vote_request(2), RPCOption::new(WAIT))
            .await
            .unwrap_err();
        assert!(matches!(err, RPCError::Unreachable(_)), "{err}");
        logs.assert_line(&[
            &addr,
            "node 7",
            "refused our connection",
            "addressed to node 7",
        ]);

        // A correct client is served, twice on one connection.
        let mut net = NetworkFactory::new("t-hello", 2)
            .new_client(1, &server.node)
            .await;
        let resp = net
            .vote(vote_request(2), RPCOption::new(WAIT))
            .await
            .unwrap();
        assert!(resp.vote_granted);
        assert!(net.conn.is_some(), "the connection is kept");
        let resp = net
            .vote(vote_request(2), RPCOption::new(WAIT))
            .await
            .unwrap();
        assert!(resp.vote_granted);
    }

    /// Entries that do not follow their `prev_log_id` one index at a time, or whose log ids
    /// go back, drop the connection (logged) before openraft sees them (`out_of_order`:
    /// without it the first request, a gap after index 0, was answered `Success`). The node
    /// then takes a well-formed append.
    #[tokio::test]
    async fn entries_out_of_order_drop_the_connection_and_the_node_goes_on() {
        let (logs, _guard) = capture_logs();
        let server = start_node(1, "t-order").await;
        let entry = |term, index| Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 2), index),
            payload: EntryPayload::Blank,
        };
        let append = |prev: Option<LogId>, entries| AppendEntriesRequest {
            vote: Vote::new_committed(3, 2),
            prev_log_id: prev,
            leader_commit: None,
            entries,
        };
        let bad = [
            append(None, vec![entry(3, 0), entry(3, 2)]),
            append(None, vec![entry(3, 1)]),
            append(None, vec![entry(3, 0), entry(2, 1)]),
            append(
                Some(LogId::new(CommittedLeaderId::new(3, 2), u64::MAX)),
                vec![entry(3, 0)],
            ),
        ];
        for rpc in bad {
            let prev = rpc.prev_log_id;
            let mut net = NetworkFactory::new("t-order", 2)
                .new_client(1, &server.node)
                .await;
            let err = net
                .append_entries(rpc, RPCOption::new(WAIT))
                .await
                .unwrap_err();
            assert!(!matches!(err, RPCError::RemoteError(_)), "{err}");
            logs.assert_line(&["entries out of order after", &format!("{prev:?}")]);
        }
        let mut net = NetworkFactory::new("t-order", 2)
            .new_client(1, &server.node)
            .await;
        let resp = net
            .append_entries(
                append(None, vec![entry(3, 0), entry(3, 1)]),
                RPCOption::new(WAIT),
            )
            .await
            .unwrap();
        assert!(matches!(resp, AppendEntriesResponse::Success), "{resp:?}");
        server
            .raft
            .wait(Some(WAIT))
            .log_index_at_least(Some(1), "the well-formed entries")
            .await
            .unwrap();
    }

    #[test]
    fn an_oversized_length_is_refused_before_allocation() {
        let mut codec = codec(MAX_FRAME);
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&(MAX_FRAME as u32 + 1).to_be_bytes());
        buf.extend_from_slice(b"body");
        let err = codec.decode(&mut buf).unwrap_err();
        assert!(is_too_large(&err), "{err}");
        assert!(buf.capacity() < 1024, "capacity {}", buf.capacity());

        // And the handshake's limit is lower still.
        let mut codec = super::codec(MAX_HELLO_FRAME);
        let mut buf = BytesMut::from(&(MAX_HELLO_FRAME as u32 + 1).to_be_bytes()[..]);
        assert!(is_too_large(&codec.decode(&mut buf).unwrap_err()));
    }

    #[tokio::test]
    async fn an_oversized_frame_drops_the_connection_and_the_server_goes_on() {
        let (logs, _guard) = capture_logs();
        let server = start_node(1, "t-big").await;
        let addr = server.node.raft.clone();

        let mut stream = TcpStream::connect(&addr).await.unwrap();
        let peer = stream.local_addr().unwrap();
        stream
            .write_all(&hello_frame(Hello::new("t-big", 2, 1)))
            .await
            .unwrap();
        let mut head = [0; 4];
        timeout(WAIT, stream.read_exact(&mut head))
            .await
            .unwrap()
            .unwrap();
        let mut body = vec![0; u32::from_be_bytes(head) as usize];
        timeout(WAIT, stream.read_exact(&mut body))
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(
            postcard::from_bytes::<Response>(&body).unwrap(),
            Response::HelloOk { .. }
        ));

        // 64 MiB + 1 announced, a few bytes sent: the server closes at once.
        stream
            .write_all(&(MAX_FRAME as u32 + 1).to_be_bytes())
            .await
            .unwrap();
        stream.write_all(&[0; 64]).await.unwrap();
        assert!(read_to_close(&mut stream).await.is_empty());
        logs.assert_line(&[&peer.to_string(), "dropped", "over the 67108864 byte limit"]);

        let mut net = NetworkFactory::new("t-big", 2)
            .new_client(1, &server.node)
            .await;
        let resp = net
            .vote(vote_request(2), RPCOption::new(WAIT))
            .await
            .unwrap();
        assert!(resp.vote_granted);
    }

    // --- Client connection handling -----------------------------------------------------------

    /// A peer that accepts the handshake and then never answers; it counts its connections.
    async fn silent_peer() -> (NodeInfo, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = NodeInfo {
            raft: listener.local_addr().unwrap().to_string(),
            ..Default::default()
        };
        let conns = Arc::new(AtomicUsize::new(0));
        let counted = conns.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counted.fetch_add(1, SeqCst);
                tokio::spawn(async move {
                    let mut framed = Framed::new(stream, codec(MAX_FRAME));
                    if let Some(Ok(_hello)) = framed.next().await {
                        let _ = framed
                            .send(
                                encode(&Response::HelloOk {
                                    info: None,
                                    known: None,
                                    voters: Vec::new(),
                                    incarnation: 0,
                                    vouched: false,
                                })
                                .unwrap(),
                            )
                            .await;
                    }
                    while let Some(Ok(_)) = framed.next().await {}
                });
            }
        });
        (node, conns)
    }

    #[test]
    fn an_append_carries_at_most_its_byte_budget_of_entries_but_always_one() {
        use super::entries_within;
        let mib = 1 << 20;
        // Catch-up after an outage: 64 entries of 1 MiB become calls of 4.
        assert_eq!(entries_within(std::iter::repeat_n(mib, 64), 4 * mib), 4);
        assert_eq!(
            entries_within([mib, mib, 2 * mib, 1].into_iter(), 4 * mib),
            3
        );
        // A steady stream of small entries goes as before.
        assert_eq!(entries_within(std::iter::repeat_n(1000, 64), 4 * mib), 64);
        // One entry over the budget still goes alone (the frame limit is 64 MiB).
        assert_eq!(entries_within([9 * mib, 1].into_iter(), 4 * mib), 1);
        assert_eq!(entries_within(std::iter::empty(), 4 * mib), 0);
    }

    #[tokio::test]
    async fn a_timed_out_or_abandoned_rpc_drops_its_connection() {
        let (node, conns) = silent_peer().await;
        let mut net = NetworkFactory::new("t", 1).new_client(2, &node).await;

        // The hard TTL passes: a Timeout, and the connection is not kept.
        let short = RPCOption::new(Duration::from_millis(100));
        let err = net.vote(vote_request(1), short).await.unwrap_err();
        assert!(matches!(err, RPCError::Timeout(_)), "{err}");
        assert!(net.conn.is_none());
        assert_eq!(conns.load(SeqCst), 1);

        // The caller drops the RPC part way (openraft's own timeout does): the next RPC does not
        // read the abandoned one's response, it connects anew.
        let abandoned = timeout(
            Duration::from_millis(100),
            net.vote(vote_request(1), RPCOption::new(WAIT)),
        )
        .await;
        assert!(abandoned.is_err());
        assert!(net.conn.is_none());
        assert_eq!(conns.load(SeqCst), 2);
        let short = RPCOption::new(Duration::from_millis(100));
        assert!(net.vote(vote_request(1), short).await.is_err());
        assert_eq!(conns.load(SeqCst), 3);
    }

    #[tokio::test]
    async fn a_closed_port_is_unreachable_and_backoff_grows() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node = NodeInfo {
            raft: listener.local_addr().unwrap().to_string(),
            ..Default::default()
        };
        drop(listener);
        let mut net = NetworkFactory::new("t", 1).new_client(2, &node).await;
        let err = net
            .vote(vote_request(1), RPCOption::new(WAIT))
            .await
            .unwrap_err();
        assert!(matches!(err, RPCError::Unreachable(_)), "{err}");

        let ms: Vec<u128> = net.backoff().take(7).map(|d| d.as_millis()).collect();
        assert_eq!(ms, vec![20, 40, 80, 100, 100, 100, 100]);
    }

    // --- The messages -------------------------------------------------------------------------

    #[test]
    fn hello_check_refuses_each_mismatch() {
        let ok = Hello::new("c", 2, 1);
        assert_eq!(hello_check(&ok, "c", 1), Ok(()));
        let mut bad = ok.clone();
        bad.magic = *b"WRNX";
        assert!(hello_check(&bad, "c", 1).unwrap_err().contains("magic"));
        let mut bad = ok.clone();
        bad.version = VERSION + 1;
        let other = format!("version {}", VERSION + 1);
        assert!(hello_check(&bad, "c", 1).unwrap_err().contains(&other));
        assert!(hello_check(&ok, "d", 1).unwrap_err().contains("cluster"));
        assert!(hello_check(&ok, "c", 3).unwrap_err().contains("node 1"));
    }

    #[test]
    fn messages_round_trip_through_postcard() {
        let log_id = |index| LogId::new(CommittedLeaderId::new(3, 1), index);
        let info = NodeInfo {
            raft: "10.0.0.1:7000".to_owned(),
            amqp: "10.0.0.1:5672".to_owned(),
            http: "10.0.0.1:15672".to_owned(),
            incarnation: 7,
        };
        let membership = Membership::new(
            vec![BTreeSet::from([1, 2])],
            BTreeMap::from([(1, info.clone()), (2, info.clone()), (3, info)]),
        );
        let entries = vec![
            Entry {
                log_id: log_id(1),
                payload: EntryPayload::Blank,
            },
            Entry {
                log_id: log_id(2),
                payload: EntryPayload::Membership(membership.clone()),
            },
            Entry {
                log_id: log_id(3),
                payload: EntryPayload::Normal(Batch {
                    proposer: 9,
                    ticket: 8,
                    clock_ms: 7,
                    ops: Bytes::from_static(b"ops"),
                }),
            },
        ];
        let requests = [
            Request::Hello(Hello::new("c", 1, 2)),
            Request::AppendEntries(AppendEntriesRequest {
                vote: Vote::new_committed(3, 1),
                prev_log_id: Some(log_id(0)),
                leader_commit: Some(log_id(2)),
                entries,
            }),
            Request::Vote(VoteRequest::new(Vote::new(4, 2), Some(log_id(3)))),
            Request::SnapshotBegin {
                vote: Vote::new_committed(3, 1),
                meta: SnapshotMeta {
                    last_log_id: Some(log_id(3)),
                    last_membership: StoredMembership::new(Some(log_id(2)), membership),
                    snapshot_id: "3-1".to_owned(),
                },
                size: 8,
            },
            Request::SnapshotChunk(Bytes::from_static(b"snapshot")),
            Request::SnapshotEnd,
        ];
        for request in &requests {
            let back: Request = postcard::from_bytes(&encode(request).unwrap()).unwrap();
            assert_eq!(format!("{back:?}"), format!("{request:?}"));
        }
        let responses = [
            Response::HelloOk {
                info: None,
                known: None,
                voters: vec![(1, "127.0.0.1:1".to_owned()), (2, "127.0.0.1:2".to_owned())],
                incarnation: 9,
                vouched: true,
            },
            Response::Refused {
                reason: "no".to_owned(),
            },
            Response::AppendEntries(AppendEntriesResponse::Success),
            Response::AppendEntries(AppendEntriesResponse::PartialSuccess(Some(log_id(2)))),
            Response::AppendEntries(AppendEntriesResponse::Conflict),
            Response::AppendEntries(AppendEntriesResponse::HigherVote(Vote::new(5, 3))),
            Response::Vote(VoteResponse::new(Vote::new(4, 2), Some(log_id(3)), true)),
            Response::Snapshot(SnapshotResponse::new(Vote::new_committed(3, 1))),
            Response::RaftError(Fatal::Stopped),
            Response::RaftError(Fatal::Panicked),
        ];
        for response in &responses {
            let back: Response = postcard::from_bytes(&encode(response).unwrap()).unwrap();
            assert_eq!(format!("{back:?}"), format!("{response:?}"));
        }
        // A storage error travels as its text.
        let disk_full = Response::RaftError(Fatal::StorageError(StorageError::from(
            StorageIOError::write_logs(AnyError::error("disk full")),
        )));
        let back: Response = postcard::from_bytes(&encode(&disk_full).unwrap()).unwrap();
        let Response::RaftError(Fatal::StorageError(e)) = back else {
            panic!("{back:?}")
        };
        assert!(
            e.to_string()
                .contains("on the peer: when Write Logs: disk full"),
            "{e}"
        );
    }

    /// openraft's encoding of a storage error nests `AnyError` sources to any depth, and
    /// postcard decodes nesting by recursion: a peer's answer of a few MB of nested sources
    /// overflowed the stack of the task decoding it, which aborts the process (this test
    /// binary, with the nested form). The flat form has no nesting to follow.
    #[test]
    fn a_raft_error_nested_a_million_deep_does_not_overflow_the_stack() {
        let head = encode(&Response::RaftError(Fatal::Stopped)).unwrap()[0];
        // StorageError::IO, subject Store, verb Write, then AnyError { typ: None, msg: "",
        // source: Some(.. the same ..) }.
        let mut frame = vec![head, 0, 1, 0, 1];
        for _ in 0..1_000_000 {
            frame.extend_from_slice(&[0, 0, 1]);
        }
        // Decoded on a thread with a small stack, as a tokio worker's is bounded too.
        let decoded = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || postcard::from_bytes::<Response>(&frame).map(|r| r.name()))
            .unwrap()
            .join()
            .unwrap();
        // Whatever it decodes to (the flat form reads a kind and a text), it returns.
        let _ = decoded;
    }

    /// A frame's large byte strings are spliced in, not copied, and the bytes that reach the
    /// peer are exactly the request's postcard encoding behind its length.
    #[tokio::test]
    async fn a_frame_splices_large_ops_and_sends_the_plain_encoding() {
        let log_id = |index| LogId::new(CommittedLeaderId::new(3, 1), index);
        let batch = |ops: Bytes| Batch {
            proposer: 9,
            ticket: 8,
            clock_ms: 7,
            ops,
        };
        let big = Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let other = Bytes::from(vec![5u8; 4096]);
        let entries = vec![
            Entry {
                log_id: log_id(1),
                payload: EntryPayload::Normal(batch(big.slice(10..200_000))),
            },
            Entry {
                log_id: log_id(2),
                payload: EntryPayload::Blank,
            },
            Entry {
                log_id: log_id(3),
                payload: EntryPayload::Normal(batch(Bytes::from_static(b"small"))),
            },
            Entry {
                log_id: log_id(4),
                payload: EntryPayload::Normal(batch(other.clone())),
            },
        ];
        let request = Request::AppendEntries(AppendEntriesRequest {
            vote: Vote::new_committed(3, 1),
            prev_log_id: Some(log_id(0)),
            leader_commit: Some(log_id(2)),
            entries,
        });
        let plain = encode(&request).unwrap();
        // A reused frame (as a peer's scratch is) holds nothing of the one before.
        let mut frame = encode_request(&Request::SnapshotChunk(big.clone())).unwrap();
        assert_eq!(frame.splices.len(), 1);
        encode_request_in(&request, &mut frame).unwrap();
        let spliced: Vec<usize> = frame.splices.iter().map(|(_, b)| b.len()).collect();
        assert_eq!(spliced, vec![199_990, 4096]);
        assert!(frame.splices[1].1.as_ptr() == other.as_ptr());
        assert!(frame.head.len() < 1024, "{} bytes copied", frame.head.len());
        let whole = frame.to_vec();
        assert_eq!(whole[..LENGTH_BYTES], (plain.len() as u32).to_be_bytes());
        assert_eq!(whole[LENGTH_BYTES..], plain[..]);

        // Through a socket: the peer's codec reads it as one frame, which decodes.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut framed = Framed::new(stream, codec(MAX_FRAME));
            let first = framed.next().await.unwrap().unwrap();
            let second = framed.next().await.unwrap().unwrap();
            (first.freeze(), second.freeze())
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        let mut conn = Framed::new(stream, codec(MAX_FRAME));
        send_frame(&mut conn, &frame).await.unwrap();
        let chunk = encode_request(&Request::SnapshotChunk(big.clone())).unwrap();
        send_frame(&mut conn, &chunk).await.unwrap();
        let (first, second) = timeout(WAIT, reader).await.unwrap().unwrap();
        assert_eq!(first, plain);
        let back: Request = postcard::from_bytes(&first).unwrap();
        assert_eq!(format!("{back:?}"), format!("{request:?}"));
        match postcard::from_bytes::<Request>(&second).unwrap() {
            Request::SnapshotChunk(b) => assert_eq!(b, big),
            other => panic!("{other:?}"),
        }
    }

    proptest::proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = decode_hello(&bytes);
            let _ = postcard::from_bytes::<Request>(&bytes);
            let _ = postcard::from_bytes::<Response>(&bytes);
        }
    }
}

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
//! timeout around most RPCs) drops it and the next RPC connects again. A snapshot travels whole,
//! in one `Snapshot` request, on a connection of its own so heartbeats are not held behind it.
//! The server is [`serve`].

use std::future::Future;
use std::io::{self, Cursor};
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
use tracing::{debug, warn};

use super::types::{NodeId, NodeInfo, Raft, Snapshot, SnapshotMeta, TypeConfig, Vote};

/// The first four bytes of every `Hello`.
pub const MAGIC: [u8; 4] = *b"WRNR";
/// The protocol version this node speaks (and the only one it accepts).
pub const VERSION: u16 = 1;
/// The longest frame body sent or accepted: 64 MiB.
pub const MAX_FRAME: usize = 64 << 20;
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
/// The backoff openraft applies after an `Unreachable`: 20 ms, doubling up to 500 ms.
const BACKOFF_FIRST: Duration = Duration::from_millis(20);
const BACKOFF_MAX: Duration = Duration::from_millis(500);

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
    Snapshot {
        vote: Vote,
        meta: SnapshotMeta,
        data: Vec<u8>,
    },
}

/// What a server answers.
#[derive(Debug, Serialize, Deserialize)]
enum Response {
    HelloOk,
    Refused {
        reason: String,
    },
    AppendEntries(AppendEntriesResponse<NodeId>),
    Vote(VoteResponse<NodeId>),
    Snapshot(SnapshotResponse<NodeId>),
    /// The target's Raft failed the request. `Raft::append_entries` and `Raft::vote` fail with a
    /// `RaftError<NodeId>`, whose only possible case is `Fatal`, and `install_full_snapshot`
    /// with a `Fatal`: the `Fatal` is what travels.
    RaftError(Fatal<NodeId>),
}

impl Response {
    fn name(&self) -> &'static str {
        match self {
            Response::HelloOk => "HelloOk",
            Response::Refused { .. } => "Refused",
            Response::AppendEntries(_) => "AppendEntries",
            Response::Vote(_) => "Vote",
            Response::Snapshot(_) => "Snapshot",
            Response::RaftError(_) => "RaftError",
        }
    }
}

type Conn = Framed<TcpStream, LengthDelimitedCodec>;

fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
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
pub async fn serve(listener: TcpListener, raft: Raft, cluster: String, me: NodeId) {
    let cluster: Arc<str> = cluster.into();
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    conns.spawn(serve_conn(stream, peer, raft.clone(), cluster.clone(), me));
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
) {
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
    let ok = match encode(&Response::HelloOk) {
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
            // The frame is freed once decoded, before the (possibly long) call into Raft.
            Ok(Some(Ok(frame))) => match postcard::from_bytes::<Request>(&frame) {
                Ok(request) => request,
                Err(e) => {
                    warn!(%peer, "raft: dropped the connection of node {from} at {peer}: undecodable request of {} bytes ({e})", frame.len());
                    return;
                }
            },
        };
        let response = match request {
            Request::Hello(_) => {
                warn!(%peer, "raft: dropped the connection of node {from} at {peer}: a second Hello");
                return;
            }
            Request::AppendEntries(rpc) => match raft.append_entries(rpc).await {
                Ok(resp) => Response::AppendEntries(resp),
                Err(e) => Response::RaftError(fatal_of(e)),
            },
            Request::Vote(rpc) => match raft.vote(rpc).await {
                Ok(resp) => Response::Vote(resp),
                Err(e) => Response::RaftError(fatal_of(e)),
            },
            Request::Snapshot { vote, meta, data } => {
                let snapshot = Snapshot {
                    meta,
                    snapshot: Box::new(Cursor::new(data)),
                };
                match raft.install_full_snapshot(vote, snapshot).await {
                    Ok(resp) => Response::Snapshot(resp),
                    Err(fatal) => Response::RaftError(fatal),
                }
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

// ---------------------------------------------------------------------------------------------
// Client

/// Makes the [`Network`] to each peer of node `me` of cluster `cluster`.
#[derive(Debug, Clone)]
pub struct NetworkFactory {
    cluster: String,
    me: NodeId,
}

impl NetworkFactory {
    pub fn new(cluster: impl Into<String>, me: NodeId) -> NetworkFactory {
        NetworkFactory {
            cluster: cluster.into(),
            me,
        }
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
    Remote(Fatal<NodeId>),
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

fn encode_request(request: &Request) -> Result<Bytes, CallError> {
    let frame =
        encode(request).map_err(|e| CallError::Network(AnyError::error(format!("encode: {e}"))))?;
    if frame.len() > MAX_FRAME {
        return Err(CallError::TooLarge(frame.len()));
    }
    Ok(frame)
}

/// Connects to `addr` and says `hello`; a refusal is logged here (with the peer's reason).
async fn connect(addr: &str, hello: &Hello) -> Result<Conn, CallError> {
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
    conn.send(frame)
        .await
        .map_err(|e| unreachable(format!("handshake with node {target} at {addr}: {e}")))?;
    let reason = match conn.next().await {
        Some(Ok(frame)) => match postcard::from_bytes::<Response>(&frame) {
            Ok(Response::HelloOk) => return Ok(conn),
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
async fn exchange(conn: &mut Conn, frame: Bytes, target: NodeId) -> Result<Response, CallError> {
    conn.send(frame)
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
            Ok(conn) => conn,
            Err(_) => Err(CallError::Unreachable(AnyError::error(format!(
                "no connection to node {} at {} within {ttl:?}",
                self.target, self.node.raft
            )))),
        }
    }

    /// One request and its response on the cached connection (opened if there is none), all
    /// within `ttl`.
    async fn call(&mut self, frame: Bytes, ttl: Duration) -> Result<Response, CallError> {
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
            Response::RaftError(fatal) => CallError::Remote(fatal),
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
                RaftError::Fatal(fatal),
            )),
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
                fatal,
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
        let frame = match encode_request(&Request::AppendEntries(rpc)) {
            Ok(frame) => frame,
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
        match self.call(frame, option.hard_ttl()).await {
            Ok(Response::AppendEntries(resp)) => Ok(resp),
            Ok(other) => {
                let e = self.unexpected(other);
                Err(self.rpc_error(e, RPCTypes::AppendEntries))
            }
            Err(e) => Err(self.rpc_error(e, RPCTypes::AppendEntries)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        // Never a PayloadTooLarge for a vote: openraft panics on one (a vote is tiny anyway).
        let response = match encode_request(&Request::Vote(rpc)) {
            Ok(frame) => self.call(frame, option.hard_ttl()).await,
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

    /// Sends the whole snapshot in one request, on a connection of its own (opened for it and
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
        let request = Request::Snapshot {
            vote,
            meta: snapshot.meta,
            data: snapshot.snapshot.into_inner(),
        };
        let frame = encode_request(&request).map_err(|e| self.streaming_error(e))?;
        drop(request);
        let target = self.target;
        let send = async {
            let mut conn = self.open(deadline, ttl).await?;
            timeout_at(deadline, exchange(&mut conn, frame, target))
                .await
                .map_err(|_| CallError::Timeout(ttl))?
        };
        let response = tokio::select! {
            response = send => response,
            closed = cancel => return Err(StreamingError::Closed(closed)),
        };
        match response {
            Ok(Response::Snapshot(resp)) => Ok(resp),
            Ok(Response::RaftError(fatal)) => Err(self.streaming_error(CallError::Remote(fatal))),
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

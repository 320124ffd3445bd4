//! The management HTTP API: the part of RabbitMQ's (`rabbitmq_management`, port 15672) that
//! tools and client test suites use to look at a broker and to close connections. Paths, JSON
//! field names and status codes follow RabbitMQ's; see the README for the endpoints served.
//!
//! Users log in with HTTP basic auth, with the same users (and loopback rule for `guest`) as
//! AMQP. Every user is an administrator until users get tags and permissions.

use crate::broker::{ConnId, ExchangeView, QueueView};
use crate::server::Shared;
use amq_protocol::types::{AMQPValue, FieldTable};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use base64::Engine;
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::Notify;

/// One client connection, from its protocol header to its end: what the API shows of it, and
/// the way to close it from outside.
#[derive(Debug)]
pub struct ConnInfo {
    /// RabbitMQ's connection name: "peer-ip:port -> local-ip:port".
    pub name: String,
    pub peer: SocketAddr,
    pub local: SocketAddr,
    /// Milliseconds since the Unix epoch.
    pub connected_at: u64,
    pub details: Mutex<ConnDetails>,
    close_reason: Mutex<Option<String>>,
    /// Woken when the connection is to be closed (`close`).
    pub close_requested: Notify,
}

/// What the handshake told us, filled in as it goes.
#[derive(Debug, Default)]
pub struct ConnDetails {
    /// starting, tuning, opening, running, closing.
    pub state: &'static str,
    pub user: String,
    pub vhost: String,
    pub auth_mechanism: String,
    pub client_properties: FieldTable,
    pub channel_max: u16,
    pub frame_max: u32,
    pub heartbeat: u16,
    /// The broker core's id, once open.
    pub conn: ConnId,
}

impl ConnInfo {
    pub fn new(peer: SocketAddr, local: SocketAddr) -> Self {
        let addr = |a: SocketAddr| format!("{}:{}", a.ip().to_canonical(), a.port());
        let connected_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        ConnInfo {
            name: format!("{} -> {}", addr(peer), addr(local)),
            peer,
            local,
            connected_at,
            details: Mutex::new(ConnDetails {
                state: "starting",
                ..Default::default()
            }),
            close_reason: Mutex::new(None),
            close_requested: Notify::new(),
        }
    }

    /// Ask the connection to close with 320 CONNECTION_FORCED and `reason`.
    pub fn close(&self, reason: String) {
        *self.close_reason.lock() = Some(reason);
        self.close_requested.notify_one();
    }

    /// The reason given to `close`, once.
    pub fn take_close_reason(&self) -> Option<String> {
        self.close_reason.lock().take()
    }
}

/// Serve the API on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    let app = router(shared);
    if let Err(e) = axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    {
        tracing::warn!(error = %e, "management API stopped");
    }
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/whoami", get(whoami))
        .route("/api/vhosts", get(vhosts))
        .route("/api/vhosts/{vhost}", get(vhost))
        .route("/api/connections", get(connections))
        .route(
            "/api/connections/{name}",
            get(connection).delete(close_connection),
        )
        .route("/api/queues", get(queues_all))
        .route("/api/queues/{vhost}", get(queues_in))
        .route("/api/queues/{vhost}/{name}", get(queue))
        .route("/api/exchanges", get(exchanges_all))
        .route("/api/exchanges/{vhost}", get(exchanges_in))
        .route("/api/exchanges/{vhost}/{name}", get(exchange))
        .fallback(|| async { not_found() })
        .with_state(shared)
}

type Api = State<Arc<Shared>>;
type Peer = ConnectInfo<SocketAddr>;

/// The logged-in user, if the request's basic credentials are a user's allowed from `peer`.
fn authenticate(shared: &Shared, headers: &HeaderMap, peer: SocketAddr) -> Option<String> {
    let credentials = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|raw| String::from_utf8(raw).ok())?;
    let (user, pass) = credentials.split_once(':')?;
    crate::handlers::connection::login_allowed(&shared.config, user, pass, peer.ip())
        .then(|| user.to_string())
}

fn unauthorized() -> Response {
    let mut r = (
        StatusCode::UNAUTHORIZED,
        Json(json!({"error": "not_authorized", "reason": "Login failed"})),
    )
        .into_response();
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"RabbitMQ Management\""),
    );
    r
}

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": "Object Not Found", "reason": "Not Found"})),
    )
        .into_response()
}

/// Run `f` for an authenticated request.
fn authed(
    shared: &Shared,
    headers: &HeaderMap,
    peer: SocketAddr,
    f: impl FnOnce(String) -> Response,
) -> Response {
    match authenticate(shared, headers, peer) {
        Some(user) => f(user),
        None => unauthorized(),
    }
}

fn node_name() -> String {
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    format!("warren@{host}")
}

async fn overview(State(shared): Api, ConnectInfo(peer): Peer, headers: HeaderMap) -> Response {
    authed(&shared, &headers, peer, |_| {
        let (queues, exchanges, (connections, channels)) = {
            let b = shared.broker.lock();
            (
                b.queue_views(None),
                b.exchange_views(None),
                b.connection_totals(),
            )
        };
        let ready: u64 = queues.iter().map(|q| q.messages_ready).sum();
        let unacked: u64 = queues.iter().map(|q| q.messages_unacknowledged).sum();
        let consumers: usize = queues.iter().map(|q| q.consumers).sum();
        let node = node_name();
        let listen = shared.config.amqp_listen;
        Json(json!({
            "management_version": "3.10.8",
            "rabbitmq_version": "3.10.8",
            "product_name": "Warren",
            "product_version": env!("CARGO_PKG_VERSION"),
            "cluster_name": node,
            "node": node,
            "object_totals": {
                "connections": connections,
                "channels": channels,
                "exchanges": exchanges.len(),
                "queues": queues.len(),
                "consumers": consumers,
            },
            "queue_totals": {
                "messages": ready + unacked,
                "messages_ready": ready,
                "messages_unacknowledged": unacked,
            },
            "listeners": [{
                "node": node,
                "protocol": "amqp",
                "ip_address": listen.ip().to_string(),
                "port": listen.port(),
            }],
        }))
        .into_response()
    })
}

async fn whoami(State(shared): Api, ConnectInfo(peer): Peer, headers: HeaderMap) -> Response {
    authed(&shared, &headers, peer, |user| {
        Json(json!({"name": user, "tags": ["administrator"]})).into_response()
    })
}

fn vhost_json(name: &str) -> Value {
    json!({"name": name, "description": "", "tags": [], "tracing": false})
}

async fn vhosts(State(shared): Api, ConnectInfo(peer): Peer, headers: HeaderMap) -> Response {
    authed(&shared, &headers, peer, |_| {
        let names = shared.broker.lock().vhost_names();
        Json(Value::Array(names.iter().map(|n| vhost_json(n)).collect())).into_response()
    })
}

async fn vhost(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        if shared.broker.lock().has_vhost(&name) {
            Json(vhost_json(&name)).into_response()
        } else {
            not_found()
        }
    })
}

fn connection_json(shared: &Shared, c: &ConnInfo) -> Value {
    let d = c.details.lock();
    let channels = if d.conn != 0 {
        shared.broker.lock().connection_channels(d.conn)
    } else {
        0
    };
    let props = table_json(&d.client_properties);
    let user_provided_name = props.get("connection_name").cloned();
    let mut v = json!({
        "name": c.name,
        "node": node_name(),
        "type": "network",
        "state": d.state,
        "protocol": "AMQP 0-9-1",
        "user": d.user,
        "vhost": d.vhost,
        "auth_mechanism": d.auth_mechanism,
        "host": c.local.ip().to_canonical().to_string(),
        "port": c.local.port(),
        "peer_host": c.peer.ip().to_canonical().to_string(),
        "peer_port": c.peer.port(),
        "ssl": false,
        "channels": channels,
        "channel_max": d.channel_max,
        "frame_max": d.frame_max,
        "timeout": d.heartbeat,
        "connected_at": c.connected_at,
        "client_properties": props,
    });
    if let Some(n) = user_provided_name {
        v["user_provided_name"] = n;
    }
    v
}

async fn connections(State(shared): Api, ConnectInfo(peer): Peer, headers: HeaderMap) -> Response {
    authed(&shared, &headers, peer, |_| {
        let list: Vec<Arc<ConnInfo>> = shared.connections.read().values().cloned().collect();
        let out: Vec<Value> = list.iter().map(|c| connection_json(&shared, c)).collect();
        Json(Value::Array(out)).into_response()
    })
}

async fn connection(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        let found = shared.connections.read().get(&name).cloned();
        match found {
            Some(c) => Json(connection_json(&shared, &c)).into_response(),
            None => not_found(),
        }
    })
}

/// DELETE /api/connections/{name}: the client gets connection.close 320 with the `X-Reason`
/// header's text ("Closed via management plugin" without one), as from RabbitMQ.
async fn close_connection(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        let found = shared.connections.read().get(&name).cloned();
        let Some(c) = found else {
            return not_found();
        };
        let reason = headers
            .get("x-reason")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("Closed via management plugin")
            .to_string();
        c.close(reason);
        StatusCode::NO_CONTENT.into_response()
    })
}

fn queue_json(node: &str, q: &QueueView) -> Value {
    json!({
        "name": q.name,
        "vhost": q.vhost,
        "durable": q.durable,
        "exclusive": q.exclusive,
        "auto_delete": q.auto_delete,
        "arguments": table_json(&q.arguments),
        "type": if q.quorum { "quorum" } else { "classic" },
        "node": node,
        "state": "running",
        "messages": q.messages_ready + q.messages_unacknowledged,
        "messages_ready": q.messages_ready,
        "messages_unacknowledged": q.messages_unacknowledged,
        "consumers": q.consumers,
    })
}

fn queue_list(shared: &Shared, vhost: Option<&str>) -> Response {
    let node = node_name();
    let list = shared.broker.lock().queue_views(vhost);
    Json(Value::Array(
        list.iter().map(|q| queue_json(&node, q)).collect(),
    ))
    .into_response()
}

async fn queues_all(State(shared): Api, ConnectInfo(peer): Peer, headers: HeaderMap) -> Response {
    authed(&shared, &headers, peer, |_| queue_list(&shared, None))
}

async fn queues_in(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(vhost): Path<String>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        if !shared.broker.lock().has_vhost(&vhost) {
            return not_found();
        }
        queue_list(&shared, Some(&vhost))
    })
}

async fn queue(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        let list = shared.broker.lock().queue_views(Some(&vhost));
        match list.iter().find(|q| q.name == name) {
            Some(q) => Json(queue_json(&node_name(), q)).into_response(),
            None => not_found(),
        }
    })
}

fn exchange_json(x: &ExchangeView) -> Value {
    json!({
        "name": x.name,
        "vhost": x.vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table_json(&x.arguments),
    })
}

fn exchange_list(shared: &Shared, vhost: Option<&str>) -> Response {
    let list = shared.broker.lock().exchange_views(vhost);
    Json(Value::Array(list.iter().map(exchange_json).collect())).into_response()
}

async fn exchanges_all(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> Response {
    authed(&shared, &headers, peer, |_| exchange_list(&shared, None))
}

async fn exchanges_in(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(vhost): Path<String>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        if !shared.broker.lock().has_vhost(&vhost) {
            return not_found();
        }
        exchange_list(&shared, Some(&vhost))
    })
}

async fn exchange(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    authed(&shared, &headers, peer, |_| {
        let list = shared.broker.lock().exchange_views(Some(&vhost));
        match list.iter().find(|x| x.name == name) {
            Some(x) => Json(exchange_json(x)).into_response(),
            None => not_found(),
        }
    })
}

/// A field table as RabbitMQ's API renders it: a JSON object of plain values.
fn table_json(t: &FieldTable) -> Map<String, Value> {
    t.inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), value_json(v)))
        .collect()
}

fn value_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(i) => json!(i),
        AMQPValue::ShortShortUInt(i) => json!(i),
        AMQPValue::ShortInt(i) => json!(i),
        AMQPValue::ShortUInt(i) => json!(i),
        AMQPValue::LongInt(i) => json!(i),
        AMQPValue::LongUInt(i) => json!(i),
        AMQPValue::LongLongInt(i) => json!(i),
        AMQPValue::Float(f) => json!(f),
        AMQPValue::Double(f) => json!(f),
        AMQPValue::DecimalValue(d) => json!(d.value as f64 / 10f64.powi(d.scale as i32)),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => json!(String::from_utf8_lossy(b.as_slice())),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::Timestamp(t) => json!(t),
        AMQPValue::FieldTable(t) => Value::Object(table_json(t)),
        AMQPValue::Void => Value::Null,
    }
}

//! The management HTTP API: the part of RabbitMQ's (`rabbitmq_management`, port 15672) that
//! tools and client test suites use to look at a broker and to close connections. Paths, JSON
//! field names and status codes follow RabbitMQ's; see the README for the endpoints served.
//!
//! Users log in with HTTP basic auth, with the same users (and loopback rule for `guest`) as
//! AMQP. Every user is an administrator until users get tags and permissions.

use crate::broker::{
    BindingView, Broker, ConnId, Effect, ExchangeDeclare, ExchangeView, QueueDeclare, QueueView,
};
use crate::server::Shared;
use amq_protocol::types::{AMQPValue, FieldTable};
use axum::extract::Query;
use axum::extract::{ConnectInfo, Extension, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use base64::Engine;
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::Notify;
use warren_protocol::reply::{AmqpError, ReplyCode};

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
    // RabbitMQ answers every path with a trailing slash as without (`GET /api/connections/`;
    // some clients list connections that way): the slash goes before routing.
    let app = tower::ServiceBuilder::new()
        .map_request(trim_one_trailing_slash)
        .service(router(shared));
    if let Err(e) =
        axum::serve(
            listener,
            axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
                SocketAddr,
            >(app),
        )
        .await
    {
        tracing::warn!(error = %e, "management API stopped");
    }
}

/// Drop one trailing slash from the path, as RabbitMQ's routes take one: `/api/queues/` is
/// `/api/queues`, but `/api/overview//` keeps an empty segment and is not found (as there).
fn trim_one_trailing_slash(mut req: axum::extract::Request) -> axum::extract::Request {
    let uri = req.uri();
    let path = uri.path();
    if path.len() > 1 && path.ends_with('/') {
        let trimmed = &path[..path.len() - 1];
        let rebuilt = match uri.query() {
            Some(q) => format!("{trimmed}?{q}"),
            None => trimmed.to_string(),
        };
        if let Ok(pq) = rebuilt.parse::<axum::http::uri::PathAndQuery>() {
            let mut parts = uri.clone().into_parts();
            parts.path_and_query = Some(pq);
            if let Ok(new) = axum::http::Uri::from_parts(parts) {
                *req.uri_mut() = new;
            }
        }
    }
    req
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
        .route(
            "/api/queues/{vhost}/{name}",
            get(queue).put(put_queue).delete(delete_queue),
        )
        .route("/api/queues/{vhost}/{name}/contents", delete(purge_queue))
        .route("/api/queues/{vhost}/{name}/bindings", get(queue_bindings))
        .route("/api/bindings", get(bindings_all))
        .route("/api/bindings/{vhost}", get(bindings_in))
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}",
            get(bindings_between).post(add_binding),
        )
        .route(
            "/api/bindings/{vhost}/e/{source}/{kind}/{destination}/{props}",
            get(binding_one).delete(delete_binding),
        )
        .route("/api/exchanges", get(exchanges_all))
        .route("/api/exchanges/{vhost}", get(exchanges_in))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(exchange).put(put_exchange).delete(delete_exchange),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            require_login,
        ))
        .fallback(|| async { not_found() })
        // A defect in a handler answers 500 and leaves the server serving (without this the
        // client got an empty reply).
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
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
    crate::handlers::connection::login_allowed(shared, user, pass, peer.ip())
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

/// An authenticated listing of one vhost's objects (404 for a vhost that does not exist).
fn in_vhost(
    shared: &Shared,
    vhost: &str,
    list: impl FnOnce(&Shared, Option<&str>) -> Response,
) -> Response {
    if !shared.broker.lock().has_vhost(vhost) {
        return not_found();
    }
    list(shared, Some(vhost))
}

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": "Object Not Found", "reason": "Not Found"})),
    )
        .into_response()
}

/// The user a request logged in as (set by `require_login`).
#[derive(Clone)]
struct Login(String);

/// Every API route wants a login: 401 without one, else the handler runs with its `Login`.
async fn require_login(
    State(shared): Api,
    ConnectInfo(peer): Peer,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authenticate(&shared, req.headers(), peer) {
        Some(user) => {
            req.extensions_mut().insert(Login(user));
            next.run(req).await
        }
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

async fn overview(State(shared): Api) -> Response {
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
}

async fn whoami(Extension(Login(user)): Extension<Login>) -> Response {
    Json(json!({"name": user, "tags": ["administrator"]})).into_response()
}

fn vhost_json(name: &str) -> Value {
    json!({"name": name, "description": "", "tags": [], "tracing": false})
}

async fn vhosts(State(shared): Api) -> Response {
    let names = shared.broker.lock().vhost_names();
    Json(Value::Array(names.iter().map(|n| vhost_json(n)).collect())).into_response()
}

async fn vhost(State(shared): Api, Path(name): Path<String>) -> Response {
    if shared.broker.lock().has_vhost(&name) {
        Json(vhost_json(&name)).into_response()
    } else {
        not_found()
    }
}

fn connection_json(shared: &Shared, c: &ConnInfo) -> Value {
    // The broker lock is not taken with the details' lock held (no lock nests in another here).
    let conn = c.details.lock().conn;
    let channels = if conn != 0 {
        shared.broker.lock().connection_channels(conn)
    } else {
        0
    };
    let d = c.details.lock();
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

async fn connections(State(shared): Api) -> Response {
    let list: Vec<Arc<ConnInfo>> = shared.connections.read().values().cloned().collect();
    let out: Vec<Value> = list.iter().map(|c| connection_json(&shared, c)).collect();
    Json(Value::Array(out)).into_response()
}

async fn connection(State(shared): Api, Path(name): Path<String>) -> Response {
    let found = shared.connections.read().get(&name).cloned();
    match found {
        Some(c) => Json(connection_json(&shared, &c)).into_response(),
        None => not_found(),
    }
}

/// DELETE /api/connections/{name}: the client gets connection.close 320 with the `X-Reason`
/// header's text ("Closed via management plugin" without one), as from RabbitMQ.
async fn close_connection(
    State(shared): Api,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
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

async fn queues_all(State(shared): Api) -> Response {
    queue_list(&shared, None)
}

async fn queues_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, queue_list)
}

async fn queue(State(shared): Api, Path((vhost, name)): Path<(String, String)>) -> Response {
    let list = shared.broker.lock().queue_views(Some(&vhost));
    match list.iter().find(|q| q.name == name) {
        Some(q) => Json(queue_json(&node_name(), q)).into_response(),
        None => not_found(),
    }
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

async fn exchanges_all(State(shared): Api) -> Response {
    exchange_list(&shared, None)
}

async fn exchanges_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, exchange_list)
}

async fn exchange(State(shared): Api, Path((vhost, name)): Path<(String, String)>) -> Response {
    let list = shared.broker.lock().exchange_views(Some(&vhost));
    match list.iter().find(|x| x.name == name) {
        Some(x) => Json(exchange_json(x)).into_response(),
        None => not_found(),
    }
}

/// Run `f` on the broker core as a connection-less administrator, carry out its effects, and
/// wait until the durable changes it made are in the store (as AMQP's declare-ok does).
async fn change<R>(
    shared: &Arc<Shared>,
    f: impl FnOnce(&mut Broker, &mut Vec<Effect>) -> Result<R, AmqpError>,
) -> Result<R, ChangeError> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let (result, ticket) = {
        let mut b = shared.lock_notify(Some(tx));
        b.set_clock(crate::conn::session::now_ms());
        let mut fx = Vec::new();
        let result = f(&mut b, &mut fx);
        shared.apply_effects(&mut fx);
        let ticket = b.flush();
        (result, ticket)
    };
    let result = result.map_err(ChangeError::Refused)?;
    if let Some(ticket) = ticket {
        while let Some(done) = rx.recv().await {
            if done.ticket >= ticket {
                if !done.ok {
                    return Err(ChangeError::Store);
                }
                break;
            }
        }
    }
    Ok(result)
}

/// 204 for a change made, else why not.
fn no_content<R>(result: Result<R, ChangeError>) -> Response {
    match result {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Why a change through the API did not happen.
enum ChangeError {
    Refused(AmqpError),
    Store,
}

impl IntoResponse for ChangeError {
    fn into_response(self) -> Response {
        match self {
            ChangeError::Refused(e) => amqp_error_response(&e),
            ChangeError::Store => (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": "internal_error", "reason": "the store failed"})),
            )
                .into_response(),
        }
    }
}

/// An AMQP refusal as the API's error: 404 for what does not exist, 403 for what is not
/// allowed, 405 for a resource another connection holds, 400 for the rest.
fn amqp_error_response(e: &AmqpError) -> Response {
    let (status, error) = match e.code {
        ReplyCode::NotFound => (StatusCode::NOT_FOUND, "Object Not Found"),
        // RabbitMQ answers a refused name (amq.*) as a failed login.
        ReplyCode::AccessRefused => {
            return (
                StatusCode::UNAUTHORIZED,
                Json(json!({"error": "not_authorised", "reason": "Access refused."})),
            )
                .into_response()
        }
        ReplyCode::ResourceLocked => (StatusCode::METHOD_NOT_ALLOWED, "resource_locked"),
        _ => (StatusCode::BAD_REQUEST, "bad_request"),
    };
    // The reason without the reply code's name ("PRECONDITION_FAILED - "), as RabbitMQ's.
    let reason = match e.text.split_once(" - ") {
        Some((name, rest)) if name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') => rest,
        _ => e.text.as_str(),
    };
    (status, Json(json!({"error": error, "reason": reason}))).into_response()
}

fn bad_request(reason: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": "bad_request", "reason": reason})),
    )
        .into_response()
}

/// The JSON body of a PUT: an object (an empty body is an empty object).
fn body_object(body: &axum::body::Bytes) -> Result<Map<String, Value>, String> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("not a JSON object".into()),
        Err(_) => Err("not_json".into()),
    }
}

fn flag(m: &Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" || s == "false" => Ok(s == "true"),
        Some(_) => Err(format!("{key} must be true or false")),
    }
}

fn arguments(m: &Map<String, Value>) -> Result<FieldTable, String> {
    match m.get("arguments") {
        None | Some(Value::Null) => Ok(FieldTable::default()),
        Some(Value::Object(a)) => Ok(json_table(a)),
        Some(_) => Err("arguments must be an object".into()),
    }
}

/// PUT /api/queues/{vhost}/{name}: declare (201 when created, 204 when it was there).
async fn put_queue(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    let declare = (|| {
        Ok::<_, String>(QueueDeclare {
            name: name.clone(),
            passive: false,
            durable: flag(&m, "durable", false)?,
            exclusive: false,
            auto_delete: flag(&m, "auto_delete", false)?,
            arguments: arguments(&m)?,
        })
    })();
    let declare = match declare {
        Ok(d) => d,
        Err(reason) => return bad_request(&reason),
    };
    if name.is_empty() {
        return bad_request("a queue needs a name");
    }
    // Queue names are short strings on the wire: RabbitMQ's API refuses longer ones (its
    // reason, newline included, says "less than" but 255 bytes is accepted). Exchange names
    // it does not check, and neither do we.
    if name.len() > 255 {
        return bad_request(&format!(
            "queue should be less than 255 bytes, actually was {}\n",
            name.len()
        ));
    }
    let result = change(&shared, |b, fx| {
        if !b.has_vhost(&vhost) {
            return Err(AmqpError::connection(ReplyCode::NotFound, "no such vhost"));
        }
        let existed = b.queue_info(&vhost, &name).is_some();
        b.queue_declare(0, &vhost, declare, fx).map(|_| existed)
    })
    .await;
    match result {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => StatusCode::CREATED.into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(serde::Deserialize, Default)]
struct DeleteQuery {
    #[serde(rename = "if-unused", default)]
    if_unused: Option<String>,
    #[serde(rename = "if-empty", default)]
    if_empty: Option<String>,
}

/// DELETE /api/queues/{vhost}/{name} (`?if-unused=true`, `?if-empty=true`).
async fn delete_queue(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Response {
    let yes = |v: &Option<String>| v.as_deref() == Some("true");
    let result = change(&shared, |b, fx| {
        if b.queue_info(&vhost, &name).is_none() {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        }
        b.queue_delete(
            0,
            &vhost,
            &name,
            yes(&query.if_unused),
            yes(&query.if_empty),
            fx,
        )
    })
    .await;
    no_content(result)
}

/// DELETE /api/queues/{vhost}/{name}/contents: purge.
async fn purge_queue(State(shared): Api, Path((vhost, name)): Path<(String, String)>) -> Response {
    let result = change(&shared, |b, fx| {
        if b.queue_info(&vhost, &name).is_none() {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        }
        b.queue_purge(0, &vhost, &name, fx)
    })
    .await;
    no_content(result)
}

/// PUT /api/exchanges/{vhost}/{name}: declare (201 when created, 204 when it was there).
async fn put_exchange(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    // RabbitMQ makes a direct exchange when no type is given.
    let kind = match m.get("type") {
        None | Some(Value::Null) => "direct".to_string(),
        Some(Value::String(k)) => k.clone(),
        Some(_) => return bad_request("type must be a string"),
    };
    let declare = (|| {
        Ok::<_, String>(ExchangeDeclare {
            name: name.clone(),
            kind,
            passive: false,
            durable: flag(&m, "durable", false)?,
            auto_delete: flag(&m, "auto_delete", false)?,
            internal: flag(&m, "internal", false)?,
            arguments: arguments(&m)?,
        })
    })();
    let declare = match declare {
        Ok(d) => d,
        Err(reason) => return bad_request(&reason),
    };
    if name.is_empty() {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            Json(json!({"error": "method_not_allowed", "reason": "the default exchange cannot be declared"})),
        )
            .into_response();
    }
    let result = change(&shared, |b, fx| {
        if !b.has_vhost(&vhost) {
            return Err(AmqpError::connection(ReplyCode::NotFound, "no such vhost"));
        }
        let existed = b.exchange_exists(&vhost, &name);
        b.exchange_declare(&vhost, declare, fx).map(|_| existed)
    })
    .await;
    match result {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => StatusCode::CREATED.into_response(),
        Err(e) => e.into_response(),
    }
}

/// DELETE /api/exchanges/{vhost}/{name} (`?if-unused=true`).
async fn delete_exchange(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Response {
    let result = change(&shared, |b, fx| {
        if !b.exchange_exists(&vhost, &name) {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        }
        b.exchange_delete(
            &vhost,
            &name,
            query.if_unused.as_deref() == Some("true"),
            fx,
        )
    })
    .await;
    no_content(result)
}

/// RabbitMQ's `properties_key` of a binding, which names it in a path: "~" for an empty
/// routing key without arguments, the routing key itself, or the key, "~" and a digest of
/// the arguments.
fn properties_key(b: &BindingView) -> String {
    if b.arguments.inner().is_empty() {
        if b.routing_key.is_empty() {
            "~".into()
        } else {
            b.routing_key.clone()
        }
    } else {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{:?}", b.arguments).hash(&mut h);
        format!("{}~{:016x}", b.routing_key, h.finish())
    }
}

fn binding_json(b: &BindingView) -> Value {
    json!({
        "source": b.source,
        "vhost": b.vhost,
        "destination": b.destination,
        "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key,
        "arguments": table_json(&b.arguments),
        "properties_key": properties_key(b),
    })
}

fn binding_list(
    shared: &Shared,
    vhost: Option<&str>,
    keep: impl Fn(&BindingView) -> bool,
) -> Response {
    let list = shared.broker.lock().binding_views(vhost);
    Json(Value::Array(
        list.iter().filter(|b| keep(b)).map(binding_json).collect(),
    ))
    .into_response()
}

async fn bindings_all(State(shared): Api) -> Response {
    binding_list(&shared, None, |_| true)
}

async fn bindings_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, |s, v| binding_list(s, v, |_| true))
}

async fn queue_bindings(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    if !queue_exists(&shared, &vhost, &name) {
        return not_found();
    }
    binding_list(&shared, Some(&vhost), |b| {
        b.destination_is_queue && b.destination == name
    })
}

fn queue_exists(shared: &Shared, vhost: &str, name: &str) -> bool {
    shared
        .broker
        .lock()
        .queue_views(Some(vhost))
        .iter()
        .any(|q| q.name == name)
}

/// The `q` or `e` of a binding path: whether the destination is a queue.
fn destination_kind(kind: &str) -> Option<bool> {
    match kind {
        "q" => Some(true),
        "e" => Some(false),
        _ => None,
    }
}

/// Whether the source exchange and the destination exist (else the path is not found).
fn binding_ends_exist(
    shared: &Shared,
    vhost: &str,
    source: &str,
    to_queue: bool,
    dest: &str,
) -> bool {
    let source_exists = shared.broker.lock().exchange_exists(vhost, source);
    source_exists
        && if to_queue {
            queue_exists(shared, vhost, dest)
        } else {
            shared.broker.lock().exchange_exists(vhost, dest)
        }
}

type BindingPath = Path<(String, String, String, String)>;
type BindingKeyPath = Path<(String, String, String, String, String)>;

async fn bindings_between(
    State(shared): Api,
    Path((vhost, source, kind, dest)): BindingPath,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    if !binding_ends_exist(&shared, &vhost, &source, to_queue, &dest) {
        return not_found();
    }
    binding_list(&shared, Some(&vhost), |b| {
        b.source == source && b.destination == dest && b.destination_is_queue == to_queue
    })
}

async fn binding_one(
    State(shared): Api,
    Path((vhost, source, kind, dest, props)): BindingKeyPath,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    let list = shared.broker.lock().binding_views(Some(&vhost));
    match list.iter().find(|b| {
        b.source == source
            && b.destination == dest
            && b.destination_is_queue == to_queue
            && properties_key(b) == props
    }) {
        Some(b) => Json(binding_json(b)).into_response(),
        None => not_found(),
    }
}

/// POST /api/bindings/{vhost}/e/{source}/{q|e}/{destination} with `routing_key` and
/// `arguments`: 201 and a Location naming the binding.
async fn add_binding(
    State(shared): Api,
    Path((vhost, source, kind, dest)): BindingPath,
    body: axum::body::Bytes,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    let routing_key = match m.get("routing_key") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return bad_request("routing_key must be a string"),
    };
    let args = match arguments(&m) {
        Ok(a) => a,
        Err(reason) => return bad_request(&reason),
    };
    if !binding_ends_exist(&shared, &vhost, &source, to_queue, &dest) {
        return not_found();
    }
    let result = change(&shared, |b, fx| {
        if to_queue {
            b.queue_bind(0, &vhost, &dest, &source, &routing_key, &args, true, fx)
        } else {
            b.exchange_bind(&vhost, &dest, &source, &routing_key, &args, true, fx)
        }
    })
    .await;
    match result {
        Ok(()) => {
            let view = BindingView {
                vhost: vhost.clone(),
                source,
                destination: dest,
                destination_is_queue: to_queue,
                routing_key,
                arguments: args,
            };
            let mut r = StatusCode::CREATED.into_response();
            let location = format!("./{}", pct(&properties_key(&view)));
            if let Ok(v) = HeaderValue::from_str(&location) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(e) => e.into_response(),
    }
}

/// DELETE /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{properties_key}.
async fn delete_binding(
    State(shared): Api,
    Path((vhost, source, kind, dest, props)): BindingKeyPath,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    let result = change(&shared, |b, fx| {
        let found = b.binding_views(Some(&vhost)).into_iter().find(|v| {
            !v.source.is_empty()
                && v.source == source
                && v.destination == dest
                && v.destination_is_queue == to_queue
                && properties_key(v) == props
        });
        let Some(v) = found else {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        };
        if to_queue {
            b.queue_bind(
                0,
                &vhost,
                &dest,
                &source,
                &v.routing_key,
                &v.arguments,
                false,
                fx,
            )
        } else {
            b.exchange_bind(
                &vhost,
                &dest,
                &source,
                &v.routing_key,
                &v.arguments,
                false,
                fx,
            )
        }
    })
    .await;
    no_content(result)
}

/// Percent-encode a path segment (all but RFC 3986's unreserved characters).
fn pct(s: &str) -> String {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    const SEGMENT: &percent_encoding::AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// A JSON object as a field table: integers as signed 64-bit, other numbers as doubles.
///
/// A field table's keys are short strings (255 bytes at most). RabbitMQ accepts a longer
/// argument key through its HTTP API (201) and keeps it; no argument Warren knows is that
/// long, so such a key is accepted and left out, with a warning (a README deviation).
fn json_table(m: &Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in m {
        match amq_protocol::types::ShortString::try_new(k.as_str()) {
            Ok(key) => {
                t.insert(key, json_value(v));
            }
            Err(_) => tracing::warn!(
                bytes = k.len(),
                "an argument key longer than 255 bytes is ignored"
            ),
        }
    }
    t
}

fn json_value(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(a) => {
            AMQPValue::FieldArray(a.iter().map(json_value).collect::<Vec<_>>().into())
        }
        Value::Object(o) => AMQPValue::FieldTable(json_table(o)),
    }
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

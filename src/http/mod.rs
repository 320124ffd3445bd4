//! The management HTTP API: the part of RabbitMQ's (`rabbitmq_management`, port 15672) that
//! tools and client test suites use to look at a broker and to close connections. Paths, JSON
//! field names and status codes follow RabbitMQ's; see the README for the endpoints served.
//!
//! Users log in with HTTP basic auth, with the same users (and loopback rule for `guest`) as
//! AMQP, and need one of the management tags (administrator, monitoring, management,
//! policymaker), as in RabbitMQ. The users endpoints are for administrators; the others do not
//! yet narrow what a non-administrator sees (issue 14's permissions).
//!
//! This file holds the router, its layers (trailing slash, login, caught panics) and what the
//! resources share: the vhost check, changes made through the core, the JSON error answers.
//! Each resource (RabbitMQ's path under `/api/`) has its own file.

mod access;
mod bindings;
mod cluster;
mod connections;
pub(crate) mod definitions;
mod exchanges;
mod json;
mod limits;
mod overview;
mod permissions;
mod queues;
mod users;
mod vhosts;
mod whoami;

use crate::broker::cmd::{Cmd, Outcome};
use crate::node::Shared;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use base64::Engine;
use bindings::{
    add_binding, binding_one, bindings_all, bindings_between, bindings_in, delete_binding,
    queue_bindings,
};
use connections::{close_connection, connection, connections};
use exchanges::{delete_exchange, exchange, exchanges_all, exchanges_in, put_exchange};
use overview::overview;
use queues::{delete_queue, purge_queue, put_queue, queue, queues_all, queues_in};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use vhosts::{vhost, vhosts};
use warren_protocol::reply::{AmqpError, ReplyCode};
use whoami::whoami;

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

/// Serve the API over HTTPS on `listener` (`--management-tls`) until the task is dropped: each
/// connection's TLS handshake (bounded) and HTTP/1.1 exchange in its own task.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    shared: Arc<Shared>,
) {
    let app = tower::ServiceBuilder::new()
        .map_request(trim_one_trailing_slash)
        .service(router(shared));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(error = %e, "accept failed (management API, TLS)");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let limit = std::time::Duration::from_secs(10);
            let Ok(Ok(tls)) = tokio::time::timeout(limit, acceptor.accept(tcp)).await else {
                return;
            };
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    // What `require_login` reads for the loopback rule.
                    req.extensions_mut().insert(ConnectInfo(peer));
                    tower::ServiceExt::oneshot(app.clone(), req.map(axum::body::Body::new))
                },
            );
            let io = hyper_util::rt::TokioIo::new(tls);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!(error = %e, %peer, "management API connection (TLS) ended");
            }
        });
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
        .route("/api/nodes", get(cluster::nodes))
        .route("/api/cluster/nodes", axum::routing::post(cluster::add_node))
        .route("/api/cluster/nodes/{id}", delete(cluster::remove_node))
        .route("/api/users", get(users::users))
        .route(
            "/api/users/{name}",
            get(users::user)
                .put(users::put_user)
                .delete(users::delete_user),
        )
        .route(
            "/api/users/{name}/permissions",
            get(permissions::user_permissions),
        )
        .route("/api/permissions", get(permissions::permissions))
        .route(
            "/api/topic-permissions",
            get(permissions::topic_permissions),
        )
        .route(
            "/api/topic-permissions/{vhost}/{user}",
            get(permissions::topic_permission)
                .put(permissions::put_topic_permission)
                .delete(permissions::delete_topic_permission),
        )
        .route(
            "/api/vhosts/{vhost}/topic-permissions",
            get(permissions::vhost_topic_permissions),
        )
        .route(
            "/api/users/{name}/topic-permissions",
            get(permissions::user_topic_permissions),
        )
        .route("/api/vhost-limits", get(limits::vhost_limits))
        .route("/api/vhost-limits/{vhost}", get(limits::vhost_limits_of))
        .route(
            "/api/vhost-limits/{vhost}/{name}",
            axum::routing::put(limits::put_vhost_limit).delete(limits::delete_vhost_limit),
        )
        .route("/api/user-limits", get(limits::user_limits))
        .route("/api/user-limits/{user}", get(limits::user_limits_of))
        .route(
            "/api/user-limits/{user}/{name}",
            axum::routing::put(limits::put_user_limit).delete(limits::delete_user_limit),
        )
        .route(
            "/api/definitions",
            get(definitions::get_all).post(definitions::post_all),
        )
        .route(
            "/api/definitions/{vhost}",
            get(definitions::get_vhost).post(definitions::post_vhost),
        )
        .route(
            "/api/permissions/{vhost}/{user}",
            get(permissions::permission)
                .put(permissions::put_permission)
                .delete(permissions::delete_permission),
        )
        .route(
            "/api/vhosts/{vhost}/permissions",
            get(permissions::vhost_permissions),
        )
        .route("/api/vhosts", get(vhosts))
        .route(
            "/api/vhosts/{vhost}",
            get(vhost)
                .put(vhosts::put_vhost)
                .delete(vhosts::delete_vhost),
        )
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
            to_the_leader,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            require_login,
        ))
        // The cluster's state answers without a login, like a health check: load balancers
        // and scripts find the leader with it.
        .route("/api/cluster", get(cluster::cluster))
        .fallback(|| async { not_found() })
        // A defect in a handler answers 500 and leaves the server serving (without this the
        // client got an empty reply).
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .with_state(shared)
}

/// Marks a request a follower forwarded (its value: the follower's node id), so that it is
/// never forwarded again (two nodes each naming the other leader, for a moment).
const PROXIED: &str = "x-warren-proxied-by";

/// How long a forwarded request may take, the leader's answer included.
const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long the connection to the leader's management port may take to open.
const FORWARD_CONNECT: std::time::Duration = std::time::Duration::from_secs(5);

/// On a cluster node that does not lead, the API is the leader's: every request (after the
/// login, checked against the replicated users) is forwarded to the leader's management
/// address and its answer copied back, so any node answers for the cluster, as RabbitMQ's
/// nodes do. With no live leader known (an election under way, or this node cut off), reads
/// answer from this node's replicated state and changes are refused with 503 naming the
/// leader if one is known: a change the cluster never agreed on is never made here.
async fn to_the_leader(
    State(shared): Api,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(rep) = shared.replication.as_ref() else {
        return next.run(req).await;
    };
    if shared.serves_clients() {
        return next.run(req).await;
    }
    let leader = if req.headers().contains_key(PROXIED) {
        None
    } else {
        rep.live_leader_info().filter(|(_, n)| !n.http.is_empty())
    };
    if let Some((id, node)) = leader {
        return match tokio::time::timeout(FORWARD_TIMEOUT, forward(&node.http, rep.me, req)).await {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => proxy_error(format!(
                "forwarding to the leader, node {id} at http://{}: {e}",
                node.http
            )),
            Err(_) => proxy_error(format!(
                "the leader, node {id} at http://{}, did not answer within {} s",
                node.http,
                FORWARD_TIMEOUT.as_secs()
            )),
        };
    }
    if req.method() != axum::http::Method::GET {
        let leader = rep
            .leader_info()
            .filter(|(id, _)| *id != rep.me)
            .map(|(id, n)| format!("node {id} at http://{}", n.http));
        let reason = match leader {
            Some(l) => format!(
                "this node does not lead the cluster and cannot reach the leader; send changes \
                 to the leader, {l}"
            ),
            None => "this node does not lead the cluster and no leader is known yet".into(),
        };
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "not_leader", "reason": reason})),
        )
            .into_response();
    }
    next.run(req).await
}

fn proxy_error(reason: String) -> Response {
    tracing::warn!("{reason}");
    (
        StatusCode::BAD_GATEWAY,
        Json(serde_json::json!({"error": "bad_gateway", "reason": reason})),
    )
        .into_response()
}

/// Send `req` to the management API at `addr` over a new HTTP/1.1 connection (hyper's
/// client) and hand back its answer, the body streamed.
async fn forward(addr: &str, me: u64, mut req: axum::extract::Request) -> Result<Response, String> {
    // The connection on its own bound: an address that drops SYNs would otherwise hold the
    // request for the whole FORWARD_TIMEOUT.
    let stream = tokio::time::timeout(FORWARD_CONNECT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| format!("no connection within {} s", FORWARD_CONNECT.as_secs()))?
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "a forwarded API connection ended");
        }
    });
    req.headers_mut().insert(PROXIED, HeaderValue::from(me));
    // Origin form (path and query), as the request arrived here.
    if let Some(pq) = req.uri().path_and_query().cloned() {
        *req.uri_mut() = axum::http::Uri::from(pq);
    }
    let response = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(response.map(axum::body::Body::new))
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
    crate::auth::login_allowed(shared, user, pass, peer.ip()).then(|| user.to_string())
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
    if !shared.query(|b| b.has_vhost(vhost)) {
        return not_found();
    }
    list(shared, Some(vhost))
}

pub(super) fn not_found() -> Response {
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
            let tags = shared.query(|b| b.user(&user).map(|u| u.tags.clone()));
            if !tags.is_some_and(|t| users::may_manage(&t)) {
                // RabbitMQ's answer to a user without a management tag.
                return (
                    StatusCode::UNAUTHORIZED,
                    Json(json!({"error": "not_authorised", "reason": "Not management user"})),
                )
                    .into_response();
            }
            // A vhost's queues, exchanges and bindings only for those who may see the vhost.
            if let Some(vhost) = access::path_vhost(req.uri().path()) {
                let viewer = access::Viewer::of(&shared, &Login(user.clone()));
                if !viewer.sees_objects_in(&vhost) && shared.query(|b| b.has_vhost(&vhost)) {
                    return access::not_authorised_vhost();
                }
            }
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

/// Hand `cmd` to the node's one entry point for the logged-in `user`, in `vhost` ("" when
/// none is concerned), and wait until the durable changes it made are in the store (as AMQP's
/// declare-ok does).
async fn change(
    shared: &Arc<Shared>,
    user: &str,
    vhost: &str,
    cmd: Cmd,
) -> Result<Outcome, ChangeError> {
    let (notify, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let caller = crate::node::Caller::Admin {
        user,
        vhost,
        notify,
    };
    let (result, ticket) = shared.execute(caller, cmd);
    let result = result.map_err(ChangeError::Refused)?;
    if let Some(ticket) = ticket {
        while let Some(done) = rx.recv().await {
            if done.ticket >= ticket {
                if done.deposed {
                    return Err(ChangeError::Deposed);
                }
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
fn no_content(result: Result<Outcome, ChangeError>) -> Response {
    match result {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// 204 for a PUT of something that was there, 201 for one it made, else why not.
fn created(result: Result<Outcome, ChangeError>) -> Response {
    match result {
        Ok(o) if o.existed() => StatusCode::NO_CONTENT.into_response(),
        Ok(_) => StatusCode::CREATED.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Why a change through the API did not happen.
enum ChangeError {
    Refused(AmqpError),
    Store,
    /// The node stopped leading before the change was known committed (`Done::deposed`).
    Deposed,
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
            ChangeError::Deposed => (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({
                    "error": "leader_changed",
                    "reason": "this node stopped leading before the change was committed; it may or may not have been: check, and retry on the new leader"
                })),
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
    let reason = e.detail();
    (status, Json(json!({"error": error, "reason": reason}))).into_response()
}

pub(super) fn bad_request(reason: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": "bad_request", "reason": reason})),
    )
        .into_response()
}

#[derive(serde::Deserialize, Default)]
struct DeleteQuery {
    #[serde(rename = "if-unused", default)]
    if_unused: Option<String>,
    #[serde(rename = "if-empty", default)]
    if_empty: Option<String>,
}

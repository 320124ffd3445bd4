//! `/api/connections`: list, show and close client connections (from the registry).

use super::access::Viewer;
use super::json::table_json;
use super::{node_name, not_found, Api, Login};
use crate::node::Shared;
use crate::registry::ConnInfo;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

fn connection_json(shared: &Shared, c: &ConnInfo) -> Value {
    // The broker lock is not taken with the details' lock held (no lock nests in another here).
    let conn = c.details.lock().conn;
    let channels = if conn != 0 {
        shared.query(|b| b.connection_channels(conn))
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
        "ssl": c.tls.is_some(),
        "ssl_protocol": c.tls.as_ref().map(|t| t.protocol.clone()),
        "ssl_cipher": c.tls.as_ref().map(|t| t.cipher.clone()),
        "peer_cert_subject": c.tls.as_ref().and_then(|t| t.subject.as_ref()).map(|s| s.dn.clone()),
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

/// Administrators and monitoring users see every connection, the others their own (RabbitMQ).
pub(super) async fn connections(
    State(shared): Api,
    Extension(login): Extension<Login>,
) -> Response {
    let viewer = Viewer::of(&shared, &login);
    let list: Vec<Arc<ConnInfo>> = shared.registry.list();
    let out: Vec<Value> = list
        .iter()
        .filter(|c| viewer.sees_connection_of(&c.details.lock().user))
        .map(|c| connection_json(&shared, c))
        .collect();
    Json(Value::Array(out)).into_response()
}

pub(super) async fn connection(
    State(shared): Api,
    Extension(login): Extension<Login>,
    Path(name): Path<String>,
) -> Response {
    let viewer = Viewer::of(&shared, &login);
    let found = shared.registry.find(&name);
    match found {
        Some(c) if viewer.sees_connection_of(&c.details.lock().user) => {
            Json(connection_json(&shared, &c)).into_response()
        }
        Some(_) => super::access::not_authorised_object(),
        None => not_found(),
    }
}

/// DELETE /api/connections/{name}: the client gets connection.close 320 with the `X-Reason`
/// header's text ("Closed via management plugin" without one), as from RabbitMQ.
pub(super) async fn close_connection(
    State(shared): Api,
    Extension(login): Extension<Login>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    // Administrators close any connection, the others their own (RabbitMQ).
    let viewer = Viewer::of(&shared, &login);
    match shared.registry.find(&name) {
        Some(c) if viewer.admin || viewer.user == c.details.lock().user => {}
        Some(_) => return super::access::not_authorised_object(),
        None => return not_found(),
    }
    let reason = headers
        .get("x-reason")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("Closed via management plugin")
        .to_string();
    if !shared.registry.close(&name, reason) {
        return not_found();
    }
    StatusCode::NO_CONTENT.into_response()
}

//! `/api/overview`: versions, object and message totals, listeners.

use super::access::Viewer;
use super::{node_name, Api, Login};
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// Totals over what the user may see (RabbitMQ: management users, their vhosts' objects and
/// their own connections; administrators and monitoring users, everything).
pub(super) async fn overview(State(shared): Api, Extension(login): Extension<Login>) -> Response {
    let viewer = Viewer::of(&shared, &login);
    let (mut queues, mut exchanges, (mut connections, mut channels)) = shared.query(|b| {
        (
            b.queue_views(None),
            b.exchange_views(None),
            b.connection_totals(),
        )
    });
    if !viewer.sees_all {
        queues.retain(|q| viewer.sees(&q.vhost));
        exchanges.retain(|x| viewer.sees(&x.vhost));
        (connections, channels) = shared.query(|b| b.usage_of(&viewer.user));
    }
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

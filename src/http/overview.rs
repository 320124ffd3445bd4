//! `/api/overview`: versions, object and message totals, listeners.

use super::{node_name, Api};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

pub(super) async fn overview(State(shared): Api) -> Response {
    let (queues, exchanges, (connections, channels)) = shared.query(|b| {
        (
            b.queue_views(None),
            b.exchange_views(None),
            b.connection_totals(),
        )
    });
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

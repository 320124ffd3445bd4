//! `GET /api/cluster`: this node's view of the replicated cluster (see `cluster::status`).

use super::Api;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub(super) async fn cluster(State(shared): Api) -> Response {
    match shared
        .replication
        .as_ref()
        .and_then(|r| crate::cluster::status::status(r))
    {
        Some(s) => Json(s).into_response(),
        None if shared.replication.is_some() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"error": "starting", "reason": "Raft is not running yet"})),
        )
            .into_response(),
        // A single node: a cluster of one, with no Raft.
        None => Json(serde_json::json!({
            "node_id": null,
            "role": "single",
            "term": 0,
            "leader_id": null,
            "serving": true,
            "commit_index": null,
            "applied_index": null,
            "nodes": [],
        }))
        .into_response(),
    }
}

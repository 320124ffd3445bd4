//! `/api/vhosts` and `/api/vhosts/{vhost}`.

use super::{not_found, Api};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn vhost_json(name: &str) -> Value {
    json!({"name": name, "description": "", "tags": [], "tracing": false})
}

pub(super) async fn vhosts(State(shared): Api) -> Response {
    let names = shared.query(|b| b.vhost_names());
    Json(Value::Array(names.iter().map(|n| vhost_json(n)).collect())).into_response()
}

pub(super) async fn vhost(State(shared): Api, Path(name): Path<String>) -> Response {
    if shared.query(|b| b.has_vhost(&name)) {
        Json(vhost_json(&name)).into_response()
    } else {
        not_found()
    }
}

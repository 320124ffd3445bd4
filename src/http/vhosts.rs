//! `/api/vhosts`: list, show, create or change (PUT) and delete vhosts, as RabbitMQ's API does.
//! Creating and deleting are for administrators. A vhost is changed through the core
//! (`Op::PutVhost`, `Op::DeleteVhost`), so the change is durable (and replicated in a cluster)
//! before the answer; a deletion takes the vhost's queues, messages and exchanges with it and
//! closes its connections.

use super::json::body_object;
use super::users::{is_administrator, not_administrator};
use super::{bad_request, change, no_content, node_name, not_found, Api, Login};
use crate::broker::cmd::Cmd;
use crate::broker::VhostInfo;
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// RabbitMQ 3.10's fields (its message counters appear only once a vhost has statistics).
fn vhost_json(v: &VhostInfo) -> Value {
    let mut cluster_state = Map::new();
    cluster_state.insert(node_name(), json!("running"));
    json!({
        "name": v.name,
        "description": v.description,
        "tags": v.tags,
        "default_queue_type": "undefined",
        "metadata": {"description": v.description, "tags": v.tags},
        "tracing": false,
        "cluster_state": cluster_state,
    })
}

/// Every vhost for administrators and monitoring users, the others' own (RabbitMQ).
pub(super) async fn vhosts(State(shared): Api, Extension(login): Extension<Login>) -> Response {
    let viewer = super::access::Viewer::of(&shared, &login);
    let list = shared.query(|b| b.vhost_infos());
    Json(Value::Array(
        list.iter()
            .filter(|v| viewer.sees(&v.name))
            .map(vhost_json)
            .collect(),
    ))
    .into_response()
}

/// One vhost: administrators only (RabbitMQ 3.10 answers others 401, even for their own).
pub(super) async fn vhost(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(name): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let found = shared.query(|b| b.vhost_infos().into_iter().find(|v| v.name == name));
    match found {
        Some(v) => Json(vhost_json(&v)).into_response(),
        None => not_found(),
    }
}

/// A vhost's `tags`, as RabbitMQ takes them: a comma-separated string or a list of strings
/// (none when absent).
fn tags(m: &Map<String, Value>) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        let t = t.trim();
        if !t.is_empty() && !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    };
    match m.get("tags") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => s.split(',').for_each(&mut add),
        Some(Value::Array(a)) => {
            for t in a {
                match t {
                    Value::String(s) => add(s),
                    _ => return Err("tags must be strings".into()),
                }
            }
        }
        Some(_) => return Err("tags must be a string or a list of strings".into()),
    }
    Ok(out)
}

/// PUT /api/vhosts/{name}: create (201) or change the description and tags (204); what the
/// body leaves out becomes empty, as in RabbitMQ.
pub(super) async fn put_vhost(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    let description = match m.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return bad_request("description must be a string"),
    };
    let tags = match tags(&m) {
        Ok(t) => t,
        Err(reason) => return bad_request(&reason),
    };
    if name.is_empty() {
        return bad_request("a vhost needs a name");
    }
    let cmd = Cmd::PutVhost {
        name: name.clone(),
        description,
        tags,
    };
    let result = change(&shared, &me, "", cmd).await;
    super::created(result)
}

/// DELETE /api/vhosts/{name}: the vhost goes with everything in it, and its connections are
/// closed (320, RabbitMQ's text).
pub(super) async fn delete_vhost(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(name): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let result = change(&shared, &me, "", Cmd::DeleteVhost { name: name.clone() }).await;
    if result.is_ok() {
        // Opened before the deletion: they go now. One opening meanwhile looks again once
        // it is listed here (`conn_vhost_still_there`).
        shared
            .registry
            .close_where(|d| d.vhost == name, &format!("vhost '{name}' is deleted"));
    }
    no_content(result)
}

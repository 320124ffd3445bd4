//! `/api/queues`: list, show, declare (PUT), delete and purge (`/contents`) queues.
//! A queue's bindings (`/api/queues/{vhost}/{name}/bindings`) are listed in `bindings.rs`.

use super::access::Viewer;
use super::json::{arguments, body_object, flag, table_json};
use super::{
    bad_request, change, created, in_vhost, no_content, node_name, not_found, Api, DeleteQuery,
    Login,
};
use crate::broker::cmd::Cmd;
use crate::broker::{QueueDeclare, QueueView};
use crate::node::Shared;
use axum::extract::{Extension, Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

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
        "message_bytes_ready": q.message_bytes_ready,
        "messages_unacknowledged": q.messages_unacknowledged,
        "consumers": q.consumers,
    })
}

fn queue_list(shared: &Shared, vhost: Option<&str>) -> Response {
    let node = node_name();
    let list = shared.query(|b| b.queue_views(vhost));
    Json(Value::Array(
        list.iter().map(|q| queue_json(&node, q)).collect(),
    ))
    .into_response()
}

pub(super) async fn queues_all(State(shared): Api, Extension(login): Extension<Login>) -> Response {
    let viewer = Viewer::of(&shared, &login);
    let node = node_name();
    let list = shared.query(|b| b.queue_views(None));
    Json(Value::Array(
        list.iter()
            .filter(|q| viewer.sees_objects_in(&q.vhost))
            .map(|q| queue_json(&node, q))
            .collect(),
    ))
    .into_response()
}

pub(super) async fn queues_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, queue_list)
}

pub(super) async fn queue(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    let list = shared.query(|b| b.queue_views(Some(&vhost)));
    match list.iter().find(|q| q.name == name) {
        Some(q) => Json(queue_json(&node_name(), q)).into_response(),
        None => not_found(),
    }
}

/// PUT /api/queues/{vhost}/{name}: declare (201 when created, 204 when it was there).
pub(super) async fn put_queue(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
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
    let cmd = Cmd::DeclareQueue {
        ch: 0,
        decl: declare,
        nowait: true,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    created(result)
}

/// DELETE /api/queues/{vhost}/{name} (`?if-unused=true`, `?if-empty=true`).
pub(super) async fn delete_queue(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Response {
    let yes = |v: &Option<String>| v.as_deref() == Some("true");
    let cmd = Cmd::DeleteQueue {
        ch: 0,
        queue: name,
        if_unused: yes(&query.if_unused),
        if_empty: yes(&query.if_empty),
        nowait: true,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    no_content(result)
}

/// DELETE /api/queues/{vhost}/{name}/contents: purge.
pub(super) async fn purge_queue(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    let cmd = Cmd::PurgeQueue {
        ch: 0,
        queue: name,
        nowait: true,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    no_content(result)
}

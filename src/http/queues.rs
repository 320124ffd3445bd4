//! `/api/queues`: list, show, declare (PUT), delete and purge (`/contents`) queues.
//! A queue's bindings (`/api/queues/{vhost}/{name}/bindings`) are listed in `bindings.rs`.

use super::access::{permit, Viewer};
use super::json::{arguments, body_object, flag, table_json};
use super::{
    bad_request, change, in_vhost, no_content, node_name, not_found, Api, DeleteQuery, Login,
};
use crate::broker::permissions::{Access, Resource};
use crate::broker::{QueueDeclare, QueueView};
use crate::node::Shared;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use warren_protocol::reply::{AmqpError, ReplyCode};

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
    let result = change(&shared, |b, fx| {
        if !b.has_vhost(&vhost) {
            return Err(AmqpError::connection(ReplyCode::NotFound, "no such vhost"));
        }
        permit(b, &me, &vhost, Access::Configure, Resource::Queue, &name)?;
        let existed = b.queue_info(&vhost, &name).is_some();
        if !existed {
            if let Some(amq_protocol::types::AMQPValue::LongString(dlx)) =
                declare.arguments.inner().get("x-dead-letter-exchange")
            {
                // As queue.declare: reading the queue, writing to its dead-letter exchange.
                let dlx = String::from_utf8_lossy(dlx.as_bytes());
                permit(b, &me, &vhost, Access::Read, Resource::Queue, &name)?;
                permit(b, &me, &vhost, Access::Write, Resource::Exchange, &dlx)?;
            }
        }
        b.queue_declare(0, &vhost, declare, fx).map(|_| existed)
    })
    .await;
    match result {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        Ok(false) => StatusCode::CREATED.into_response(),
        Err(e) => e.into_response(),
    }
}

/// DELETE /api/queues/{vhost}/{name} (`?if-unused=true`, `?if-empty=true`).
pub(super) async fn delete_queue(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Response {
    let yes = |v: &Option<String>| v.as_deref() == Some("true");
    let result = change(&shared, |b, fx| {
        if b.queue_info(&vhost, &name).is_none() {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        }
        permit(b, &me, &vhost, Access::Configure, Resource::Queue, &name)?;
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
pub(super) async fn purge_queue(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    let result = change(&shared, |b, fx| {
        if b.queue_info(&vhost, &name).is_none() {
            return Err(AmqpError::connection(ReplyCode::NotFound, "Not Found"));
        }
        permit(b, &me, &vhost, Access::Read, Resource::Queue, &name)?;
        b.queue_purge(0, &vhost, &name, fx)
    })
    .await;
    no_content(result)
}

//! `/api/bindings` (list, show, add, delete bindings, named by RabbitMQ's `properties_key`)
//! and a queue's bindings, `/api/queues/{vhost}/{name}/bindings`.

use super::access::Viewer;
use super::json::{arguments, body_object, table_json};
use super::{bad_request, change, in_vhost, no_content, not_found, Api, Login};
use crate::broker::cmd::Cmd;
use crate::broker::BindingView;
use crate::node::Shared;
use axum::extract::{Extension, Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn binding_json(b: &BindingView) -> Value {
    json!({
        "source": b.source,
        "vhost": b.vhost,
        "destination": b.destination,
        "destination_type": if b.destination_is_queue { "queue" } else { "exchange" },
        "routing_key": b.routing_key,
        "arguments": table_json(&b.arguments),
        "properties_key": b.properties_key(),
    })
}

fn binding_list(
    shared: &Shared,
    vhost: Option<&str>,
    keep: impl Fn(&BindingView) -> bool,
) -> Response {
    let list = shared.query(|b| b.binding_views(vhost));
    Json(Value::Array(
        list.iter().filter(|b| keep(b)).map(binding_json).collect(),
    ))
    .into_response()
}

pub(super) async fn bindings_all(
    State(shared): Api,
    Extension(login): Extension<Login>,
) -> Response {
    let viewer = Viewer::of(&shared, &login);
    binding_list(&shared, None, |b| viewer.sees_objects_in(&b.vhost))
}

pub(super) async fn bindings_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, |s, v| binding_list(s, v, |_| true))
}

pub(super) async fn queue_bindings(
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
    shared.query(|b| b.queue_views(Some(vhost)).iter().any(|q| q.name == name))
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
    let source_exists = shared.query(|b| b.exchange_exists(vhost, source));
    source_exists
        && if to_queue {
            queue_exists(shared, vhost, dest)
        } else {
            shared.query(|b| b.exchange_exists(vhost, dest))
        }
}

type BindingPath = Path<(String, String, String, String)>;
type BindingKeyPath = Path<(String, String, String, String, String)>;

pub(super) async fn bindings_between(
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

pub(super) async fn binding_one(
    State(shared): Api,
    Path((vhost, source, kind, dest, props)): BindingKeyPath,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    let list = shared.query(|b| b.binding_views(Some(&vhost)));
    match list.iter().find(|b| {
        b.source == source
            && b.destination == dest
            && b.destination_is_queue == to_queue
            && b.properties_key() == props
    }) {
        Some(b) => Json(binding_json(b)).into_response(),
        None => not_found(),
    }
}

/// POST /api/bindings/{vhost}/e/{source}/{q|e}/{destination} with `routing_key` and
/// `arguments`: 201 and a Location naming the binding.
pub(super) async fn add_binding(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
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
    let cmd = if to_queue {
        Cmd::BindQueue {
            ch: 0,
            queue: dest.clone(),
            exchange: source.clone(),
            key: routing_key.clone(),
            arguments: args.clone(),
            bind: true,
            nowait: true,
        }
    } else {
        Cmd::BindExchange {
            ch: 0,
            destination: dest.clone(),
            source: source.clone(),
            key: routing_key.clone(),
            arguments: args.clone(),
            bind: true,
            nowait: true,
        }
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    match result {
        Ok(_) => {
            let view = BindingView {
                vhost: vhost.clone(),
                source,
                destination: dest,
                destination_is_queue: to_queue,
                routing_key,
                arguments: args,
            };
            let mut r = StatusCode::CREATED.into_response();
            let location = format!("./{}", pct(&view.properties_key()));
            if let Ok(v) = HeaderValue::from_str(&location) {
                r.headers_mut().insert(header::LOCATION, v);
            }
            r
        }
        Err(e) => e.into_response(),
    }
}

/// DELETE /api/bindings/{vhost}/e/{source}/{q|e}/{destination}/{properties_key}.
pub(super) async fn delete_binding(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, source, kind, dest, props)): BindingKeyPath,
) -> Response {
    let Some(to_queue) = destination_kind(&kind) else {
        return not_found();
    };
    let cmd = Cmd::Unbind {
        source,
        destination: dest,
        to_queue,
        props,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
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

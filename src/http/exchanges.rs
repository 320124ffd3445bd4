//! `/api/exchanges`: list, show, declare (PUT) and delete exchanges.

use super::access::Viewer;
use super::json::{arguments, body_object, flag, table_json};
use super::{
    bad_request, change, created, in_vhost, no_content, not_found, Api, DeleteQuery, Login,
};
use crate::broker::cmd::Cmd;
use crate::broker::{ExchangeDeclare, ExchangeView};
use crate::node::Shared;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn exchange_json(x: &ExchangeView) -> Value {
    json!({
        "name": x.name,
        "vhost": x.vhost,
        "type": x.kind,
        "durable": x.durable,
        "auto_delete": x.auto_delete,
        "internal": x.internal,
        "arguments": table_json(&x.arguments),
    })
}

fn exchange_list(shared: &Shared, vhost: Option<&str>) -> Response {
    let list = shared.query(|b| b.exchange_views(vhost));
    Json(Value::Array(list.iter().map(exchange_json).collect())).into_response()
}

pub(super) async fn exchanges_all(
    State(shared): Api,
    Extension(login): Extension<Login>,
) -> Response {
    let viewer = Viewer::of(&shared, &login);
    let list = shared.query(|b| b.exchange_views(None));
    Json(Value::Array(
        list.iter()
            .filter(|x| viewer.sees_objects_in(&x.vhost))
            .map(exchange_json)
            .collect(),
    ))
    .into_response()
}

pub(super) async fn exchanges_in(State(shared): Api, Path(vhost): Path<String>) -> Response {
    in_vhost(&shared, &vhost, exchange_list)
}

pub(super) async fn exchange(
    State(shared): Api,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    let list = shared.query(|b| b.exchange_views(Some(&vhost)));
    match list.iter().find(|x| x.name == name) {
        Some(x) => Json(exchange_json(x)).into_response(),
        None => not_found(),
    }
}

/// PUT /api/exchanges/{vhost}/{name}: declare (201 when created, 204 when it was there).
pub(super) async fn put_exchange(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    // RabbitMQ makes a direct exchange when no type is given.
    let kind = match m.get("type") {
        None | Some(Value::Null) => "direct".to_string(),
        Some(Value::String(k)) => k.clone(),
        Some(_) => return bad_request("type must be a string"),
    };
    let declare = (|| {
        Ok::<_, String>(ExchangeDeclare {
            name: name.clone(),
            kind,
            passive: false,
            durable: flag(&m, "durable", false)?,
            auto_delete: flag(&m, "auto_delete", false)?,
            internal: flag(&m, "internal", false)?,
            arguments: arguments(&m)?,
        })
    })();
    let declare = match declare {
        Ok(d) => d,
        Err(reason) => return bad_request(&reason),
    };
    if name.is_empty() {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            Json(json!({"error": "method_not_allowed", "reason": "the default exchange cannot be declared"})),
        )
            .into_response();
    }
    let cmd = Cmd::DeclareExchange {
        ch: 0,
        decl: declare,
        nowait: true,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    created(result)
}

/// DELETE /api/exchanges/{vhost}/{name} (`?if-unused=true`).
pub(super) async fn delete_exchange(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<DeleteQuery>,
) -> Response {
    let cmd = Cmd::DeleteExchange {
        ch: 0,
        name,
        if_unused: query.if_unused.as_deref() == Some("true"),
        nowait: true,
    };
    let result = change(&shared, &me, &vhost, cmd).await;
    no_content(result)
}

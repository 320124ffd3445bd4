//! `/api/vhost-limits` and `/api/user-limits`: per-vhost `max-connections` and `max-queues`,
//! per-user `max-connections` and `max-channels`, with RabbitMQ 3.10's paths, JSON and
//! answers; administrators only. Changed through the core (`Op::PutVhostLimits`,
//! `Op::PutUserLimits`, each carrying all of a vhost's or user's limits): durable, replicated,
//! and in force at once for new connections, channels and queues. A negative value is no
//! limit, 0 allows none (RabbitMQ).

use super::json::body_object;
use super::users::{is_administrator, not_administrator};
use super::{bad_request, change, not_found, Api, Login};
use crate::broker::cmd::Cmd;
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

const VHOST_LIMITS: [&str; 2] = ["max-connections", "max-queues"];
const USER_LIMITS: [&str; 2] = ["max-connections", "max-channels"];

/// Limits as RabbitMQ renders them: an object of name to value.
pub(super) fn limits_json(limits: &[(String, i64)]) -> Value {
    Value::Object(
        limits
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect::<Map<String, Value>>(),
    )
}

fn listing(key: &str, all: Vec<(String, Vec<(String, i64)>)>, only: Option<&str>) -> Response {
    let out: Vec<Value> = all
        .iter()
        .filter(|(name, _)| only.is_none_or(|o| o == name))
        .map(|(name, limits)| json!({key: name, "value": limits_json(limits)}))
        .collect();
    Json(Value::Array(out)).into_response()
}

pub(super) async fn vhost_limits(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    listing("vhost", shared.query(|b| b.vhost_limits()), None)
}

pub(super) async fn vhost_limits_of(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(vhost): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    if !shared.query(|b| b.has_vhost(&vhost)) {
        return not_found();
    }
    listing("vhost", shared.query(|b| b.vhost_limits()), Some(&vhost))
}

pub(super) async fn user_limits(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    listing("user", shared.query(|b| b.user_limits()), None)
}

pub(super) async fn user_limits_of(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(user): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    if !shared.query(|b| b.user(&user).is_some()) {
        return not_found();
    }
    listing("user", shared.query(|b| b.user_limits()), Some(&user))
}

/// The value of a PUT: `{"value": integer}`, or RabbitMQ's reason to refuse it (400).
fn value_of(body: &axum::body::Bytes, name: &str) -> Result<i64, String> {
    let m = body_object(body)?;
    match m.get("value") {
        None => Err("[{key_missing,value}]".into()),
        Some(v) => v.as_i64().ok_or_else(|| {
            format!("Validation failed\n\n{name} should be a number, actually was {v}\n")
        }),
    }
}

/// PUT/DELETE /api/vhost-limits/{vhost}/{name}: 204.
async fn change_vhost_limit(
    shared: &std::sync::Arc<crate::node::Shared>,
    me: &str,
    vhost: String,
    name: String,
    value: Option<i64>,
) -> Response {
    let result = change(shared, me, "", Cmd::VhostLimit { vhost, name, value }).await;
    super::no_content(result)
}

pub(super) async fn put_vhost_limit(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let value = match value_of(&body, &name) {
        Ok(v) => v,
        Err(reason) => return bad_request(&reason),
    };
    if !VHOST_LIMITS.contains(&name.as_str()) {
        return bad_request(&format!(
            "Validation failed\n\nUnrecognised terms [{{<<\"{name}\">>,{value}}}] in limits\n"
        ));
    }
    change_vhost_limit(&shared, &me, vhost, name, Some(value)).await
}

pub(super) async fn delete_vhost_limit(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, name)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    change_vhost_limit(&shared, &me, vhost, name, None).await
}

async fn change_user_limit(
    shared: &std::sync::Arc<crate::node::Shared>,
    me: &str,
    user: String,
    name: String,
    value: Option<i64>,
) -> Response {
    let result = change(shared, me, "", Cmd::UserLimit { user, name, value }).await;
    super::no_content(result)
}

pub(super) async fn put_user_limit(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((user, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let value = match value_of(&body, &name) {
        Ok(v) => v,
        Err(reason) => return bad_request(&reason),
    };
    if !USER_LIMITS.contains(&name.as_str()) {
        return bad_request(&format!(
            "Unrecognised terms [{{<<\"{name}\">>,{value}}}] in user-limits"
        ));
    }
    change_user_limit(&shared, &me, user, name, Some(value)).await
}

pub(super) async fn delete_user_limit(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((user, name)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    change_user_limit(&shared, &me, user, name, None).await
}

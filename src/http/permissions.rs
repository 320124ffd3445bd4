//! `/api/permissions`: a user's configure / write / read permissions per vhost, as RabbitMQ's
//! API lists, shows, sets (PUT) and clears (DELETE) them; administrators only. Changed through
//! the core (`Op::SetPermissions`, `Op::ClearPermissions`): durable and replicated before the
//! answer, and in force for open connections at their next method.

use super::json::body_object;
use super::users::{is_administrator, not_administrator};
use super::{bad_request, change, created, no_content, not_found, Api, Login};
use crate::broker::cmd::Cmd;
use crate::broker::permissions::{check, Permissions};
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn permission_json(user: &str, vhost: &str, p: &Permissions) -> Value {
    json!({
        "user": user,
        "vhost": vhost,
        "configure": p.configure,
        "write": p.write,
        "read": p.read,
    })
}

/// The permissions `keep(user, vhost)` selects, as a JSON list (sorted by user, then vhost).
fn list(shared: &crate::node::Shared, keep: impl Fn(&str, &str) -> bool) -> Value {
    let all = shared.query(|b| b.permission_list());
    Value::Array(
        all.iter()
            .filter(|(u, v, _)| keep(u, v))
            .map(|(u, v, p)| permission_json(u, v, p))
            .collect(),
    )
}

pub(super) async fn permissions(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    Json(list(&shared, |_, _| true)).into_response()
}

/// GET /api/vhosts/{vhost}/permissions.
pub(super) async fn vhost_permissions(
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
    Json(list(&shared, |_, v| v == vhost)).into_response()
}

/// GET /api/users/{user}/permissions.
pub(super) async fn user_permissions(
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
    Json(list(&shared, |u, _| u == user)).into_response()
}

pub(super) async fn permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    match shared.query(|b| b.permissions(&user, &vhost)) {
        Some(p) => Json(permission_json(&user, &vhost, &p)).into_response(),
        None => not_found(),
    }
}

/// PUT /api/permissions/{vhost}/{user} `{"configure": RE, "write": RE, "read": RE}`: 201 set,
/// 204 replaced; each expression is required and must compile (400, as RabbitMQ).
pub(super) async fn put_permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    // RabbitMQ names every missing key: "[{key_missing,configure},{key_missing,read}]".
    let missing: Vec<String> = ["configure", "write", "read"]
        .iter()
        .filter(|k| !m.contains_key(**k))
        .map(|k| format!("{{key_missing,{k}}}"))
        .collect();
    if !missing.is_empty() {
        return bad_request(&format!("[{}]", missing.join(",")));
    }
    let mut exprs = Vec::new();
    for key in ["configure", "write", "read"] {
        let Some(expr) = m.get(key).and_then(Value::as_str) else {
            return bad_request(&format!("{key} must be a string"));
        };
        if let Err(e) = check(expr) {
            return bad_request(&format!("invalid_regexp: {key} {expr:?}: {e}"));
        }
        exprs.push(expr.to_string());
    }
    let [configure, write, read] = <[String; 3]>::try_from(exprs).unwrap_or_default();
    let cmd = Cmd::SetPermissions {
        user: user.clone(),
        vhost: vhost.clone(),
        configure,
        write,
        read,
    };
    let result = change(&shared, &me, "", cmd).await;
    created(result)
}

/// DELETE /api/permissions/{vhost}/{user}: 204, or 404 when there are none.
pub(super) async fn delete_permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let cmd = Cmd::ClearPermissions {
        user: user.clone(),
        vhost: vhost.clone(),
    };
    let result = change(&shared, &me, "", cmd).await;
    no_content(result)
}

// ------------------------------------------------------------------ topic permissions

fn topic_json(user: &str, vhost: &str, exchange: &str, write: &str, read: &str) -> Value {
    json!({"user": user, "vhost": vhost, "exchange": exchange, "write": write, "read": read})
}

/// The topic permissions `keep(user, vhost)` selects, as a JSON list.
fn topic_list(shared: &crate::node::Shared, keep: impl Fn(&str, &str) -> bool) -> Vec<Value> {
    shared
        .query(|b| b.topic_permission_list())
        .iter()
        .filter(|(u, v, _, _)| keep(u, v))
        .map(|(u, v, x, p)| topic_json(u, v, x, &p.write, &p.read))
        .collect()
}

pub(super) async fn topic_permissions(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    Json(Value::Array(topic_list(&shared, |_, _| true))).into_response()
}

pub(super) async fn vhost_topic_permissions(
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
    Json(Value::Array(topic_list(&shared, |_, v| v == vhost))).into_response()
}

pub(super) async fn user_topic_permissions(
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
    Json(Value::Array(topic_list(&shared, |u, _| u == user))).into_response()
}

/// GET /api/topic-permissions/{vhost}/{user}: a list, one per exchange (404 when none).
pub(super) async fn topic_permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let list = topic_list(&shared, |u, v| u == user && v == vhost);
    if list.is_empty() {
        return not_found();
    }
    Json(Value::Array(list)).into_response()
}

/// PUT /api/topic-permissions/{vhost}/{user} `{"exchange": X, "write": RE, "read": RE}`: 201
/// when the user had none in the vhost, else 204 (RabbitMQ).
pub(super) async fn put_topic_permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let m = match body_object(&body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    let missing: Vec<String> = ["exchange", "write", "read"]
        .iter()
        .filter(|k| !m.contains_key(**k))
        .map(|k| format!("{{key_missing,{k}}}"))
        .collect();
    if !missing.is_empty() {
        return bad_request(&format!("[{}]", missing.join(",")));
    }
    let mut fields = Vec::new();
    for key in ["exchange", "write", "read"] {
        let Some(v) = m.get(key).and_then(Value::as_str) else {
            return bad_request(&format!("{key} must be a string"));
        };
        if key != "exchange" {
            if let Err(e) = check(v) {
                return bad_request(&format!("invalid_regexp: {key} {v:?}: {e}"));
            }
        }
        fields.push(v.to_string());
    }
    let [exchange, write, read] = <[String; 3]>::try_from(fields).unwrap_or_default();
    let cmd = Cmd::SetTopicPermissions {
        user: user.clone(),
        vhost: vhost.clone(),
        exchange,
        write,
        read,
    };
    let result = change(&shared, &me, "", cmd).await;
    created(result)
}

/// DELETE /api/topic-permissions/{vhost}/{user}: all of the user's in the vhost (204; 404 when
/// none).
pub(super) async fn delete_topic_permission(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path((vhost, user)): Path<(String, String)>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let cmd = Cmd::ClearTopicPermissions {
        user: user.clone(),
        vhost: vhost.clone(),
        exchange: String::new(),
    };
    let result = change(&shared, &me, "", cmd).await;
    no_content(result)
}

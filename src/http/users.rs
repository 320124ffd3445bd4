//! `/api/users`: list, show, create or change (PUT) and delete users, as RabbitMQ's API does;
//! administrators only. A user is changed through the core (`Op::PutUser`, `Op::DeleteUser`),
//! so the change is durable (and replicated in a cluster) before the answer.

use super::json::body_object;
use super::{bad_request, change, not_found, Api, Login};
use crate::broker::cmd::Cmd;
use crate::broker::users::{hash_password, User};
use crate::node::Shared;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// The only hashing algorithm stored (RabbitMQ's default since 3.6).
const SHA256: &str = "rabbit_password_hashing_sha256";

/// The tags that let a user log in to this API (RabbitMQ's management plugin: any of them).
const MANAGEMENT_TAGS: [&str; 4] = ["administrator", "monitoring", "management", "policymaker"];

/// Whether a user with `tags` may use the management API at all.
pub(super) fn may_manage(tags: &[String]) -> bool {
    tags.iter().any(|t| MANAGEMENT_TAGS.contains(&t.as_str()))
}

/// Whether the logged-in user is an administrator.
pub(super) fn is_administrator(shared: &Shared, user: &str) -> bool {
    shared.query(|b| {
        b.user(user)
            .is_some_and(|u| u.tags.iter().any(|t| t == "administrator"))
    })
}

/// RabbitMQ's answer to a user without the tag an endpoint needs.
pub(super) fn not_administrator() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({"error": "not_authorised", "reason": "Not administrator user"})),
    )
        .into_response()
}

pub(super) fn user_json(name: &str, u: &User, limits: &[(String, Vec<(String, i64)>)]) -> Value {
    let limits = limits
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, l)| super::limits::limits_json(l))
        .unwrap_or_else(|| json!({}));
    json!({
        "name": name,
        "password_hash": u.password_hash,
        "hashing_algorithm": SHA256,
        "tags": u.tags,
        "limits": limits,
    })
}

pub(super) async fn users(State(shared): Api, Extension(Login(me)): Extension<Login>) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let (list, limits) = shared.query(|b| (b.users(), b.user_limits()));
    Json(Value::Array(
        list.iter().map(|(n, u)| user_json(n, u, &limits)).collect(),
    ))
    .into_response()
}

pub(super) async fn user(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(name): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    match shared.query(|b| b.user(&name).cloned().map(|u| (u, b.user_limits()))) {
        Some((u, limits)) => Json(user_json(&name, &u, &limits)).into_response(),
        None => not_found(),
    }
}

/// `tags` as RabbitMQ takes it: a comma-separated string or a list of strings; required (as
/// RabbitMQ requires it: a PUT that only changes a password must not drop the tags).
fn tags(m: &Map<String, Value>) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        let t = t.trim();
        if !t.is_empty() && !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    };
    match m.get("tags") {
        None | Some(Value::Null) => return Err("tags_not_present".into()),
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

fn string_field(m: &Map<String, Value>, key: &str) -> Result<Option<String>, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("{key} must be a string")),
    }
}

/// The stored hash a PUT asks for: from `password` (hashed here with a fresh salt), or
/// `password_hash` as given (RabbitMQ's base64 of salt and SHA-256: a hash exported from
/// RabbitMQ logs in with the same password), or none ("": no password login), as RabbitMQ.
fn password_hash(m: &Map<String, Value>) -> Result<String, String> {
    if let Some(alg) = string_field(m, "hashing_algorithm")? {
        if alg != SHA256 {
            return Err(format!(
                "hashing_algorithm {alg} is not supported: only {SHA256}"
            ));
        }
    }
    match (
        string_field(m, "password")?,
        string_field(m, "password_hash")?,
    ) {
        (Some(_), Some(_)) => Err("both_password_and_password_hash_are_provided".into()),
        (Some(p), None) => Ok(hash_password(&p, rand::random())),
        (None, Some(h)) => {
            let ok = h.is_empty()
                || base64::Engine::decode(&base64::engine::general_purpose::STANDARD, &h)
                    .is_ok_and(|raw| raw.len() == 4 + 32);
            if ok {
                Ok(h)
            } else {
                Err("password_hash is not a base64 salted SHA-256 hash".into())
            }
        }
        (None, None) => Ok(String::new()),
    }
}

/// PUT /api/users/{name}: create (201) or replace the password and tags (204).
pub(super) async fn put_user(
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
    let (password_hash, tags) = match (password_hash(&m), tags(&m)) {
        (Ok(h), Ok(t)) => (h, t),
        (Err(reason), _) | (_, Err(reason)) => return bad_request(&reason),
    };
    if name.is_empty() {
        return bad_request("a user needs a name");
    }
    let cmd = Cmd::PutUser {
        name: name.clone(),
        password_hash,
        tags,
    };
    let result = change(&shared, &me, "", cmd).await;
    super::created(result)
}

/// DELETE /api/users/{name}: the user goes, and so do their connections (320).
pub(super) async fn delete_user(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(name): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    let result = change(&shared, &me, "", Cmd::DeleteUser { name: name.clone() }).await;
    if result.is_ok() {
        // Logged in before the deletion: nothing lets them in again, and they go now (320,
        // with RabbitMQ's text).
        shared
            .registry
            .close_where(|d| d.user == name, &format!("user '{name}' is deleted"));
    }
    super::no_content(result)
}

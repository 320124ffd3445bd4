//! Definitions, as RabbitMQ exports and imports them (`GET`/`POST /api/definitions`, and per
//! vhost; `--load-definitions FILE` at start): users with their password hashes, vhosts,
//! permissions, exchanges, queues and bindings, in RabbitMQ 3.10's JSON. A file exported from
//! RabbitMQ imports here, and Warren's export imports into RabbitMQ. Importing adds and
//! replaces; it deletes nothing. Every change goes through the one apply, in one call.

use super::json::{body_object, json_table, table_json};
use super::users::{is_administrator, not_administrator};
use super::{bad_request, change, no_content, Api, ChangeError, Login};
use crate::broker::cmd::{Cmd, ImportStep};
use crate::broker::{Broker, ExchangeDeclare, QueueDeclare};
use axum::extract::{Extension, Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use warren_protocol::reply::{AmqpError, ReplyCode};
use warren_storage::Op;

/// The only password hashing stored (see `users.rs`).
const SHA256: &str = "rabbit_password_hashing_sha256";

/// Exchanges every vhost has: never exported, never declared by an import.
fn predeclared(name: &str) -> bool {
    name.is_empty() || name.starts_with("amq.")
}

/// What `GET /api/definitions` (every vhost, `vhost` None) or `GET /api/definitions/{vhost}`
/// answers: RabbitMQ's document. Every queue but the exclusive ones and every exchange but the
/// predeclared ones (transient too, as RabbitMQ 3.10 exports them), and the bindings between
/// what is exported.
pub(crate) fn export(b: &Broker, vhost: Option<&str>) -> Value {
    let in_vhost = |m: &mut Map<String, Value>, v: &str| {
        if vhost.is_none() {
            m.insert("vhost".into(), json!(v));
        }
    };
    let mut queues = Vec::new();
    let mut exported_queues = std::collections::BTreeSet::new();
    for q in b.queue_views(vhost) {
        if q.exclusive {
            continue;
        }
        exported_queues.insert((q.vhost.clone(), q.name.clone()));
        let mut m = Map::new();
        m.insert("name".into(), json!(q.name));
        in_vhost(&mut m, &q.vhost);
        m.insert("durable".into(), json!(q.durable));
        m.insert("auto_delete".into(), json!(q.auto_delete));
        m.insert("arguments".into(), Value::Object(table_json(&q.arguments)));
        queues.push(Value::Object(m));
    }
    let mut views = b.exchange_views(vhost);
    views.sort_by(|a, b| (&a.vhost, &a.name).cmp(&(&b.vhost, &b.name)));
    let mut exchanges = Vec::new();
    let mut exported_exchanges = std::collections::BTreeSet::new();
    for x in views {
        if predeclared(&x.name) {
            continue;
        }
        exported_exchanges.insert((x.vhost.clone(), x.name.clone()));
        let mut m = Map::new();
        m.insert("name".into(), json!(x.name));
        in_vhost(&mut m, &x.vhost);
        m.insert("type".into(), json!(x.kind));
        m.insert("durable".into(), json!(x.durable));
        m.insert("auto_delete".into(), json!(x.auto_delete));
        m.insert("internal".into(), json!(x.internal));
        m.insert("arguments".into(), Value::Object(table_json(&x.arguments)));
        exchanges.push(Value::Object(m));
    }
    let mut bindings = Vec::new();
    for bv in b.binding_views(vhost) {
        // The default exchange's implicit bindings are not definitions.
        if bv.source.is_empty() {
            continue;
        }
        let source_kept = exported_exchanges.contains(&(bv.vhost.clone(), bv.source.clone()))
            || predeclared(&bv.source);
        let dest = (bv.vhost.clone(), bv.destination.clone());
        let dest_kept = if bv.destination_is_queue {
            exported_queues.contains(&dest)
        } else {
            exported_exchanges.contains(&dest) || predeclared(&bv.destination)
        };
        if !source_kept || !dest_kept {
            continue;
        }
        let mut m = Map::new();
        m.insert("source".into(), json!(bv.source));
        in_vhost(&mut m, &bv.vhost);
        m.insert("destination".into(), json!(bv.destination));
        let kind = if bv.destination_is_queue {
            "queue"
        } else {
            "exchange"
        };
        m.insert("destination_type".into(), json!(kind));
        m.insert("routing_key".into(), json!(bv.routing_key));
        m.insert("arguments".into(), Value::Object(table_json(&bv.arguments)));
        bindings.push(Value::Object(m));
    }
    let mut doc = Map::new();
    doc.insert("rabbit_version".into(), json!("3.10.8"));
    doc.insert("rabbitmq_version".into(), json!("3.10.8"));
    doc.insert("product_name".into(), json!("Warren"));
    doc.insert("product_version".into(), json!(env!("CARGO_PKG_VERSION")));
    // Vhost limits travel as RabbitMQ's runtime parameters (component "vhost-limits").
    let parameters: Vec<Value> = b
        .vhost_limits()
        .iter()
        .filter(|(v, _)| vhost.is_none_or(|only| only == v))
        .map(|(v, limits)| {
            json!({
                "value": super::limits::limits_json(limits),
                "vhost": v,
                "component": "vhost-limits",
                "name": "limits",
            })
        })
        .collect();
    if vhost.is_none() {
        // The same JSON as GET /api/users (RabbitMQ's export has the same fields).
        let user_limits = b.user_limits();
        let users: Vec<Value> = b
            .users()
            .iter()
            .map(|(name, u)| super::users::user_json(name, u, &user_limits))
            .collect();
        let vhosts: Vec<Value> = b
            .vhost_infos()
            .iter()
            .map(|v| {
                json!({
                    "name": v.name,
                    "limits": [],
                    "metadata": {"description": v.description, "tags": v.tags},
                })
            })
            .collect();
        let permissions: Vec<Value> = b
            .permission_list()
            .iter()
            .map(|(u, v, p)| {
                json!({
                    "user": u, "vhost": v,
                    "configure": p.configure, "write": p.write, "read": p.read,
                })
            })
            .collect();
        doc.insert("users".into(), Value::Array(users));
        doc.insert("vhosts".into(), Value::Array(vhosts));
        doc.insert("permissions".into(), Value::Array(permissions));
        let topic: Vec<Value> = b
            .topic_permission_list()
            .iter()
            .map(|(u, v, x, p)| {
                json!({"user": u, "vhost": v, "exchange": x, "write": p.write, "read": p.read})
            })
            .collect();
        doc.insert("topic_permissions".into(), Value::Array(topic));
        doc.insert("global_parameters".into(), json!([]));
    }
    doc.insert("parameters".into(), Value::Array(parameters));
    doc.insert("policies".into(), json!([]));
    doc.insert("queues".into(), Value::Array(queues));
    doc.insert("exchanges".into(), Value::Array(exchanges));
    doc.insert("bindings".into(), Value::Array(bindings));
    Value::Object(doc)
}

/// The list `key` of a definitions document (absent: none).
fn list<'a>(doc: &'a Map<String, Value>, key: &str) -> Result<&'a [Value], String> {
    match doc.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(format!("'{key}' must be a list")),
    }
}

fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, String> {
    v.as_object()
        .ok_or_else(|| format!("each of '{what}' must be an object"))
}

fn string(m: &Map<String, Value>, key: &str, what: &str) -> Result<String, String> {
    match m.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(format!(
            "a {what} needs '{key}' (a string): {}",
            Value::Object(m.clone())
        )),
    }
}

fn optional_string(m: &Map<String, Value>, key: &str) -> Result<Option<String>, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("'{key}' must be a string")),
    }
}

fn boolean(m: &Map<String, Value>, key: &str) -> Result<bool, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        // Older exports (and hand-written files) say "true".
        Some(Value::String(s)) if s == "true" || s == "false" => Ok(s == "true"),
        Some(_) => Err(format!("'{key}' must be true or false")),
    }
}

/// Tags as RabbitMQ writes them: a list (3.9 and later) or a comma-separated string.
fn tags(v: Option<&Value>) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        let t = t.trim();
        if !t.is_empty() && !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    };
    match v {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => s.split(',').for_each(&mut add),
        Some(Value::Array(a)) => {
            for t in a {
                add(t.as_str().ok_or("tags must be strings")?);
            }
        }
        Some(_) => return Err("tags must be a string or a list".into()),
    }
    Ok(out)
}

/// Limits as RabbitMQ writes them: an object of name to integer (an empty list: none).
fn limit_list(v: &Value) -> Result<Vec<(String, i64)>, String> {
    let mut out = Vec::new();
    match v {
        Value::Null => {}
        Value::Array(a) if a.is_empty() => {}
        Value::Object(m) => {
            for (k, v) in m {
                let n = v
                    .as_i64()
                    .ok_or_else(|| format!("limit {k} should be a number, actually was {v}"))?;
                out.push((k.clone(), n));
            }
        }
        _ => return Err("limits must be an object".into()),
    }
    out.sort();
    Ok(out)
}

fn arguments(m: &Map<String, Value>) -> Result<amq_protocol::types::FieldTable, String> {
    match m.get("arguments") {
        None | Some(Value::Null) => Ok(Default::default()),
        Some(Value::Object(a)) => Ok(json_table(a)),
        Some(_) => Err("'arguments' must be an object".into()),
    }
}

/// Import `doc` into the broker: users, vhosts, permissions, exchanges, queues, bindings, in
/// that order (RabbitMQ's); into vhost `only` when given (then only its exchanges, queues and
/// bindings, whose entries name no vhost); the importing user gets no permissions of their
/// own (RabbitMQ). Parsed whole first: a malformed document changes nothing. As RabbitMQ 3.10
/// does, a queue or exchange not equivalent to the one there is left as it is, and a binding
/// whose end is missing is left out (each logged); anything else refused stops the import,
/// with why, and what came before it stays.
pub(crate) fn import_steps(
    doc: &Map<String, Value>,
    only: Option<&str>,
) -> Result<Vec<ImportStep>, String> {
    let mut steps = Vec::new();
    let op = |op: Op, what: String| ImportStep::Op { op, what };
    if only.is_none() {
        for u in list(doc, "users")? {
            let u = object(u, "users")?;
            let name = string(u, "name", "user")?;
            if let Some(alg) = optional_string(u, "hashing_algorithm")? {
                if alg != SHA256 {
                    return Err(format!(
                        "user {name}: hashing_algorithm {alg} is not supported: only {SHA256}"
                    ));
                }
            }
            let password_hash = match (
                optional_string(u, "password_hash")?,
                optional_string(u, "password")?,
            ) {
                (Some(h), _) => h,
                (None, Some(p)) => crate::broker::users::hash_password(&p, rand::random()),
                (None, None) => String::new(),
            };
            let tags = tags(u.get("tags"))?;
            let put = Op::PutUser {
                name: name.clone(),
                password_hash,
                tags,
            };
            steps.push(op(put, format!("user {name}")));
            if let Some(l) = u.get("limits").filter(|l| !l.is_null()) {
                let limits = limit_list(l).map_err(|e| format!("user {name}: {e}"))?;
                let put = Op::PutUserLimits {
                    user: name.clone(),
                    limits,
                };
                steps.push(op(put, format!("user {name}")));
            }
        }
        for v in list(doc, "vhosts")? {
            let v = object(v, "vhosts")?;
            let name = string(v, "name", "vhost")?;
            let meta = v.get("metadata").and_then(Value::as_object);
            let description = optional_string(v, "description")?
                .or(meta
                    .map(|m| optional_string(m, "description"))
                    .transpose()?
                    .flatten())
                .unwrap_or_default();
            let tags = match v.get("tags") {
                Some(t) if !t.is_null() => tags(Some(t))?,
                _ => tags(meta.and_then(|m| m.get("tags")))?,
            };
            let put = Op::PutVhost {
                name: name.clone(),
                description,
                tags,
            };
            steps.push(op(put, format!("vhost {name}")));
        }
        for p in list(doc, "permissions")? {
            let p = object(p, "permissions")?;
            let (user, vhost) = (
                string(p, "user", "permission")?,
                string(p, "vhost", "permission")?,
            );
            let mut exprs = Vec::new();
            for key in ["configure", "write", "read"] {
                let e = string(p, key, "permission")?;
                // RabbitMQ's expressions are PCRE: one with look-around or a backreference
                // (valid there) is kept as written and allows nothing here, said in the log,
                // rather than stop the import (or the start, with --load-definitions).
                if let Err(why) = crate::broker::permissions::check(&e) {
                    tracing::warn!(
                        %user, %vhost, permission = key, expression = %e, %why,
                        "definitions: a permission expression Warren cannot evaluate allows nothing"
                    );
                }
                exprs.push(e);
            }
            let [configure, write, read] = <[String; 3]>::try_from(exprs).unwrap_or_default();
            let what = format!("permission of {user} in {vhost}");
            let set = Op::SetPermissions {
                user,
                vhost,
                configure,
                write,
                read,
            };
            steps.push(op(set, what));
        }
        for p in list(doc, "topic_permissions")? {
            let p = object(p, "topic_permissions")?;
            let (user, vhost) = (
                string(p, "user", "topic permission")?,
                string(p, "vhost", "topic permission")?,
            );
            let what = format!("topic permission of {user} in {vhost}");
            let set = Op::SetTopicPermissions {
                user,
                vhost,
                exchange: string(p, "exchange", "topic permission")?,
                write: string(p, "write", "topic permission")?,
                read: string(p, "read", "topic permission")?,
            };
            steps.push(op(set, what));
        }
    }
    // Vhost limits, RabbitMQ's "vhost-limits" runtime parameters (other parameters are not
    // served: left out).
    for p in list(doc, "parameters")? {
        let p = object(p, "parameters")?;
        if optional_string(p, "component")?.as_deref() != Some("vhost-limits") {
            continue;
        }
        let vhost = match only {
            Some(v) => v.to_string(),
            None => string(p, "vhost", "parameter")?,
        };
        let limits = limit_list(p.get("value").unwrap_or(&Value::Null))
            .map_err(|e| format!("limits of vhost {vhost}: {e}"))?;
        let what = format!("limits of vhost {vhost}");
        steps.push(op(Op::PutVhostLimits { vhost, limits }, what));
    }
    let vhost_of = |m: &Map<String, Value>, what: &str| -> Result<String, String> {
        match only {
            Some(v) => Ok(v.to_string()),
            None => string(m, "vhost", what),
        }
    };
    for x in list(doc, "exchanges")? {
        let x = object(x, "exchanges")?;
        let (name, vhost) = (string(x, "name", "exchange")?, vhost_of(x, "exchange")?);
        if predeclared(&name) {
            continue;
        }
        let decl = ExchangeDeclare {
            name,
            kind: optional_string(x, "type")?.unwrap_or_else(|| "direct".into()),
            passive: false,
            durable: boolean(x, "durable")?,
            auto_delete: boolean(x, "auto_delete")?,
            internal: boolean(x, "internal")?,
            arguments: arguments(x)?,
        };
        steps.push(ImportStep::Exchange { vhost, decl });
    }
    for q in list(doc, "queues")? {
        let q = object(q, "queues")?;
        let (name, vhost) = (string(q, "name", "queue")?, vhost_of(q, "queue")?);
        let decl = QueueDeclare {
            name,
            passive: false,
            durable: boolean(q, "durable")?,
            exclusive: false,
            auto_delete: boolean(q, "auto_delete")?,
            arguments: arguments(q)?,
        };
        steps.push(ImportStep::Queue { vhost, decl });
    }
    for x in list(doc, "bindings")? {
        let x = object(x, "bindings")?;
        let vhost = vhost_of(x, "binding")?;
        let source = string(x, "source", "binding")?;
        let destination = string(x, "destination", "binding")?;
        let key = optional_string(x, "routing_key")?.unwrap_or_default();
        let arguments = arguments(x)?;
        let to_queue = match optional_string(x, "destination_type")?.as_deref() {
            Some("queue") | None => true,
            Some("exchange") => false,
            Some(other) => {
                return Err(format!(
                    "binding of {source} to {destination} in vhost {vhost}: unknown destination_type {other}"
                ))
            }
        };
        steps.push(ImportStep::Binding {
            vhost,
            source,
            destination,
            to_queue,
            key,
            arguments,
        });
    }
    Ok(steps)
}

async fn export_response(shared: &crate::node::Shared, vhost: Option<&str>) -> Response {
    if let Some(v) = vhost {
        if !shared.query(|b| b.has_vhost(v)) {
            return super::not_found();
        }
    }
    Json(shared.query(|b| export(b, vhost))).into_response()
}

/// GET /api/definitions (administrators).
pub(super) async fn get_all(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    export_response(&shared, None).await
}

/// GET /api/definitions/{vhost} (administrators).
pub(super) async fn get_vhost(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(vhost): Path<String>,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    export_response(&shared, Some(&vhost)).await
}

async fn import_response(
    shared: &std::sync::Arc<crate::node::Shared>,
    me: &str,
    only: Option<&str>,
    body: &axum::body::Bytes,
) -> Response {
    let doc = match body_object(body) {
        Ok(m) => m,
        Err(reason) => return bad_request(&reason),
    };
    if let Some(v) = only {
        if !shared.query(|b| b.has_vhost(v)) {
            return super::not_found();
        }
    }
    let steps = match import_steps(&doc, only) {
        Ok(steps) => steps,
        Err(why) => {
            let e = AmqpError::connection(ReplyCode::PreconditionFailed, why);
            return ChangeError::Refused(e).into_response();
        }
    };
    no_content(change(shared, me, only.unwrap_or(""), Cmd::Import(steps)).await)
}

/// POST /api/definitions: import (204), or 400 with the first refusal.
pub(super) async fn post_all(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    import_response(&shared, &me, None, &body).await
}

/// POST /api/definitions/{vhost}: import a vhost's exchanges, queues and bindings into it.
pub(super) async fn post_vhost(
    State(shared): Api,
    Extension(Login(me)): Extension<Login>,
    Path(vhost): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if !is_administrator(&shared, &me) {
        return not_administrator();
    }
    import_response(&shared, &me, Some(&vhost), &body).await
}

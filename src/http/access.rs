//! Who sees and changes what through the API, as RabbitMQ 3.10's management plugin decides
//! it: by the user's tags (administrator and monitoring see every vhost in the vhost list and
//! the overview, and every connection; management and policymaker only the vhosts they have
//! permissions on, and their own connections); the queues, exchanges and bindings of a vhost
//! only with permissions there (monitoring users too), or as an administrator; and by their
//! permissions for every change of a queue, exchange or binding (RabbitMQ makes those changes
//! as AMQP methods of the user, so the access-control table applies to administrators too).

use super::Login;
use crate::node::Shared;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::collections::BTreeSet;

/// What one logged-in user may see.
pub(super) struct Viewer {
    pub user: String,
    pub admin: bool,
    /// Administrator or monitoring: every vhost, every connection.
    pub sees_all: bool,
    /// The vhosts they have permissions on (for the others).
    vhosts: BTreeSet<String>,
}

impl Viewer {
    pub fn of(shared: &Shared, Login(user): &Login) -> Viewer {
        shared.query(|b| {
            let tags = b.user(user).map(|u| u.tags.clone()).unwrap_or_default();
            let has = |t: &str| tags.iter().any(|x| x == t);
            Viewer {
                user: user.clone(),
                admin: has("administrator"),
                sees_all: has("administrator") || has("monitoring"),
                vhosts: b
                    .permission_list()
                    .into_iter()
                    .filter(|(u, _, _)| u == user)
                    .map(|(_, v, _)| v)
                    .collect(),
            }
        })
    }

    /// Whether `vhost` is theirs to see in the vhost list and the overview.
    pub fn sees(&self, vhost: &str) -> bool {
        self.sees_all || self.vhosts.contains(vhost)
    }

    /// Whether the queues, exchanges and bindings of `vhost` are theirs to see (RabbitMQ: the
    /// vhosts they may log in to, also for monitoring users; administrators all).
    pub fn sees_objects_in(&self, vhost: &str) -> bool {
        self.admin || self.vhosts.contains(vhost)
    }

    /// Whether a connection of `user` is theirs to see.
    pub fn sees_connection_of(&self, user: &str) -> bool {
        self.sees_all || self.user == user
    }
}

/// RabbitMQ's answer to a request about another user's connection.
pub(super) fn not_authorised_object() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({
            "error": "not_authorised",
            "reason": "User not authorised to access object",
        })),
    )
        .into_response()
}

/// RabbitMQ's answer to a request about a vhost the user may not see.
pub(super) fn not_authorised_vhost() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({
            "error": "not_authorised",
            "reason": "User not authorised to access virtual host",
        })),
    )
        .into_response()
}

/// The vhost a request's path names, for the endpoints of a vhost's queues, exchanges and
/// bindings (`/api/queues/{vhost}...`); the others check their own.
pub(super) fn path_vhost(path: &str) -> Option<String> {
    let rest = path.strip_prefix("/api/")?;
    let mut parts = rest.split('/');
    match parts.next()? {
        "queues" | "exchanges" | "bindings" => {
            let raw = parts.next()?;
            percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .ok()
                .map(|s| s.into_owned())
        }
        _ => None,
    }
}

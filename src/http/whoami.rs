//! `/api/whoami`: the logged-in user and their tags.

use super::{Api, Login};
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

pub(super) async fn whoami(
    State(shared): Api,
    Extension(Login(user)): Extension<Login>,
) -> Response {
    let tags = shared
        .query(|b| b.user(&user).map(|u| u.tags.clone()))
        .unwrap_or_default();
    Json(json!({"name": user, "tags": tags})).into_response()
}

//! `/api/whoami`: the logged-in user.

use super::Login;
use axum::extract::Extension;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

pub(super) async fn whoami(Extension(Login(user)): Extension<Login>) -> Response {
    Json(json!({"name": user, "tags": ["administrator"]})).into_response()
}

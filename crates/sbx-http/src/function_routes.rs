//! `POST /v1/functions/{function_id}`: the functions interface over HTTP.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::functions::FnError;
use serde_json::{json, Value};

use crate::functions::{error_body, invoke};
use crate::{read_body, AppState, RequestId};

pub(super) async fn call(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    Path(function_id): Path<String>,
    body: Body,
) -> Result<Json<Value>, CallFailed> {
    let r = async {
        let bytes = read_body(body).await.map_err(FnError::from)?;
        let payload = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice::<Value>(&bytes)
                .map_err(|_| FnError::invalid("the payload is not a JSON object"))?
        };
        invoke(&st.node, &rid.0, &function_id, payload).await
    }
    .await;
    r.map(Json).map_err(|e| {
        tracing::info!(request_id = %rid.0, function = %function_id, code = e.code.code, message = %e.message, "function failed");
        CallFailed(e)
    })
}

/// A failed call, answered in the functions interface's own shape (not the API's error body):
/// `{"error": {code, type, message, retryable, docs_url}}` with the status of its S-code's
/// kind, and `Retry-After: 1` when it is worth retrying.
pub(super) struct CallFailed(FnError);

impl IntoResponse for CallFailed {
    fn into_response(self) -> Response {
        let e = self.0;
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(json!({ "error": error_body(&e) }))).into_response();
        if e.code.retryable {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        resp
    }
}

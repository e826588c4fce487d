//! The control plane's own calls to a node (a move's release, takeover and forget; a look at a
//! sandbox before a move): a JSON body out, the answer read whole (at most 16 MiB), a deadline
//! for the whole call, over the pooled client of the proxy. Each carries a request id of its
//! own and, where the fleet has keys, one of the control plane's (the fleet shares one file).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, Method, Request, Uri};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};

use crate::proxy::NodeClient;

/// How long a release or a takeover may take (a big sandbox's disk and memory go through the
/// store: minutes).
pub const MOVE_CALL_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a look at a sandbox or a forget may take.
pub const SHORT_CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The most bytes of an answer read.
const MAX_ANSWER: usize = 16 << 20;

/// Why a node gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{0} is not a URL")]
    Uri(String),
    #[error("could not build the request: {0}")]
    Request(#[from] axum::http::Error),
    #[error("{0}")]
    Send(#[from] hyper_util::client::legacy::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("its answer broke off: {0}")]
    Body(String),
}

/// A node's answer: its status and body (JSON, or `Null` when it is not JSON).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl Answer {
    pub fn ok(&self) -> bool {
        self.status == 200
    }

    /// The answer's error code (`error.code` of the spec's body).
    pub fn code(&self) -> Option<&str> {
        self.body.pointer("/error/code").and_then(Value::as_str)
    }

    /// The error object of a failed answer (its `error`, with what the node set beside it),
    /// or one that says what came when the body is not the spec's.
    pub fn error(&self) -> Value {
        match self.body.get("error") {
            Some(Value::Object(e)) => {
                let mut e = e.clone();
                if let Value::Object(all) = &self.body {
                    for (k, v) in all {
                        if k != "error" {
                            e.entry(k.clone()).or_insert_with(|| v.clone());
                        }
                    }
                }
                Value::Object(e)
            }
            _ => own_error(
                "unavailable",
                &format!("the node answered {} without an error body", self.status),
                true,
            ),
        }
    }
}

/// An error object of the control plane's own, of the spec's error body's shape.
pub fn own_error(code: &str, message: &str, retryable: bool) -> Value {
    let kind = sbx_api::ErrorCode::from_code(code)
        .map(|c| c.error_type())
        .unwrap_or(code);
    json!({
        "type": kind,
        "code": code,
        "message": message,
        "param": null,
        "retryable": retryable,
        "request_id": null,
        "docs_url": null,
    })
}

/// `method` `node_url``path` with `body` (JSON) and the control plane's key, within `timeout`.
pub async fn call(
    client: &NodeClient,
    key: Option<&str>,
    node_url: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Answer, CallError> {
    let url = format!("{}{path}", node_url.trim_end_matches('/'));
    let uri: Uri = url.parse().map_err(|_| CallError::Uri(url.clone()))?;
    let mut b = Request::builder()
        .method(method)
        .uri(uri)
        .header("x-request-id", sbx_api::ids::new_request_id());
    if let Some(k) = key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = match body {
        Some(v) => b
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(v.to_string()))?,
        None => b.body(Body::empty())?,
    };
    let work = async {
        let resp = client.request(req).await?;
        let status = resp.status().as_u16();
        let bytes: Bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| CallError::Body(e.to_string()))?
            .to_bytes();
        Ok::<_, CallError>(Answer {
            status,
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| CallError::Timeout(timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answers_error_keeps_what_is_beside_it() {
        let a = Answer {
            status: 409,
            body: json!({"error": {"code": "build_missing", "message": "m"}, "build": "abc"}),
        };
        assert_eq!(a.code(), Some("build_missing"));
        assert_eq!(a.error()["build"], "abc");
        let b = Answer {
            status: 502,
            body: Value::Null,
        };
        assert_eq!(b.code(), None);
        assert_eq!(b.error()["code"], "unavailable");
        assert_eq!(own_error("cancelled", "x", false)["type"], "cancelled");
        assert_eq!(own_error("unavailable", "x", true)["type"], "unavailable");
    }
}

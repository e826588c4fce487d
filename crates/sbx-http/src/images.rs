//! The node's images over HTTP: `GET /v1/images` (the base image and every pulled one, with
//! digest, references and size) and `POST /v1/images/pull` `{image, image_pull_secret?}`, which
//! answers an event stream: `progress` {layer, done, total} while layers come, then `done`
//! {digest, reference, layers} or `error` {code, message} (code: `registry_auth_failed`,
//! `invalid_image`, `image_pull_failed`). A refusal before the pull starts (a bad reference, a
//! secret that cannot be used) is an ordinary error answer.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use axum::{Extension, Json};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::image::{ImageStore, Source};
use crate::{read_body, AppState, HttpResult, RequestId};

pub(super) async fn list(State(st): State<Arc<AppState>>) -> Json<Value> {
    let images = st.node.images.clone();
    let all = tokio::task::spawn_blocking(move || images.list())
        .await
        .unwrap_or_default();
    Json(json!({ "object": "list", "data": all }))
}

/// What a pull request asks.
struct PullRequest {
    image: String,
    secret: Option<String>,
}

fn parse(bytes: &[u8]) -> Result<PullRequest, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("the body is not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidJson, "the body is not a JSON object"))?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["image", "image_pull_secret"].contains(&k.as_str()))
    {
        return Err(
            ApiError::new(ErrorCode::UnknownField, format!("unknown field {k}")).with_param(k),
        );
    }
    let image = match obj.get("image") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 512 => s.clone(),
        _ => {
            return Err(ApiError::new(
                ErrorCode::InvalidImage,
                "image must be an image reference of 1 to 512 characters",
            )
            .with_param("image"))
        }
    };
    let secret = match obj.get("image_pull_secret") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 128 => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "image_pull_secret",
                "image_pull_secret must be a secret's name of 1 to 128 bytes",
            ))
        }
    };
    if ImageStore::is_catalog(Some(&image)) {
        return Err(ApiError::new(
            ErrorCode::InvalidImage,
            format!("{image} is a catalog name (the base image), not a registry's image"),
        )
        .with_param("image"));
    }
    sbx_image::parse_reference(&image)
        .map_err(|e| ApiError::new(ErrorCode::InvalidImage, e.to_string()).with_param("image"))?;
    Ok(PullRequest { image, secret })
}

enum Event {
    Progress(sbx_image::Progress),
    Done(Value),
    Error(Value),
}

pub(super) async fn pull(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    body: Body,
) -> HttpResult<Response> {
    let bytes = read_body(body).await?;
    let req = parse(&bytes)?;
    let (reference, creds) = match &req.secret {
        Some(secret) => match st.node.image_login(Some(&req.image), secret)? {
            (creds, Source::Remote(r)) => (r, Some(creds)),
            (creds, Source::Local(i)) => (i.meta.name, Some(creds)),
        },
        None => {
            let r = sbx_image::parse_reference(&req.image).map_err(|e| {
                ApiError::new(ErrorCode::InvalidImage, e.to_string()).with_param("image")
            })?;
            (r.to_string(), None)
        }
    };
    tracing::info!(request_id = %rid.0, image = %reference, "pull");
    let (tx, rx) = mpsc::channel::<Event>(256);
    let images = st.node.images.clone();
    let node = st.node.clone();
    tokio::spawn(async move {
        let progress_tx = tx.clone();
        let progress = move |p: sbx_image::Progress| {
            // Progress that does not fit is dropped: the next one says more.
            let _ = progress_tx.try_send(Event::Progress(p));
        };
        let ev = match images.pull(&reference, creds.as_ref(), &progress).await {
            Ok(img) => {
                let digest = img.oci.as_ref().map(|o| o.digest.clone());
                // Templates built of an older image of this reference go: the next sandbox
                // of their settings builds one of what was pulled now.
                let forgotten = digest
                    .as_deref()
                    .map(|d| node.forget_moved_templates(&reference, d))
                    .unwrap_or(0);
                Event::Done(json!({
                    "reference": reference,
                    "digest": digest,
                    "layers": img.lowers.len(),
                    "templates_forgotten": forgotten,
                }))
            }
            Err(e) => {
                tracing::info!(image = %reference, error = %e, "pull failed");
                Event::Error(json!({ "code": e.code(), "message": e.to_string() }))
            }
        };
        let _ = tx.send(ev).await;
    });
    let stream = futures_util::stream::unfold((rx, 0u64, false), |(mut rx, id, end)| async move {
        if end {
            return None;
        }
        let (kind, data, end) = match rx.recv().await {
            Some(Event::Progress(p)) => (
                "progress",
                json!({ "layer": p.layer, "done": p.done, "total": p.total }),
                false,
            ),
            Some(Event::Done(v)) => ("done", v, true),
            Some(Event::Error(v)) => ("error", v, true),
            None => (
                "error",
                json!({ "code": "internal", "message": "the pull ended without an answer" }),
                true,
            ),
        };
        let chunk = sbx_api::sse_event(kind, id, &data);
        Some((Ok::<_, Infallible>(Bytes::from(chunk)), (rx, id + 1, end)))
    });
    Ok(crate::event_stream_answer(Body::from_stream(stream)))
}

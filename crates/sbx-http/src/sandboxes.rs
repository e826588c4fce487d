//! HTTP routes of long-lived sandboxes and their commands. Parse, then call the node.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::{
    ApiError, Encoding, ErrorCode, ExecObject, ExecStatus, SandboxObject, SandboxStatus,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::node::sandbox::ListQuery;
use crate::node::RunEvent;
use crate::store::IdemBegin;
use crate::{event_stream, read_body, AppState, HttpError, HttpResult, RequestId, Started};

type St = State<Arc<AppState>>;
type Rid = Extension<RequestId>;

/// Refuses query parameters a call does not take.
fn only_params(q: &HashMap<String, String>, known: &[&str]) -> Result<(), ApiError> {
    match q
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !k.starts_with("metadata."))
    {
        Some(k) => Err(ApiError::new(
            ErrorCode::UnknownParameter,
            format!("this call takes no parameter {k}"),
        )
        .with_param(k.clone())),
        None => Ok(()),
    }
}

fn param_f64(q: &HashMap<String, String>, key: &str, max: f64) -> Result<f64, ApiError> {
    match q.get(key) {
        None => Ok(0.0),
        Some(v) => match v.parse::<f64>() {
            Ok(n) if (0.0..=max).contains(&n) => Ok(n),
            _ => Err(ApiError::invalid_field(
                key,
                format!("{key} must be a number from 0 to {max}"),
            )),
        },
    }
}

fn param_u64(q: &HashMap<String, String>, key: &str) -> Result<Option<u64>, ApiError> {
    q.get(key)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| ApiError::invalid_field(key, format!("{key} must be a position")))
        })
        .transpose()
}

fn param_encoding(q: &HashMap<String, String>) -> Result<Encoding, ApiError> {
    match q.get("encoding").map(String::as_str) {
        None | Some("utf8") => Ok(Encoding::Utf8),
        Some("base64") => Ok(Encoding::Base64),
        Some(_) => Err(ApiError::invalid_field(
            "encoding",
            "encoding must be utf8 or base64",
        )),
    }
}

fn wants_stream(headers: &HeaderMap, q: Option<bool>) -> bool {
    q.unwrap_or_else(|| crate::accepts_event_stream(headers))
}

/// Runs `f` under the request's Idempotency-Key, if it has one: the same key and body replay
/// the first answer; another body is 409 idempotency_key_reused; a first request still running
/// is 409 idempotency_in_progress. Answers that are worth retrying (5xx, 409 in progress) are
/// not kept.
pub(super) async fn idempotent<F, Fut>(
    st: &AppState,
    rid: &RequestId,
    headers: &HeaderMap,
    scope: &str,
    body: &[u8],
    f: F,
) -> HttpResult<Response>
where
    F: FnOnce(Option<String>) -> Fut,
    Fut: std::future::Future<Output = (StatusCode, Result<Value, ApiError>)>,
{
    idempotent_with(st, rid, headers, scope, body, f, |_| {}).await
}

/// [`idempotent`], with `shown` adding to a successful answer what its record must not keep
/// (a sandbox's token), fresh or replayed.
async fn idempotent_with<F, Fut>(
    st: &AppState,
    rid: &RequestId,
    headers: &HeaderMap,
    scope: &str,
    body: &[u8],
    f: F,
    shown: impl Fn(&mut Value),
) -> HttpResult<Response>
where
    F: FnOnce(Option<String>) -> Fut,
    Fut: std::future::Future<Output = (StatusCode, Result<Value, ApiError>)>,
{
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v.to_str().unwrap_or("");
            sbx_api::validate_idempotency_key(k)?;
            Some(k.to_string())
        }
    };
    let Some(key) = key else {
        let (status, r) = f(None).await;
        let mut v = r?;
        shown(&mut v);
        return Ok((status, Json(v)).into_response());
    };
    let hash = hex(&Sha256::digest(body));
    match st.node.idem_begin(scope, &key, &hash) {
        Err(e) => {
            tracing::error!(error = %e, "idempotency");
            Err(ApiError::internal().into())
        }
        Ok(IdemBegin::Reused) => Err(ApiError::new(
            ErrorCode::IdempotencyKeyReused,
            "this Idempotency-Key was used with another request",
        )
        .with_param("Idempotency-Key")
        .into()),
        Ok(IdemBegin::InProgress) => Err(ApiError::new(
            ErrorCode::IdempotencyInProgress,
            "the first request with this Idempotency-Key is still running",
        )
        .with_param("Idempotency-Key")
        .into()),
        Ok(IdemBegin::Replay { status, body }) => {
            let mut v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            // An error replayed is the same error, with this request's id.
            if let Some(e) = v.get_mut("error").and_then(Value::as_object_mut) {
                e.insert("request_id".into(), json!(rid.0));
            }
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
            if status.is_success() {
                shown(&mut v);
            }
            Ok((status, Json(v)).into_response())
        }
        Ok(IdemBegin::Fresh) => {
            let (status, r) = f(Some(key.clone())).await;
            // A refusal worth retrying (too_many_commands, ...) is not kept either: the retry
            // with the same key must run the request, not replay the refusal.
            let retryable = r.as_ref().err().is_some_and(|e| e.retryable());
            let status = match &r {
                Ok(_) => status,
                Err(e) => {
                    StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                }
            };
            if status.is_server_error() || retryable {
                let _ = st.node.idem_forget(scope, &key);
            } else {
                // The record keeps the answer, or the error's body as the edge writes it.
                let kept = match &r {
                    Ok(v) => v.to_string(),
                    Err(e) => sbx_api::error_body(e, &rid.0, st.docs_url.as_deref()).to_string(),
                };
                if let Err(e) = st.node.idem_finish(scope, &key, status.as_u16(), &kept) {
                    tracing::error!(error = %e, "idempotency record");
                }
            }
            match r {
                Ok(mut v) => {
                    shown(&mut v);
                    Ok((status, Json(v)).into_response())
                }
                // Every 503 of a call with a key says when to retry, the code's retryable or
                // not.
                Err(e) if status == StatusCode::SERVICE_UNAVAILABLE => Err(HttpError::from(e)
                    .with_header(header::RETRY_AFTER, header::HeaderValue::from_static("1"))),
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// An answer object as JSON (for `idempotent`, which keeps it).
fn to_json<T: serde::Serialize>(o: T) -> Result<Value, ApiError> {
    serde_json::to_value(o).map_err(crate::internal("an answer as JSON"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) async fn create(
    State(st): St,
    Extension(rid): Rid,
    headers: HeaderMap,
    body: Body,
) -> HttpResult<Response> {
    let bytes = read_body(body).await?;
    let node = st.node.clone();
    let body2 = bytes.clone();
    // The token is in the answer, not in the idempotency record (a replay adds it again).
    idempotent_with(
        &st,
        &rid,
        &headers,
        "POST /v1/sandboxes",
        &body2,
        |_| async move {
            let c = match sbx_api::parse_sandbox_create(&bytes) {
                Ok(c) => c,
                Err(e) => return (StatusCode::BAD_REQUEST, Err(e)),
            };
            let r = node.create_sandbox(c).await;
            (StatusCode::CREATED, r.and_then(to_json))
        },
        |v| with_token(&st, v),
    )
    .await
}

/// A sandbox object as `POST /v1/sandboxes` and `GET /v1/sandboxes/{id}` answer it: with its
/// `token` (never in the list, the records of Idempotency-Keys or a log line).
fn with_token(st: &AppState, v: &mut Value) {
    let Some(id) = v.get("id").and_then(Value::as_str) else {
        return;
    };
    let token = match st.node.sandbox_token(id) {
        Ok(Some(t)) => json!(t.reveal()),
        _ => Value::Null,
    };
    if let Some(o) = v.as_object_mut() {
        o.insert("token".into(), token);
    }
}

/// `POST /internal/templates`: a template built ahead (200 when it is built or failed, 202
/// while it builds).
pub(super) async fn build_template(
    State(st): St,
    body: Body,
) -> HttpResult<(StatusCode, Json<sbx_api::TemplateObject>)> {
    let bytes = read_body(body).await?;
    let c = sbx_api::parse_sandbox_create(&bytes)?;
    let (built, v) = st.node.build_template(c).await?;
    let status = if built {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(v)))
}

/// `GET /internal/templates`: the node's templates, `base` first.
pub(super) async fn list_templates(State(st): St) -> Json<Value> {
    Json(json!({ "object": "list", "data": st.node.template_objects() }))
}

/// A `cursor` of the sandboxes' listing as `next_cursor` gives it: 20 digits (the creation
/// time), `.`, a sandbox id. Anything else is refused, not read as the first page.
fn list_cursor(c: &str) -> Result<String, ApiError> {
    let ok = c.split_once('.').is_some_and(|(t, id)| {
        t.len() == 20 && t.bytes().all(|b| b.is_ascii_digit()) && sbx_api::is_id("sbx", id)
    });
    if ok {
        Ok(c.to_string())
    } else {
        Err(ApiError::invalid_field(
            "cursor",
            "cursor must be a next_cursor of an earlier page",
        ))
    }
}

pub(super) async fn list(
    State(st): St,
    Query(q): Query<HashMap<String, String>>,
) -> HttpResult<Json<Value>> {
    only_params(&q, &["status", "limit", "cursor"])?;
    let status = match q.get("status") {
        None => None,
        Some(s) => Some(
            SandboxStatus::parse(s)
                .filter(|s| *s != SandboxStatus::Deleted)
                .ok_or_else(|| {
                    ApiError::invalid_field(
                        "status",
                        "status must be starting, running, stopping or failed",
                    )
                })?,
        ),
    };
    let limit = match q.get("limit") {
        None => 100,
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                return Err(ApiError::invalid_field("limit", "limit must be from 1 to 1000").into())
            }
        },
    };
    let mut metadata: Vec<(String, String)> = q
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("metadata.")
                .map(|k| (k.to_string(), v.clone()))
        })
        .collect();
    metadata.sort();
    let query = ListQuery {
        status,
        metadata,
        limit,
        cursor: q.get("cursor").map(|c| list_cursor(c)).transpose()?,
    };
    let (data, next) = st.node.list_sandboxes(&query);
    Ok(Json(
        json!({ "object": "list", "data": data, "has_more": next.is_some(), "next_cursor": next }),
    ))
}

pub(super) async fn get_one(State(st): St, Path(id): Path<String>) -> HttpResult<Json<Value>> {
    let mut v = to_json(st.node.sandbox(&id)?)?;
    with_token(&st, &mut v);
    Ok(Json(v))
}

/// `PATCH /v1/sandboxes/{id}`: `{"egress": {...}}` merged key by key.
pub(super) async fn patch(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Json<SandboxObject>> {
    let bytes = read_body(body).await?;
    let patch = sbx_api::parse_sandbox_patch(&bytes)?;
    Ok(Json(st.node.patch_sandbox(&id, patch)?))
}

pub(super) async fn delete(
    State(st): St,
    Path(id): Path<String>,
) -> HttpResult<Json<SandboxObject>> {
    Ok(Json(st.node.delete_sandbox(&id).await?))
}

pub(super) async fn restart(
    State(st): St,
    Extension(rid): Rid,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Response> {
    let bytes = read_body(body).await.unwrap_or_default();
    let node = st.node.clone();
    let scope = format!("POST /v1/sandboxes/{}/restart", sandbox_key(&st, &id));
    idempotent(&st, &rid, &headers, &scope, &bytes, |_| async move {
        let r = node.restart_sandbox(&id).await;
        (StatusCode::OK, r.and_then(to_json))
    })
    .await
}

/// The id of the sandbox a path names (by id or by name), for the scope of keys and derived
/// ids: one sandbox is one scope whichever way it is named, and a name given to another
/// sandbox later is another scope. The path as it is when no sandbox has it (a 404).
fn sandbox_key(st: &AppState, id_or_name: &str) -> String {
    st.node
        .sandbox_id(id_or_name)
        .unwrap_or_else(|| id_or_name.to_string())
}

/// The exec id a request with an Idempotency-Key gets: derived from the sandbox, the call and
/// the key, so a retry names the same command.
fn exec_id_for(sandbox: &str, call: &str, key: Option<&str>) -> Option<String> {
    let key = key?;
    let d = Sha256::digest(format!("{sandbox}\n{call}\n{key}").as_bytes());
    let mut seed = [0u8; 16];
    seed.copy_from_slice(&d[..16]);
    Some(sbx_api::derived_id("exe", &seed))
}

pub(super) async fn exec(
    State(st): St,
    Extension(rid): Rid,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Response> {
    let bytes = read_body(body).await?;
    let node = st.node.clone();
    let sid = sandbox_key(&st, &id);
    let scope = format!("POST /v1/sandboxes/{sid}/exec");
    let body2 = bytes.clone();
    idempotent(&st, &rid, &headers, &scope, &body2, |key| async move {
        let req = match sbx_api::parse_exec_request(&bytes) {
            Ok(r) => r,
            Err(e) => return (StatusCode::BAD_REQUEST, Err(e)),
        };
        let exec_id = exec_id_for(&sid, "exec", key.as_deref());
        let r = node.exec(&id, req, exec_id).await;
        (StatusCode::CREATED, r.and_then(to_json))
    })
    .await
}

/// `POST …/run`: starts a command and waits for it, as `/v1/run` does (JSON or events). A
/// caller that hangs up leaves the command running: it is the sandbox's.
pub(super) async fn run(
    State(st): St,
    Extension(rid): Rid,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Response> {
    let bytes = read_body(body).await?;
    let mut req = sbx_api::parse_exec_request(&bytes)?;
    let stream = wants_stream(&headers, req.stream);
    let encoding = req.encoding;
    req.wait_seconds = 0.0;
    let started = st.node.exec(&id, req, None).await?;
    if stream {
        let (meta, s, rx) = st
            .node
            .exec_output_events(&id, &started.id, 0, encoding)
            .await?;
        let (tx, rx2) = tokio::sync::mpsc::channel(64);
        tokio::spawn(forward_with_start(s, rx, tx));
        let docs = st.docs_url.clone();
        return Ok(event_stream(rx2, meta, Started::default(), 0, rid.0, docs));
    }
    loop {
        let o = st.node.exec_get(&id, &started.id, 60.0, encoding).await?;
        if o.status != ExecStatus::Running {
            return Ok(Json(o).into_response());
        }
    }
}

pub(super) async fn forward_with_start(
    started: Started,
    mut rx: tokio::sync::mpsc::Receiver<RunEvent>,
    tx: tokio::sync::mpsc::Sender<RunEvent>,
) {
    let first = RunEvent::Started {
        pid: started.pid,
        started_at_ns: started.started_at_ns,
    };
    if tx.send(first).await.is_err() {
        return;
    }
    while let Some(ev) = rx.recv().await {
        if tx.send(ev).await.is_err() {
            return;
        }
    }
}

pub(super) async fn exec_list(State(st): St, Path(id): Path<String>) -> HttpResult<Json<Value>> {
    let data = st.node.exec_list(&id).await?;
    Ok(Json(
        json!({ "object": "list", "data": data, "has_more": false }),
    ))
}

pub(super) async fn exec_get(
    State(st): St,
    Path((id, exec_id)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> HttpResult<Json<ExecObject>> {
    only_params(&q, &["wait_seconds", "encoding"])?;
    let wait = param_f64(&q, "wait_seconds", sbx_api::sandbox::MAX_WAIT_SECONDS)?;
    let enc = param_encoding(&q)?;
    Ok(Json(st.node.exec_get(&id, &exec_id, wait, enc).await?))
}

pub(super) async fn output(
    State(st): St,
    Extension(rid): Rid,
    headers: HeaderMap,
    Path((id, exec_id)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> HttpResult<Response> {
    let parsed = (|| {
        only_params(&q, &["from", "to", "encoding", "stream"])?;
        let resume = headers
            .get("last-event-id")
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                v.trim().parse::<u64>().map_err(|_| {
                    ApiError::invalid_field("Last-Event-ID", "Last-Event-ID must be a position")
                })
            })
            .transpose()?;
        let from = resume.or(param_u64(&q, "from")?).unwrap_or(0);
        let to = param_u64(&q, "to")?;
        let stream = match q.get("stream").map(String::as_str) {
            None => None,
            Some("true") => Some(true),
            Some("false") => Some(false),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    "stream",
                    "stream must be true or false",
                ))
            }
        };
        Ok((
            from,
            to,
            param_encoding(&q)?,
            wants_stream(&headers, stream),
        ))
    })();
    let (from, to, enc, stream) = parsed?;
    if stream {
        let (meta, started, rx) = st.node.exec_output_events(&id, &exec_id, from, enc).await?;
        let docs = st.docs_url.clone();
        return Ok(event_stream(rx, meta, started, from, rid.0, docs));
    }
    let (state, pieces, gap) = st.node.exec_output_range(&id, &exec_id, from, to).await?;
    let chunks: Vec<Value> = pieces
        .iter()
        .map(|(stream, pos, data)| {
            json!({
                "stream": if *stream == crate::node::output::Stream::Stderr { "stderr" } else { "stdout" },
                "position": pos,
                "data": enc.encode(data),
            })
        })
        .collect();
    let next = pieces
        .last()
        .map(|(_, p, d)| p + d.len() as u64)
        .or(gap.map(|(_, to)| to))
        .unwrap_or(from.max(state.output.start).min(state.output.end));
    Ok(Json(json!({
        "object": "output",
        "exec_id": exec_id,
        "from": from,
        "next": next,
        "start": state.output.start,
        "end": state.output.end,
        "gap": gap.map(|(a, b)| json!({ "from": a, "to": b })),
        "exited": state.exit.is_some(),
        "encoding": enc,
        "chunks": chunks,
    }))
    .into_response())
}

/// A JSON object body whose fields are all among `fields`.
pub(super) async fn json_object(
    body: Body,
    fields: &[&str],
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes = read_body(body).await?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body is not a JSON object: {e}"),
        )
    })?;
    let Value::Object(obj) = v else {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body is not a JSON object",
        ));
    };
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(ApiError::new(
            ErrorCode::UnknownField,
            format!("this call takes no field {k}"),
        )
        .with_param(k.clone()));
    }
    Ok(obj)
}

pub(super) async fn stdin(
    State(st): St,
    Path((id, exec_id)): Path<(String, String)>,
    body: Body,
) -> HttpResult<Json<Value>> {
    let obj = json_object(body, &["data", "encoding", "close"]).await?;
    let enc = match obj.get("encoding").and_then(Value::as_str) {
        None | Some("utf8") => Encoding::Utf8,
        Some("base64") => Encoding::Base64,
        Some(_) => {
            return Err(
                ApiError::invalid_field("encoding", "encoding must be utf8 or base64").into(),
            )
        }
    };
    let data = match obj.get("data") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => enc
            .decode(s)
            .ok_or_else(|| ApiError::invalid_field("data", "data is not base64"))?,
        Some(_) => return Err(ApiError::invalid_field("data", "data must be a string").into()),
    };
    let close = match obj.get("close") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid_field("close", "close must be a boolean").into()),
    };
    st.node.exec_stdin(&id, &exec_id, &data, close).await?;
    Ok(Json(
        json!({ "object": "stdin", "exec_id": exec_id, "written": data.len(), "closed": close }),
    ))
}

pub(super) async fn signal(
    State(st): St,
    Path((id, exec_id)): Path<(String, String)>,
    body: Body,
) -> HttpResult<Json<Value>> {
    let obj = json_object(body, &["signal"]).await?;
    let sig = sbx_api::signal_field(obj.get("signal"))?;
    st.node.exec_signal(&id, &exec_id, sig).await?;
    Ok(Json(
        json!({ "object": "signal", "exec_id": exec_id, "signal": sbx_api::signal_name(sig) }),
    ))
}

//! What every request goes through: its request id, where it comes from (Host, Origin, CORS
//! preflights), its key, its URI and body type; and every refusal as the one error body.

use sbx_front::guard::is_api_key;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sbx_api::{ApiError, ErrorCode};

use super::*;

/// Methods and request headers a CORS preflight of an allowed origin is answered with.
pub(super) const CORS_METHODS: &str = "GET, POST, PUT, PATCH, DELETE";

pub(super) const CORS_HEADERS: &str =
    "authorization, content-type, accept, idempotency-key, x-request-id, last-event-id, range";

/// Request ids, the checks of where a request comes from (Host, Origin, CORS preflights), its
/// body's type, authentication, for every route; and every refusal as the one error body.
pub(super) async fn edge(
    State(st): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    req.extensions_mut().insert(RequestId(rid.clone()));
    let has_body = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim() != "0")
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    let docs = st.docs_url.as_deref();
    let refusal = |e: ApiError| HttpError::from(e).answer(&rid, docs);
    let origin = match check_origin(&st, &req) {
        Ok(o) => o,
        Err(e) => return finish(refusal(e), &rid, has_body, None),
    };
    if let Some(o) = &origin {
        if req.method() == axum::http::Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return finish(preflight(), &rid, has_body, Some(o));
        }
    }
    let checked = check_uri(req.uri())
        .and_then(|()| {
            if req.uri().path() == "/healthz" {
                Ok(())
            } else {
                authenticate(&st, &req, peer)
            }
        })
        .and_then(|()| check_content_type(&req, has_body));
    let resp = match checked {
        Ok(()) => {
            // A request that uses a kept sandbox wakes it if it sleeps, resumes it if it is
            // paused, and holds it awake
            // until its answer is sent in full.
            let used = match used_sandbox(req.uri().path()) {
                Some(id) => st.node.use_sandbox(id).await,
                None => None,
            };
            let held = match used {
                Some(Ok(h)) => Some(h),
                Some(Err(e)) => return finish(refusal(e), &rid, has_body, origin.as_deref()),
                None => None,
            };
            let resp = next.run(req).await;
            let resp = with_error_body(resp, &rid, docs).await;
            match held {
                Some(h) => hold_while_sent(resp, h),
                None => resp,
            }
        }
        Err(e) => refusal(e),
    };
    finish(resp, &rid, has_body, origin.as_deref())
}

/// The sandbox a request uses: `/v1/sandboxes/{id}/<anything>` (its commands, files,
/// terminals, streams, snapshots). Reading, changing, deleting or putting the sandbox to sleep
/// does not use it.
fn used_sandbox(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let (id, sub) = rest.split_once('/')?;
    // A sleep asked for does not wake it first.
    (!id.is_empty() && !sub.is_empty() && sub != "sleep").then_some(id)
}

/// The headers every answer gets: its request id, CORS headers for an origin `--cors-origin`
/// allows, `Connection: close` after a refusal of a request with a body.
pub(super) fn finish(
    mut resp: Response,
    rid: &str,
    has_body: bool,
    cors: Option<&str>,
) -> Response {
    if let Ok(v) = HeaderValue::from_str(rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    if let Some(v) = cors.and_then(|o| HeaderValue::from_str(o).ok()) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-request-id, retry-after"),
        );
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    // A refusal may come before the request's body was read: the connection is not reused
    // then, or a client that sends its next request on it would find it closed under it.
    if has_body && (resp.status().is_client_error() || resp.status().is_server_error()) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The answer to a CORS preflight of an origin `--cors-origin` allows.
pub(super) fn preflight() -> Response {
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(CORS_METHODS),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(CORS_HEADERS),
    );
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    resp
}

/// The request's `Host` (or, without one, its URI's authority).
pub(super) fn request_host(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
        .map(str::trim)
}

/// Where the request comes from: without API keys only a loopback `Host` (a page that rebinds
/// its own name to 127.0.0.1 still sends that name); an `Origin` (a browser's request) only
/// the node's own or one of `--cors-origin`. The origin returned is one `--cors-origin` allows
/// (its answer gets CORS headers).
pub(super) fn check_origin(st: &AppState, req: &Request) -> Result<Option<String>, ApiError> {
    let host = request_host(req);
    let origin = req.headers().get(header::ORIGIN);
    crate::guard::check_origin(
        st.api_keys.is_none(),
        host,
        origin,
        "http",
        &st.cors_origins,
    )
    .map_err(|r| match r {
        crate::guard::Refusal::Host(shown) => ApiError::new(
            ErrorCode::ForbiddenHost,
            format!(
                "this node has no API keys and serves requests to a loopback name or address \
                 only, not to Host {shown:?}"
            ),
        )
        .with_param("Host"),
        crate::guard::Refusal::Origin(origin) => ApiError::new(
            ErrorCode::OriginNotAllowed,
            format!(
                "requests from pages of {origin:?} are refused (sandboxd --cors-origin ORIGIN \
                 allows one)"
            ),
        )
        .with_param("Origin"),
    })
}

/// A path and query that are valid UTF-8 once percent-decoded (what every route's extractors
/// need), so that a bad escape is answered here with the field at fault.
pub(super) fn check_uri(uri: &axum::http::Uri) -> Result<(), ApiError> {
    // (`+` for a space in a query is ASCII either way: it cannot make the text invalid.)
    fn decodes(s: &str) -> bool {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .is_ok()
    }
    if !decodes(uri.path()) {
        return Err(ApiError::invalid_field(
            "path",
            "the path holds a percent-escape that is not UTF-8",
        ));
    }
    if let Some(q) = uri.query() {
        if let Some(bad) = q.split('&').find(|kv| !decodes(kv)) {
            let name = bad.split('=').next().unwrap_or("");
            let name = if decodes(name) { name } else { "query" };
            return Err(ApiError::invalid_field(
                name.to_string(),
                "the query holds a percent-escape that is not UTF-8",
            ));
        }
    }
    Ok(())
}

/// The content type a route's body must have: JSON, except an upload's bytes (`PUT …/files`:
/// any type, the file's own; a browser cannot send a PUT without a preflight) and a tar stream
/// (`POST …/files/tar`). A request without a body needs none.
pub(super) fn check_content_type(req: &Request, has_body: bool) -> Result<(), ApiError> {
    if !has_body {
        return Ok(());
    }
    let path = req.uri().path();
    let method = req.method();
    if *method == axum::http::Method::PUT && path.ends_with("/files") {
        return Ok(());
    }
    let given = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"));
    let base = given
        .and_then(|g| g.split(';').next())
        .map(|b| b.trim().to_ascii_lowercase());
    let (ok, want) = if *method == axum::http::Method::POST && path.ends_with("/files/tar") {
        (
            matches!(
                base.as_deref(),
                Some("application/x-tar" | "application/tar" | "application/octet-stream")
            ),
            "application/x-tar",
        )
    } else {
        (
            base.as_deref() == Some("application/json"),
            "application/json",
        )
    };
    if ok {
        return Ok(());
    }
    let what = match given {
        Some(g) => format!("not {g:?}"),
        None => "and none was given".to_string(),
    };
    Err(ApiError::new(
        ErrorCode::UnsupportedMediaType,
        format!("the body must be sent as Content-Type: {want}, {what}"),
    )
    .with_param("Content-Type"))
}

/// The error body of an error answer, written here for every route: a handler's
/// [`HttpError`] gets its own; an answer that is an error without the error body (an
/// extractor's rejection: a bad path parameter, a query that does not parse, ...) gets one
/// with the code of its status.
pub(super) async fn with_error_body(mut resp: Response, rid: &str, docs: Option<&str>) -> Response {
    if let Some(Unwritten(e)) = resp.extensions_mut().remove::<Unwritten>() {
        return e.answer(rid, docs);
    }
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 16 << 10).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_string(),
        Err(_) => String::new(),
    };
    let code = match status.as_u16() {
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        413 => ErrorCode::BodyTooLarge,
        415 => ErrorCode::UnsupportedMediaType,
        416 => ErrorCode::InvalidRange,
        422 => ErrorCode::InvalidJson,
        400..=499 => ErrorCode::InvalidField,
        _ => {
            tracing::warn!(request_id = %rid, status = status.as_u16(), %text, "a handler failed");
            return HttpError::from(ApiError::internal()).answer(rid, docs);
        }
    };
    let text = if text.is_empty() {
        status.canonical_reason().unwrap_or("refused").to_string()
    } else {
        text
    };
    HttpError::from(ApiError::new(code, text)).answer(rid, docs)
}

/// Whether an `Accept` header asks for an event stream: `text/event-stream` listed with a
/// quality above 0 (`q=0` means not acceptable).
pub fn accepts_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim();
            if !media.eq_ignore_ascii_case("text/event-stream") {
                return false;
            }
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map(|(_, v)| v.trim().parse::<f32>().unwrap_or(0.0))
                .unwrap_or(1.0);
            q > 0.0
        })
}

/// The one decision of who may make a request: a holder of one of the node's API keys (or,
/// on a node without keys, a loopback caller) may make any; a sandbox's token (`sbt_…`), with
/// or without keys, only the calls on its own sandbox ([`sandbox_token_may`]). Keys and tokens
/// are compared in constant time.
pub(super) fn authenticate(st: &AppState, req: &Request, peer: SocketAddr) -> Result<(), ApiError> {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim());
    if let (Some(keys), Some(g)) = (&st.api_keys, given) {
        if is_api_key(keys, g) {
            return Ok(());
        }
    }
    if let Some(token) = given.filter(|g| g.starts_with(crate::node::sandbox::TOKEN_PREFIX)) {
        let Some(id) = st.node.sandbox_of_token(token) else {
            return Err(ApiError::new(
                ErrorCode::InvalidToken,
                "that sandbox token is not valid (its sandbox may be deleted)",
            ));
        };
        return if sandbox_token_may(st, &id, req.method(), req.uri().path()) {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::NeedsApiKey,
                "a sandbox token acts on its own sandbox only (GET of it, its commands, its \
                 files): this call needs an API key",
            ))
        };
    }
    match (&st.api_keys, given) {
        (None, _) if peer.ip().is_loopback() => Ok(()),
        (None, _) => Err(ApiError::new(
            ErrorCode::MissingApiKey,
            "this node has no API keys and serves loopback callers only",
        )),
        (Some(_), None) => Err(ApiError::new(
            ErrorCode::MissingApiKey,
            "send Authorization: Bearer KEY",
        )),
        (Some(_), Some(_)) => Err(ApiError::new(
            ErrorCode::InvalidApiKey,
            "that API key is not valid",
        )),
    }
}

/// What the token of sandbox `id` may call: `GET /v1/sandboxes/{it}`, its commands
/// (`…/exec…`, `…/run`: start, list, get, output, stdin, signal, terminal) and its files
/// (`…/files…`), where `{it}` is its id or its name.
fn sandbox_token_may(st: &AppState, id: &str, method: &axum::http::Method, path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v1/sandboxes/") else {
        return false;
    };
    let (named, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let named = percent_encoding::percent_decode_str(named).decode_utf8_lossy();
    if named.is_empty() || st.node.sandbox_id(&named).as_deref() != Some(id) {
        return false;
    }
    let under = |root: &str| tail == root || tail.starts_with(&format!("{root}/"));
    match tail {
        "" => method == axum::http::Method::GET,
        "run" => true,
        _ => under("exec") || under("files"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejections_without_the_error_body_get_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let plain = (
            StatusCode::BAD_REQUEST,
            "Failed to deserialize query string",
        )
            .into_response();
        let resp = rt.block_on(with_error_body(plain, "rid-1", None));
        assert_eq!(resp.status(), 400);
        let body = rt
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 20))
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_field");
        assert_eq!(v["error"]["request_id"], "rid-1");
        assert_eq!(v["error"]["message"], "Failed to deserialize query string");
        let unsupported = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "").into_response();
        let resp = rt.block_on(with_error_body(unsupported, "r", None));
        let body = rt
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 20))
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "unsupported_media_type");
        let ok = (StatusCode::OK, "fine").into_response();
        let resp = rt.block_on(with_error_body(ok, "r", None));
        assert_eq!(resp.status(), 200);
    }

    #[test]
    fn a_handlers_error_is_answered_by_the_edge_with_its_body() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let answer = |e: HttpError| {
            let resp = e.into_response();
            rt.block_on(async {
                let resp = with_error_body(resp, "rid-2", Some("https://d/")).await;
                let (parts, body) = resp.into_parts();
                let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
                (parts, body)
            })
        };
        let retry = |p: &axum::http::response::Parts| {
            p.headers
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_string())
        };
        let busy = ApiError::new(ErrorCode::NoCapacity, "every slot is in use");
        let (parts, body) = answer(busy.clone().into());
        assert_eq!(parts.status, 503);
        assert_eq!(parts.headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(retry(&parts).as_deref(), Some("1"));
        let want = sbx_api::error_body(&busy, "rid-2", Some("https://d/"));
        assert_eq!(body, serde_json::to_vec(&want).unwrap());
        // A 503 not worth retrying says nothing of when, unless the handler adds it.
        let not_here = ApiError::new(ErrorCode::NotServedHere, "no network");
        let (parts, _) = answer(not_here.clone().into());
        assert_eq!((parts.status.as_u16(), retry(&parts)), (503, None));
        let with = HttpError::from(not_here)
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"));
        assert_eq!(retry(&answer(with).0).as_deref(), Some("1"));
        // Headers besides the body's (a 416's Content-Range).
        let range = HttpError::from(ApiError::new(ErrorCode::InvalidRange, "past the end"))
            .with_header(header::CONTENT_RANGE, HeaderValue::from_static("bytes */3"));
        let (parts, body) = answer(range);
        assert_eq!(parts.status, 416);
        assert_eq!(parts.headers[header::CONTENT_RANGE], "bytes */3");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_range");
        assert_eq!(v["error"]["request_id"], "rid-2");
        assert_eq!(v["error"]["docs_url"], "https://d/invalid_range");
    }

    #[test]
    fn accept_with_q_zero_is_not_acceptable() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::ACCEPT, HeaderValue::from_str(v).unwrap());
            accepts_event_stream(&m)
        };
        assert!(h("text/event-stream"));
        assert!(h("application/json, TEXT/event-stream;q=0.1"));
        assert!(!h("text/event-stream;q=0"));
        assert!(!h("text/event-stream; q=0.0, application/json"));
        assert!(!h("*/*"));
        assert!(!accepts_event_stream(&HeaderMap::new()));
    }
}

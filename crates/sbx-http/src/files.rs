//! HTTP routes of a sandbox's files, `/v1/sandboxes/{id}/files…`: parse the query (and a POST's
//! JSON body) into sbx-api's [`FsParams`] and the request of the call, then call the node
//! (`crate::node::files`), which has the sandbox's agent do the work.
//!
//! | method, path          | what                                                     |
//! |-----------------------|----------------------------------------------------------|
//! | GET  …/files          | download (raw body; `Range: bytes=` gives 206)           |
//! | PUT  …/files          | upload (raw body; mode, parents, owner)                  |
//! | GET  …/files/list     | a directory's entries                                    |
//! | GET  …/files/stat     | one entry                                                |
//! | POST …/files/mkdir    | parents, mode, owner                                     |
//! | POST …/files/rm       | recursive                                                |
//! | POST …/files/mv       | dst, overwrite                                           |
//! | POST …/files/chmod    | mode, uid, gid, recursive                                |
//! | POST …/files/grep     | pattern, literal, recursive, ignore_case, include, ...   |
//! | POST …/files/sed      | pattern, replacement, literal, first_only, ...           |
//! | GET  …/files/tar      | a directory as a tar stream (application/x-tar)          |
//! | POST …/files/tar      | a tar stream unpacked into a directory                   |
//!
//! The path is always `?path=`; the other parameters come in the query or, for POSTs, in a
//! JSON object body. The node never holds a file: a request body becomes the agent's data
//! frames as it is read, its data frames become the response body as they come (a short
//! queue of chunks); each side waits for the other, so a slow reader slows the writer and
//! memory does not grow with the size of a file.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use sbx_api::files::{
    fs_invalid, FsCall, FsObject, FsParams, UnpackRequest, WriteRequest, UNPACK_FIELDS,
    WRITE_FIELDS,
};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{Map, Value};

use super::{read_body, AppState, HttpError, HttpResult};
use crate::node::files::{FsRead, FsReply};

type St = State<Arc<AppState>>;
type Q = Result<Query<Vec<(String, String)>>, QueryRejection>;

/// A call's parameters: its query's, and a POST's JSON object body's.
fn params(q: Q, body: Option<Map<String, Value>>, known: &[&str]) -> Result<FsParams, ApiError> {
    let Query(pairs) = q.map_err(|e| fs_invalid("query", format!("the query: {e}")))?;
    FsParams::new(pairs, body, known)
}

/// A request body that is a JSON object, or nothing.
async fn json_body(body: Body) -> Result<Option<Map<String, Value>>, ApiError> {
    let bytes = read_body(body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        _ => Err(fs_invalid("body", "the body is not a JSON object")),
    }
}

/// An operation's answer: its object, 201 when it made something.
fn answer(r: FsReply) -> (StatusCode, Json<FsObject>) {
    let status = if r.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(r.object))
}

/// `GET …/files?path=`: the file's bytes (a `Range: bytes=a-b`, `a-` or `-n` gives 206).
pub(super) async fn download(
    State(st): St,
    Path(id): Path<String>,
    q: Q,
    headers: HeaderMap,
) -> HttpResult<Response> {
    let p = params(q, None, &["path"])?;
    let path = p.path()?;
    let range = parse_range(&headers);
    let read = match range {
        None => FsRead::whole(path),
        Some(Want::From(a, b)) => FsRead {
            path,
            offset: a,
            length: b.map(|b| b - a + 1),
            tail: None,
        },
        Some(Want::Tail(n)) => FsRead {
            path,
            offset: 0,
            length: None,
            tail: Some(n),
        },
    };
    let o = st.node.fs_read(&id, read).await?;
    let unsatisfiable = match range {
        None => false,
        Some(Want::From(a, _)) => a >= o.size,
        Some(Want::Tail(n)) => n == 0 || o.size == 0,
    };
    if unsatisfiable {
        let mut e = HttpError::from(
            ApiError::new(
                ErrorCode::InvalidRange,
                format!("the range is past the end of the file ({} bytes)", o.size),
            )
            .with_param("Range"),
        );
        if let Ok(v) = HeaderValue::from_str(&format!("bytes */{}", o.size)) {
            e = e.with_header(header::CONTENT_RANGE, v);
        }
        return Err(e);
    }
    let mut resp = Response::new(Body::from_stream(o.chunks));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(len) = o.length {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    if range.is_some() {
        let end = o.offset + o.length.unwrap_or(0);
        let v = format!("bytes {}-{}/{}", o.offset, end.saturating_sub(1), o.size);
        if let Ok(v) = HeaderValue::from_str(&v) {
            h.insert(header::CONTENT_RANGE, v);
        }
        *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
    }
    Ok(resp)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// From a byte to another (inclusive) or to the end.
    From(u64, Option<u64>),
    /// The last bytes.
    Tail(u64),
}

/// One range of a `Range: bytes=` header; `None` for no header, or one that is not a single
/// valid range (the whole file is answered then, as RFC 9110 allows).
fn parse_range(h: &HeaderMap) -> Option<Want> {
    let v = h.get(header::RANGE)?.to_str().ok()?.trim();
    let spec = v.strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        return b.parse().ok().map(Want::Tail);
    }
    let start: u64 = a.parse().ok()?;
    if b.is_empty() {
        return Some(Want::From(start, None));
    }
    let end: u64 = b.parse().ok()?;
    (end >= start).then_some(Want::From(start, Some(end)))
}

/// `PUT …/files?path=`: the body becomes the file (mode, parents, owner). 201 when it is new.
pub(super) async fn upload(
    State(st): St,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> HttpResult<(StatusCode, Json<FsObject>)> {
    let w = WriteRequest::parse(&params(q, None, WRITE_FIELDS)?)?;
    let r = st
        .node
        .fs_write(&id, w.into(), body.into_data_stream())
        .await?;
    Ok(answer(r.reply()))
}

/// A body-less operation: its parameters from the query (and a POST's JSON body), run by the
/// node.
async fn call(
    st: &AppState,
    id: &str,
    call: FsCall,
    q: Q,
    body: Option<Body>,
) -> HttpResult<(StatusCode, Json<FsObject>)> {
    let body = match body {
        Some(b) => json_body(b).await?,
        None => None,
    };
    let req = call.request(&params(q, body, call.fields())?)?;
    Ok(answer(st.node.fs_call(id, &req).await?))
}

pub(super) async fn list(
    State(st): St,
    Path(id): Path<String>,
    q: Q,
) -> HttpResult<(StatusCode, Json<FsObject>)> {
    call(&st, &id, FsCall::List, q, None).await
}

pub(super) async fn stat(
    State(st): St,
    Path(id): Path<String>,
    q: Q,
) -> HttpResult<(StatusCode, Json<FsObject>)> {
    call(&st, &id, FsCall::Stat, q, None).await
}

macro_rules! post_call {
    ($name:ident, $call:expr) => {
        pub(super) async fn $name(
            State(st): St,
            Path(id): Path<String>,
            q: Q,
            body: Body,
        ) -> HttpResult<(StatusCode, Json<FsObject>)> {
            call(&st, &id, $call, q, Some(body)).await
        }
    };
}

post_call!(mkdir, FsCall::Mkdir);
post_call!(rm, FsCall::Remove);
post_call!(mv, FsCall::Move);
post_call!(chmod, FsCall::Chmod);
post_call!(grep, FsCall::Grep);
post_call!(sed, FsCall::Sed);

/// `GET …/files/tar?path=`: a directory (or a file) as a tar stream.
pub(super) async fn tar_down(State(st): St, Path(id): Path<String>, q: Q) -> HttpResult<Response> {
    let p = params(q, None, &["path"])?;
    let o = st.node.fs_tar(&id, &p.path()?).await?;
    let mut resp = Response::new(Body::from_stream(o.chunks));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-tar"),
    );
    Ok(resp)
}

/// `POST …/files/tar?path=`: a tar stream unpacked into a directory (made with its parents
/// unless parents=false; owner, or preserve_owners to keep the archive's).
pub(super) async fn tar_up(
    State(st): St,
    Path(id): Path<String>,
    q: Q,
    headers: HeaderMap,
    body: Body,
) -> HttpResult<(StatusCode, Json<FsObject>)> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        let base = ct.split(';').next().unwrap_or("").trim();
        if !matches!(
            base,
            "application/x-tar" | "application/tar" | "application/octet-stream"
        ) {
            return Err(fs_invalid(
                "Content-Type",
                format!("the body must be a tar stream (application/x-tar), not {ct}"),
            )
            .into());
        }
    }
    let u = UnpackRequest::parse(&params(q, None, UNPACK_FIELDS)?)?;
    let path = u.path.clone();
    let r = st.node.fs_unpack(&id, u, body.into_data_stream()).await?;
    Ok(answer(r.reply(&path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(v: &str) -> Option<Want> {
        let mut h = HeaderMap::new();
        h.insert(header::RANGE, HeaderValue::from_str(v).unwrap());
        parse_range(&h)
    }

    #[test]
    fn ranges() {
        assert_eq!(range("bytes=0-99"), Some(Want::From(0, Some(99))));
        assert_eq!(range("bytes=100-"), Some(Want::From(100, None)));
        assert_eq!(range("bytes=-5"), Some(Want::Tail(5)));
        assert_eq!(range("bytes=5-1"), None);
        assert_eq!(range("bytes=0-1,3-4"), None);
        assert_eq!(range("items=0-1"), None);
        assert_eq!(parse_range(&HeaderMap::new()), None);
    }
}

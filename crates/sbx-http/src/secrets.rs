//! Routes of the node's secrets: `PUT /v1/secrets/{name}`, `GET /v1/secrets`,
//! `GET`/`DELETE /v1/secrets/{name}`. The node's side (sealing, rows, pull logins) is
//! `node/credentials.rs`.
//!
//! A secret's value is write-only: no answer, log line or error message holds it. At rest it is
//! sealed with the node key (`<data-dir>/node.key`, 32 random bytes, mode 0600, made on the
//! node's first start) by ChaCha20-Poly1305 with a random nonce per value and the secret's name
//! as associated data, so the database never holds a value in clear and a sealed value does not
//! open under another name. The same key seals the `secret_env` values of the sandboxes the
//! node keeps ([`crate::node::credentials::sealed_env`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::ApiError;
use serde_json::{json, Value};

use crate::node::credentials::{check_name, parse_put};
use crate::{error_response, read_body, AppState, RequestId};

type St = State<Arc<AppState>>;

type Rid = Extension<RequestId>;

fn reply(
    st: &AppState,
    rid: &RequestId,
    status: StatusCode,
    r: Result<Value, ApiError>,
) -> Response {
    match r {
        Ok(v) => (status, Json(v)).into_response(),
        Err(e) => error_response(&e, &rid.0, st.docs_url.as_deref()),
    }
}

pub(super) async fn put(
    State(st): St,
    Extension(rid): Rid,
    UrlPath(name): UrlPath<String>,
    body: Body,
) -> Response {
    let r = async {
        check_name(&name)?;
        let bytes = read_body(body).await?;
        let (value, hosts) = parse_put(&bytes)?;
        st.node.put_secret(&name, &value, hosts)
    }
    .await;
    match r {
        Ok((true, obj)) => reply(&st, &rid, StatusCode::CREATED, Ok(obj)),
        Ok((false, obj)) => reply(&st, &rid, StatusCode::OK, Ok(obj)),
        Err(e) => reply(&st, &rid, StatusCode::OK, Err(e)),
    }
}

pub(super) async fn list(State(st): St, Extension(rid): Rid) -> Response {
    let r = st
        .node
        .list_secrets()
        .map(|data| json!({ "object": "list", "data": data, "has_more": false }));
    reply(&st, &rid, StatusCode::OK, r)
}

pub(super) async fn get_one(
    State(st): St,
    Extension(rid): Rid,
    UrlPath(name): UrlPath<String>,
) -> Response {
    let r = st.node.secret_object(&name);
    reply(&st, &rid, StatusCode::OK, r)
}

pub(super) async fn delete(
    State(st): St,
    Extension(rid): Rid,
    UrlPath(name): UrlPath<String>,
) -> Response {
    let r = check_name(&name).and_then(|()| st.node.delete_secret(&name));
    reply(&st, &rid, StatusCode::OK, r)
}

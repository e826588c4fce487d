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
use axum::Json;
use sbx_api::{SecretDeleted, SecretObject};
use serde_json::{json, Value};

use crate::node::credentials::{check_name, parse_put};
use crate::{read_body, AppState, HttpResult};

type St = State<Arc<AppState>>;

/// `PUT /v1/secrets/{name}`: 201 when the secret is new, 200 when its value was replaced.
pub(super) async fn put(
    State(st): St,
    UrlPath(name): UrlPath<String>,
    body: Body,
) -> HttpResult<(StatusCode, Json<SecretObject>)> {
    check_name(&name)?;
    let bytes = read_body(body).await?;
    let (value, hosts) = parse_put(&bytes)?;
    let (created, obj) = st.node.put_secret(&name, &value, hosts)?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(obj)))
}

pub(super) async fn list(State(st): St) -> HttpResult<Json<Value>> {
    let data = st.node.list_secrets()?;
    Ok(Json(
        json!({ "object": "list", "data": data, "has_more": false }),
    ))
}

pub(super) async fn get_one(
    State(st): St,
    UrlPath(name): UrlPath<String>,
) -> HttpResult<Json<SecretObject>> {
    Ok(Json(st.node.secret_object(&name)?))
}

pub(super) async fn delete(
    State(st): St,
    UrlPath(name): UrlPath<String>,
) -> HttpResult<Json<SecretDeleted>> {
    check_name(&name)?;
    Ok(Json(st.node.delete_secret(&name)?))
}

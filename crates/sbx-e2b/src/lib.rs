//! E2B compatibility: a listener (`--e2b-listen`) that E2B's own SDKs drive unchanged, by
//! `E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_API_KEY` alone. A request that names a sandbox
//! (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`) goes to that sandbox: port 49983 to the node's envd
//! (`envd/`: E2B's in-sandbox daemon protocol served by the node over the agent), any other
//! port to that port in the sandbox (the code interpreter's 49999 among them). Any other
//! request is E2B's control plane (`api.rs`). Both call the node's core (`crate::node`), as
//! the node's own API does.
//!
//! Where a request comes from is checked as the API checks it (`crate::guard`), on every
//! route: a node without keys serves a loopback `Host` only (a DNS-rebinding page sends its
//! own name), and a page (`Origin`) only of the listener's own origin or `--cors-origin`
//! (whose preflights it answers, and whose answers get CORS headers).
//! What goes on to a sandbox (envd's port or any other) has the node's credentials taken out
//! first (`crate::guard::take_credentials`, as the preview listener does).

#![forbid(unsafe_code)]

use sbx_front::guard;
use sbx_node::{image, node, sync};

pub mod api;
pub mod connect;
pub mod envd;
pub mod interp;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use hyper::header::HeaderValue;
use hyper::{header, Request, StatusCode};
use serde_json::json;
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::node::Node;

/// envd's port: the SDK names it in `E2b-Sandbox-Port` (and in `49983-{id}.{domain}`).
pub const ENVD_PORT: u16 = 49983;

/// The version of envd the node claims (the SDK switches features on it): the features
/// served here and no more. See `envd/mod.rs`. 0.6.2: file metadata (`user.e2b.*` extended
/// attributes); 0.6.3: watch events with their entry (`includeEntry`); 0.6.4: watches that may
/// be on network mounts (`allowNetworkMounts`).
pub const ENVD_VERSION: &str = "0.6.4";

/// The most connections the listener serves at once.
const MAX_CONNECTIONS: usize = 1024;

/// What every request of the listener shares.
pub struct Shared {
    pub node: Arc<Node>,
    /// `--api-keys`: `X-API-KEY` must be one; none: loopback callers only.
    pub api_keys: Option<HashSet<String>>,
    /// `--cors-origin`: origins besides the listener's own whose pages it serves.
    cors_origins: Vec<String>,
    /// The control plane's routes.
    api: axum::Router,
    /// envd's state of the node (processes by pid, watchers).
    pub envd: envd::State,
}

/// envd's port of every sandbox, which this front end serves when the preview listener hands
/// it `49983-{id}.{domain}`.
pub struct EnvdPort(Arc<Shared>);

impl sbx_front::PortFront for EnvdPort {
    fn port(&self) -> u16 {
        ENVD_PORT
    }

    fn serve(
        &self,
        req: Request<Body>,
        peer: SocketAddr,
        sandbox: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send + 'static>> {
        let shared = self.0.clone();
        Box::pin(async move { sandbox_side(req, peer, &shared, &sandbox, ENVD_PORT).await })
    }
}

/// Binds `--e2b-listen` and serves it in the background; envd's port of every sandbox, for
/// the preview listener (none when the listener is off).
pub async fn start(
    listen: Option<SocketAddr>,
    node: Arc<Node>,
    api_keys: Option<HashSet<String>>,
    cors_origins: Vec<String>,
) -> anyhow::Result<Option<EnvdPort>> {
    let Some(listen) = listen else {
        return Ok(None);
    };
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("E2B listener: listen on {listen}"))?;
    let bound = listener.local_addr().context("E2B listener's address")?;
    let shared = Arc::new(Shared {
        api: api::router(node.clone()),
        node,
        api_keys,
        cors_origins,
        envd: envd::State::default(),
    });
    tracing::info!(listen = %bound, "E2B listener serves (E2B_API_URL and E2B_SANDBOX_URL)");
    tokio::spawn(accept_loop(listener, shared.clone()));
    Ok(Some(EnvdPort(shared)))
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    use sbx_front::listen::{serve_conn, Protocol, Timeouts};
    sbx_front::listen::accept_loop(
        listener,
        "E2B listener",
        MAX_CONNECTIONS,
        std::future::pending(),
        move |stream, peer| {
            let shared = shared.clone();
            serve_conn(
                stream,
                peer,
                Timeouts::STREAMS,
                Protocol::Http1And2,
                None,
                move |req| handle(req, peer, shared.clone()),
            )
        },
    )
    .await;
}

/// E2B's error body: `{code, message}` with the status as its code.
pub fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message.into() })),
    )
        .into_response()
}

fn header_str<'a>(req: &'a Request<Body>, name: &str) -> Option<&'a str> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// A query's `a=b&c=d` pairs, `+` and percent escapes decoded.
pub fn url_pairs(q: &str) -> Vec<(String, String)> {
    let dec = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (dec(k), dec(v))
        })
        .collect()
}

/// Whether the caller holds one of the node's keys (`X-API-KEY`, or `Authorization: Bearer`),
/// or, on a node without keys, calls from loopback.
fn caller_may(shared: &Shared, headers: &hyper::HeaderMap, peer: SocketAddr) -> bool {
    match &shared.api_keys {
        None => peer.ip().is_loopback(),
        Some(keys) => {
            let given = headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .or_else(|| {
                    headers
                        .get(header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "))
                })
                .map(str::trim);
            given.is_some_and(|k| sbx_front::guard::is_api_key(keys, k))
        }
    }
}

/// What the listener makes of where a request comes from.
enum From {
    /// Refused: the answer.
    Refused(Response),
    /// A page of an origin `--cors-origin` allows: its answer gets CORS headers.
    Cors(String),
    /// Anything else it serves.
    Served,
}

/// Where the request comes from, as the API decides it: on a node without keys a loopback
/// `Host` only; an `Origin` only the listener's own (`http://{host}`) or one of
/// `--cors-origin`.
fn where_from(req: &Request<Body>, shared: &Shared) -> From {
    let host = header_str(req, "host").or_else(|| req.uri().authority().map(|a| a.as_str()));
    let decided = crate::guard::check_origin(
        shared.api_keys.is_none(),
        host,
        req.headers().get(header::ORIGIN),
        "http",
        &shared.cors_origins,
    );
    match decided {
        Ok(Some(o)) => From::Cors(o),
        Ok(None) => From::Served,
        Err(crate::guard::Refusal::Host(h)) => From::Refused(e2b_error(
            StatusCode::FORBIDDEN,
            format!(
                "this node has no API keys and serves requests to a loopback name or address \
                 only, not to Host {h:?}"
            ),
        )),
        Err(crate::guard::Refusal::Origin(o)) => From::Refused(e2b_error(
            StatusCode::FORBIDDEN,
            format!(
                "requests from pages of {o:?} are refused (sandboxd --cors-origin ORIGIN allows \
                 one)"
            ),
        )),
    }
}

/// The answer to a CORS preflight of an origin `--cors-origin` allows: the methods E2B's
/// SDKs use, the headers the page asks for (E2B's SDKs send headers of their own).
fn preflight(req: &Request<Body>) -> Response {
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let asked = req
        .headers()
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned();
    let h = resp.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, PUT, PATCH, DELETE"),
    );
    if let Some(asked) = asked {
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    }
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    resp
}

/// `resp` with the CORS headers of `origin` (one `--cors-origin` allows).
fn with_cors(mut resp: Response, origin: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(origin) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-next-token"),
        );
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    resp
}

async fn handle(req: Request<Body>, peer: SocketAddr, shared: Arc<Shared>) -> Response {
    match where_from(&req, &shared) {
        From::Refused(r) => r,
        From::Served => route(req, peer, shared).await,
        From::Cors(o) => {
            let resp = if req.method() == hyper::Method::OPTIONS
                && req
                    .headers()
                    .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
            {
                preflight(&req)
            } else {
                route(req, peer, shared).await
            };
            with_cors(resp, &o)
        }
    }
}

/// A request the listener serves: a sandbox's side when it names one, else the control plane.
async fn route(req: Request<Body>, peer: SocketAddr, shared: Arc<Shared>) -> Response {
    if let Some(id) = header_str(&req, "e2b-sandbox-id").map(str::to_string) {
        let port = match header_str(&req, "e2b-sandbox-port") {
            None => ENVD_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => {
                    return e2b_error(
                        StatusCode::BAD_REQUEST,
                        format!("E2b-Sandbox-Port {p:?} is not a port"),
                    )
                }
            },
        };
        return sandbox_side(req, peer, &shared, &id, port).await;
    }
    // A signed URL of envd's `/files` (the SDK's `download_url`/`upload_url` of a secured
    // sandbox) names no sandbox: the one whose token signed it.
    if req.uri().path() == "/files" {
        if let Some(signed) = envd::files::Signed::of(&req) {
            let signed = match signed {
                Ok(s) => s,
                Err(why) => return e2b_error(StatusCode::BAD_REQUEST, why),
            };
            return match shared.node.sandbox_of_signature(|t| signed.made_with(t)) {
                Some(id) => sandbox_side(req, peer, &shared, &id, ENVD_PORT).await,
                None => e2b_error(StatusCode::UNAUTHORIZED, "invalid signature"),
            };
        }
    }
    // A `copy`'s upload (the URL `GET /templates/{id}/files/{hash}` gave) carries no key: its
    // token is checked by the route.
    let upload =
        req.method() == hyper::Method::PUT && req.uri().path().starts_with("/e2b-uploads/");
    if !upload && !caller_may(&shared, req.headers(), peer) {
        let msg = if shared.api_keys.is_some() {
            "send one of the node's API keys in X-API-KEY (E2B_API_KEY)"
        } else {
            "this node takes calls from loopback only (start it with --api-keys to open it)"
        };
        return e2b_error(StatusCode::UNAUTHORIZED, msg);
    }
    let req = req.map(Body::new);
    match shared.api.clone().oneshot(req).await {
        Ok(r) => r,
        Err(e) => match e {},
    }
}

/// Who sent a request for a sandbox's port, its credentials taken out of it.
pub struct Access {
    /// The node's credentials it carried.
    pub creds: crate::guard::Credentials,
    /// A caller the control plane takes: a key of the node (loopback on a node without keys).
    pub caller: bool,
    /// Any web page could have sent it (`crate::guard::browser_simple`).
    pub browser_simple: bool,
}

/// A request for a port of sandbox `id`: envd's is the node's, any other the sandbox's. The
/// node's credentials are taken out of it first, whichever.
async fn sandbox_side(
    req: Request<Body>,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    id: &str,
    port: u16,
) -> Response {
    let (mut parts, body) = req.into_parts();
    let browser_simple = crate::guard::browser_simple(&parts.method, &parts.headers);
    let creds = crate::guard::take_credentials(&mut parts, shared.api_keys.as_ref());
    let caller = match &shared.api_keys {
        None => peer.ip().is_loopback(),
        Some(_) => creds.api_key,
    };
    let access = Access {
        creds,
        caller,
        browser_simple,
    };
    let req = Request::from_parts(parts, body);
    // A sandbox that is not running (killed, ended, unknown) or paused without autoResume
    // answers as E2B's proxy does: 502 "… was not found" (the SDK's `is_running()` false).
    if let Some(why) = api::not_reachable(&shared.node, id) {
        return e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} was not found ({why})"),
        );
    }
    // A request for the sandbox thaws it if it is paused, and holds it awake until answered.
    let held = match shared.node.use_sandbox_port(id).await {
        Some(Ok(h)) => Some(h),
        Some(Err(e)) if e.code == sbx_api::ErrorCode::SandboxPaused => {
            return e2b_error(
                StatusCode::BAD_GATEWAY,
                format!("The sandbox {id} was not found (it is paused: connect resumes it)"),
            )
        }
        Some(Err(e)) => return e2b_error(StatusCode::INTERNAL_SERVER_ERROR, e.message),
        None => None,
    };
    let resp = if port == ENVD_PORT {
        envd::handle(shared, req.map(Body::new), &access, id).await
    } else {
        proxy(req, peer, shared, &access, id, port).await
    };
    match held {
        Some(h) => sbx_front::held::hold_while_sent(resp, h),
        None => resp,
    }
}

/// A request for port `port` of the sandbox, forwarded to it: a public port to anybody,
/// another one with the sandbox's token (`X-Access-Token`, `E2B-Traffic-Access-Token`) or
/// a caller the control plane takes. It goes without the node's credentials
/// ([`sandbox_side`] took them out).
async fn proxy(
    req: Request<Body>,
    peer: SocketAddr,
    shared: &Arc<Shared>,
    access: &Access,
    id: &str,
    port: u16,
) -> Response {
    let target = match shared.node.preview_target(id, port) {
        Ok(t) => t,
        Err(_) => {
            return e2b_error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} is not running on this node"),
            )
        }
    };
    let token_ok = access
        .creds
        .token_in(&["x-access-token", "e2b-traffic-access-token"])
        .any(|t| target.token_matches(t));
    if !(target.public || token_ok || access.caller) {
        return e2b_error(
            StatusCode::UNAUTHORIZED,
            format!("port {port} of sandbox {id} is not public: send its access token"),
        );
    }
    let ns = match shared.node.sandbox_netns(&target.id, port) {
        Ok(ns) => ns,
        Err(e) => return e2b_error(StatusCode::BAD_GATEWAY, e.message),
    };
    let host = header_str(&req, "host").unwrap_or("localhost").to_string();
    match sbx_front::upstream::forward_to(req, ns, port, peer, host, target.host.clone(), None)
        .await
    {
        Ok(r) => r,
        Err(e) => e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("port {port} of sandbox {id}: {e}"),
        ),
    }
}

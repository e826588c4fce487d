//! The document against the node: its routes (the router's table), the completeness of each
//! operation, the error codes of `sbx-api`, who may call without a key, and real answers of a
//! node on the fake driver (`node/fake.rs`) checked against its schemas with a JSON Schema
//! validator.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use sbx_api::ErrorCode;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::DOCUMENT;
use crate::node::fake::World;
use crate::node::Node;
use crate::{router, AppState};

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

fn doc() -> Value {
    serde_json::from_str(DOCUMENT).expect("the document is JSON")
}

/// The documented operations: (method, path) to the operation object.
fn operations(doc: &Value) -> BTreeMap<(String, String), Value> {
    let mut out = BTreeMap::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("a path item") {
            assert!(
                METHODS.contains(&method.as_str()),
                "{path}: {method} is not a method"
            );
            out.insert((method.clone(), path.clone()), op.clone());
        }
    }
    out
}

/// What a local reference (`#/components/...`) points at.
fn resolve<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let pointer = r.strip_prefix('#').expect("a local reference");
            let target = doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("{r} points at nothing"));
            resolve(doc, target)
        }
        None => v,
    }
}

fn path_params(path: &str) -> BTreeSet<String> {
    path.split('/')
        .filter_map(|part| part.strip_prefix('{').and_then(|p| p.strip_suffix('}')))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_route_is_documented_and_nothing_else() {
    let table = router::table();
    let routes: BTreeSet<(String, String)> = table
        .iter()
        .map(|(m, p)| (m.as_str().to_ascii_lowercase(), p.to_string()))
        .collect();
    assert_eq!(routes.len(), table.len(), "a route is added twice");
    let documented: BTreeSet<(String, String)> = operations(&doc()).into_keys().collect();
    let missing: Vec<_> = routes.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routes).collect();
    assert!(missing.is_empty(), "routes the document lacks: {missing:?}");
    assert!(extra.is_empty(), "documented, and no route: {extra:?}");
}

#[test]
fn every_operation_is_complete() {
    let doc = doc();
    let mut ids = HashSet::new();
    for ((method, path), op) in operations(&doc) {
        let at = format!("{} {path}", method.to_uppercase());
        // operationIds: unique, camelCase; the spec's where it names one.
        let id = op["operationId"]
            .as_str()
            .unwrap_or_else(|| panic!("{at}: no operationId"));
        assert!(ids.insert(id.to_string()), "{at}: operationId {id} twice");
        assert!(
            id.starts_with(|c: char| c.is_ascii_lowercase())
                && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{at}: {id} is not camelCase"
        );
        assert!(op["summary"].is_string(), "{at}: no summary");
        // Path parameters: each of the path's, and no other.
        let params: Vec<&Value> = op["parameters"]
            .as_array()
            .map(|a| a.iter().map(|p| resolve(&doc, p)).collect())
            .unwrap_or_default();
        let in_path: BTreeSet<String> = params
            .iter()
            .filter(|p| p["in"] == "path")
            .map(|p| {
                assert_eq!(p["required"], true, "{at}: a path parameter is required");
                p["name"].as_str().expect("a name").to_string()
            })
            .collect();
        assert_eq!(in_path, path_params(&path), "{at}: path parameters");
        for p in &params {
            assert!(
                p["schema"].is_object(),
                "{at}: parameter {} has no schema",
                p["name"]
            );
        }
        // A body for the methods that take one, and only for them.
        let takes_body = matches!(method.as_str(), "post" | "put" | "patch");
        match op.get("requestBody") {
            Some(b) => {
                assert!(takes_body, "{at}: a body on a {method}");
                let b = resolve(&doc, b);
                let content = b["content"].as_object().expect("a body's content");
                assert!(!content.is_empty(), "{at}: a body of no type");
                for (media, c) in content {
                    assert!(
                        c.get("schema").is_some(),
                        "{at}: body {media} has no schema"
                    );
                }
            }
            None => assert!(!takes_body, "{at}: no requestBody"),
        }
        // A success answer with its schema (or explicitly none), every failure the error body.
        let responses = op["responses"].as_object().expect("responses");
        assert!(responses.contains_key("default"), "{at}: no default answer");
        let mut success = 0;
        for (status, r) in responses {
            let code: u16 = match status.as_str() {
                "default" => 0,
                s => s.parse().unwrap_or_else(|_| panic!("{at}: status {s}")),
            };
            if code == 0 || code >= 400 {
                let name = r["$ref"]
                    .as_str()
                    .and_then(|r| r.strip_prefix("#/components/responses/"))
                    .unwrap_or_else(|| panic!("{at} {status}: not a shared error answer"));
                let ok = name == format!("Error{code}")
                    || (code == 0 && name == "ErrorAny")
                    || (path == "/v1/functions/{function_id}" && name == "FunctionFailure");
                assert!(ok, "{at} {status}: answered by {name}");
                resolve(&doc, r);
                continue;
            }
            assert!((100..400).contains(&code), "{at}: status {status}");
            let r = resolve(&doc, r);
            assert!(
                r["description"].is_string(),
                "{at} {status}: no description"
            );
            if code == 204 || code == 101 {
                assert!(r.get("content").is_none(), "{at} {status}: content");
                success += 1;
                continue;
            }
            if !(200..300).contains(&code) {
                continue;
            }
            success += 1;
            let content = r["content"]
                .as_object()
                .unwrap_or_else(|| panic!("{at} {status}: no content"));
            assert!(!content.is_empty(), "{at} {status}: no content");
            for (media, c) in content {
                assert!(
                    c.get("schema").is_some(),
                    "{at} {status} {media}: no schema"
                );
                if media == "text/event-stream" {
                    let events = c["x-events"]
                        .as_object()
                        .unwrap_or_else(|| panic!("{at}: a stream without its events"));
                    assert!(!events.is_empty(), "{at}: a stream without its events");
                    for e in events.values() {
                        resolve(&doc, e);
                    }
                }
            }
        }
        assert!(success > 0, "{at}: no success answer");
    }
    // The spec's names, where it names them.
    let ops = operations(&doc);
    assert_eq!(
        ops[&("post".to_string(), "/v1/run".to_string())]["operationId"],
        "runSandbox"
    );
    assert_eq!(
        ops[&("get".to_string(), "/healthz".to_string())]["security"],
        json!([]),
        "/healthz needs no key"
    );
}

/// Every `$ref` of the document points at something.
#[test]
fn every_reference_resolves() {
    fn walk(doc: &Value, v: &Value, n: &mut usize) {
        match v {
            Value::Object(o) => {
                if let Some(r) = o.get("$ref").and_then(Value::as_str) {
                    let pointer = r
                        .strip_prefix('#')
                        .unwrap_or_else(|| panic!("{r}: not local"));
                    assert!(doc.pointer(pointer).is_some(), "{r} points at nothing");
                    *n += 1;
                }
                o.values().for_each(|x| walk(doc, x, n));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(doc, x, n)),
            _ => {}
        }
    }
    let doc = doc();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut n = 0;
    walk(&doc, &doc, &mut n);
    assert!(n > 100, "{n} references");
    // Every schema compiles as JSON Schema 2020-12.
    for (name, s) in doc["components"]["schemas"].as_object().expect("schemas") {
        validator(&doc, s).unwrap_or_else(|e| panic!("schema {name}: {e}"));
    }
}

#[test]
fn every_error_code_is_documented_with_its_status() {
    let doc = doc();
    let all: BTreeSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let listed = |v: &Value| -> BTreeSet<String> {
        v.as_array()
            .expect("an enum")
            .iter()
            .map(|c| c.as_str().expect("a code").to_string())
            .collect()
    };
    let schema = &doc["components"]["schemas"];
    let in_schema = listed(&schema["ErrorCode"]["enum"]);
    assert_eq!(
        in_schema
            .iter()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        all,
        "the ErrorCode schema's enum"
    );
    let table = doc["x-error-codes"].as_object().expect("x-error-codes");
    assert_eq!(table.len(), all.len(), "x-error-codes");
    let types = listed(&schema["ErrorType"]["enum"]);
    let mut by_status: BTreeMap<u16, BTreeSet<String>> = BTreeMap::new();
    for code in ErrorCode::ALL {
        let row = &table[code.as_str()];
        assert_eq!(row["status"], code.status(), "{code}: status");
        assert_eq!(row["type"], code.error_type(), "{code}: type");
        assert_eq!(row["retryable"], code.retryable(), "{code}: retryable");
        assert!(row["description"].is_string(), "{code}: description");
        assert!(
            types.contains(code.error_type()),
            "{code}: type not in ErrorType"
        );
        by_status
            .entry(code.status())
            .or_default()
            .insert(code.as_str().to_string());
    }
    // Per status: a shared answer whose codes are exactly that status's.
    for (status, codes) in by_status {
        let r = &doc["components"]["responses"][format!("Error{status}")];
        assert!(r.is_object(), "no answer Error{status}");
        let s = resolve(&doc, &r["content"]["application/json"]["schema"]);
        let narrowed = &s["allOf"][1]["properties"]["error"]["properties"];
        assert_eq!(
            listed(&narrowed["code"]["enum"]),
            codes,
            "Error{status}'s codes"
        );
        let ty = ErrorCode::from_code(codes.iter().next().expect("a code"))
            .expect("a code")
            .error_type();
        assert_eq!(narrowed["type"]["const"], ty, "Error{status}'s type");
    }
    // The functions interface: its S-codes and its functions.
    let s_codes: BTreeSet<String> = sbx_api::S_CODES
        .iter()
        .map(|c| c.code.to_string())
        .collect();
    assert_eq!(
        listed(&schema["FunctionError"]["properties"]["code"]["enum"]),
        s_codes
    );
    let op = &doc["paths"]["/v1/functions/{function_id}"]["post"];
    let functions: BTreeSet<String> = crate::functions::FUNCTIONS
        .iter()
        .map(|f| f.to_string())
        .collect();
    assert_eq!(listed(&op["parameters"][1]["schema"]["enum"]), functions);
}

// ---------------------------------------------------------------------------------------------
// A node on the fake driver, and its answers checked against the document.

/// A directory of its own for a test, removed when it ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sbx-openapi-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a test directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A node over `dir` whose sandboxes are `world`'s (the fake driver's harness).
fn fake_node(dir: &Path, world: &Arc<World>) -> Arc<Node> {
    sbx_node::node::fake::node_in(dir, world, |_| {})
}

fn app(node: &Arc<Node>, keys: Option<&[&str]>) -> Router {
    router(Arc::new(AppState {
        node: node.clone(),
        api_keys: keys.map(|k| k.iter().map(|s| s.to_string()).collect()),
        docs_url: None,
        cors_origins: Vec::new(),
    }))
}

/// An answer: its status, headers and body.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn media(&self) -> String {
        self.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_string())
            .unwrap_or_default()
    }
}

/// One request from a loopback caller.
async fn send(
    app: &Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "127.0.0.1:7700");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.header("content-length", body.len());
    }
    let mut req = req.body(Body::from(body.to_vec())).expect("a request");
    req.extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    let resp = tokio::time::timeout(Duration::from_secs(30), app.clone().oneshot(req))
        .await
        .unwrap_or_else(|_| panic!("{method} {uri}: no answer in 30 s"))
        .expect("an answer");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = tokio::time::timeout(
        Duration::from_secs(30),
        http_body_util::BodyExt::collect(resp.into_body()),
    )
    .await
    .unwrap_or_else(|_| panic!("{method} {uri}: the body did not end in 30 s"))
    .map(|c| c.to_bytes().to_vec())
    .unwrap_or_default();
    Answer {
        status,
        headers,
        body,
    }
}

/// A validator of `schema`, whose `#/components/...` references are the document's.
fn validator(doc: &Value, schema: &Value) -> Result<jsonschema::Validator, String> {
    let mut root = match schema {
        Value::Object(o) => o.clone(),
        Value::Bool(true) => serde_json::Map::new(),
        other => return Err(format!("{other} is not a schema")),
    };
    root.insert("components".into(), doc["components"].clone());
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(&Value::Object(root))
        .map_err(|e| e.to_string())
}

fn assert_valid(doc: &Value, schema: &Value, instance: &Value, what: &str) {
    let v = validator(doc, schema).unwrap_or_else(|e| panic!("{what}: the schema: {e}"));
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: the answer does not match the document:\n{}\n{instance:#}",
        errors.join("\n")
    );
}

/// The events of a `text/event-stream` body: (name, id, data).
fn events(body: &[u8]) -> Vec<(String, Option<String>, Value)> {
    let text = String::from_utf8_lossy(body);
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let (mut name, mut id, mut data) = (None, None, String::new());
        for line in block.lines() {
            if line.starts_with(':') {
                continue;
            }
            match line.split_once(": ") {
                Some(("event", v)) => name = Some(v.to_string()),
                Some(("id", v)) => id = Some(v.to_string()),
                Some(("data", v)) => data.push_str(v),
                _ => panic!("not an event's line: {line:?}"),
            }
        }
        let Some(name) = name else { continue };
        let data = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{name}: {e}: {data}"));
        out.push((name, id, data));
    }
    out
}

/// Checks answers (and the bodies sent) against the document, and counts what it checked.
struct Checker {
    doc: Value,
    /// The operations and statuses checked.
    seen: BTreeSet<(String, String, u16)>,
}

impl Checker {
    fn new() -> Checker {
        Checker {
            doc: doc(),
            seen: BTreeSet::new(),
        }
    }

    fn op(&self, method: &str, template: &str) -> Value {
        self.doc["paths"][template][method.to_ascii_lowercase()].clone()
    }

    /// A JSON body sent to `template`, against its requestBody.
    fn request(&self, method: &str, template: &str, body: &Value) {
        let op = self.op(method, template);
        let b = resolve(&self.doc, &op["requestBody"]);
        let schema = &b["content"]["application/json"]["schema"];
        assert!(
            schema.is_object(),
            "{method} {template}: no JSON body documented"
        );
        assert_valid(
            &self.doc,
            schema,
            body,
            &format!("{method} {template} (request)"),
        );
    }

    /// An answer of `template`, against the document's answer of its status.
    fn answer(&mut self, method: &str, template: &str, a: &Answer) {
        let what = format!("{method} {template} {}", a.status.as_u16());
        let op = self.op(method, template);
        assert!(op.is_object(), "{what}: not documented");
        let responses = &op["responses"];
        let r = responses
            .get(a.status.as_str())
            .or_else(|| responses.get("default"))
            .map(|r| resolve(&self.doc, r))
            .unwrap_or_else(|| panic!("{what}: no answer documented"));
        if a.status.is_client_error() || a.status.is_server_error() {
            assert!(
                responses.get("default").is_some(),
                "{what}: failures are documented"
            );
        }
        let rid = a
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("{what}: no X-Request-Id"));
        assert!(sbx_api::valid_request_id(rid), "{what}: X-Request-Id {rid}");
        self.seen
            .insert((method.to_string(), template.to_string(), a.status.as_u16()));
        let Some(content) = r.get("content").and_then(Value::as_object) else {
            assert!(a.body.is_empty(), "{what}: a body where none is documented");
            return;
        };
        let media = a.media();
        let c = content
            .get(&media)
            .or_else(|| content.get("*/*"))
            .unwrap_or_else(|| panic!("{what}: {media:?} is not documented"));
        match media.as_str() {
            "application/json" => {
                let v: Value = serde_json::from_slice(&a.body)
                    .unwrap_or_else(|e| panic!("{what}: not JSON: {e}"));
                assert_valid(&self.doc, &c["schema"], &v, &what);
            }
            "text/event-stream" => {
                let evs = events(&a.body);
                assert!(!evs.is_empty(), "{what}: no event");
                for (name, id, data) in evs {
                    let schema = c["x-events"]
                        .get(&name)
                        .unwrap_or_else(|| panic!("{what}: event {name} is not documented"));
                    assert!(
                        id.as_deref().is_some_and(|i| i.parse::<u64>().is_ok()),
                        "{what}: event {name} has id {id:?}"
                    );
                    assert_valid(&self.doc, schema, &data, &format!("{what} event {name}"));
                }
            }
            "text/plain" => {
                let text = Value::String(String::from_utf8_lossy(&a.body).into_owned());
                assert_valid(&self.doc, &c["schema"], &text, &what);
            }
            _ => {}
        }
    }
}

/// Requests to a router, each body checked against the document before it is sent and each
/// answer after.
struct Client<'a> {
    app: &'a Router,
    ck: Checker,
}

impl Client<'_> {
    /// `route` (`POST /v1/sandboxes/{id}/exec`) called at `uri`, with a JSON body.
    async fn go(&mut self, route: &str, uri: &str, body: Option<Value>) -> Answer {
        self.go_with(route, uri, &[], body).await
    }

    async fn go_with(
        &mut self,
        route: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Answer {
        let (method, template) = route.split_once(' ').expect("METHOD /path");
        let a = match &body {
            Some(b) => {
                self.ck.request(method, template, b);
                let mut h = vec![("content-type", "application/json")];
                h.extend_from_slice(headers);
                send(self.app, method, uri, &h, b.to_string().as_bytes()).await
            }
            None => send(self.app, method, uri, headers, b"").await,
        };
        self.ck.answer(method, template, &a);
        a
    }

    /// A body sent as it is (not JSON, or of another type), its answer checked.
    async fn raw(&mut self, route: &str, uri: &str, media: &str, body: &str) -> Answer {
        let (method, template) = route.split_once(' ').expect("METHOD /path");
        let a = send(
            self.app,
            method,
            uri,
            &[("content-type", media)],
            body.as_bytes(),
        )
        .await;
        self.ck.answer(method, template, &a);
        a
    }
}

fn code(a: &Answer) -> String {
    a.json()["error"]["code"].as_str().unwrap_or("").to_string()
}

async fn stop(node: &Arc<Node>) {
    node.shutdown().await;
    let t0 = Instant::now();
    while node.pending_teardowns() > 0 && t0.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The path of a route with its parameters filled in: names of nothing the node has.
fn fill(path: &str) -> String {
    path.split('/')
        .map(|part| match part {
            "{function_id}" => "sandbox::none",
            "{exec_id}" => "exe-none",
            p if p.starts_with('{') => "none",
            p => p,
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Each route answers its documented methods (with an answer the document has), and each other
/// method of its path is 405: the router is the document's table, seen from outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_answers_what_is_documented() {
    let dir = TempDir::new("routes");
    let world = World::new();
    let node = fake_node(&dir.0, &world);
    let app = app(&node, None);
    let mut ck = Checker::new();
    let ops = operations(&ck.doc);
    let paths: BTreeSet<&String> = ops.keys().map(|(_, p)| p).collect();
    for path in paths {
        let uri = fill(path);
        for method in ["get", "post", "put", "patch", "delete"] {
            let documented = ops.contains_key(&(method.to_string(), path.clone()));
            let m = method.to_ascii_uppercase();
            let a = send(&app, &m, &uri, &[], b"").await;
            let c = code(&a);
            if documented {
                assert_ne!(c, "method_not_allowed", "{m} {path}");
                let no_route = c == "not_found" && a.json()["error"]["message"] == "no such route";
                assert!(!no_route, "{m} {path}: no such route");
                ck.answer(&m, path, &a);
            } else {
                assert_eq!(
                    (a.status.as_u16(), c.as_str()),
                    (405, "method_not_allowed"),
                    "{m} {path}"
                );
            }
        }
    }
    let a = send(&app, "GET", "/v1/nothing", &[], b"").await;
    assert_eq!((a.status.as_u16(), code(&a).as_str()), (404, "not_found"));
    stop(&node).await;
}

/// On a node with keys, only the operations documented with `security: []` answer a caller
/// without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_what_is_documented_so_goes_without_a_key() {
    let dir = TempDir::new("keys");
    let world = World::new();
    let node = fake_node(&dir.0, &world);
    let app = app(&node, Some(&["key-1"]));
    let ck = Checker::new();
    for ((method, path), op) in operations(&ck.doc) {
        let public = op.get("security") == Some(&json!([]));
        let m = method.to_ascii_uppercase();
        let a = send(&app, &m, &fill(&path), &[], b"").await;
        if public {
            assert_ne!(a.status, StatusCode::UNAUTHORIZED, "{m} {path}");
        } else {
            assert_eq!(
                (a.status.as_u16(), code(&a).as_str()),
                (401, "missing_api_key"),
                "{m} {path}"
            );
        }
    }
    let a = send(
        &app,
        "GET",
        "/openapi.json",
        &[("authorization", "Bearer key-1")],
        b"",
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.body,
        DOCUMENT.as_bytes(),
        "the document as it is checked in"
    );
    stop(&node).await;
}

/// Real answers of the node, one or more of each kind, are what the document says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_answers_match_the_document() {
    let dir = TempDir::new("answers");
    let world = World::new();
    let node = fake_node(&dir.0, &world);
    let app = app(&node, None);
    let mut c = Client {
        app: &app,
        ck: Checker::new(),
    };
    let sse = [("accept", "text/event-stream")];
    let id_of = |a: &Answer| a.json()["id"].as_str().unwrap_or_default().to_string();

    // The node.
    c.go("GET /openapi.json", "/openapi.json", None).await;
    c.go("GET /healthz", "/healthz", None).await;
    let a = c.go("GET /internal/node", "/internal/node", None).await;
    assert_eq!(a.status, StatusCode::OK);
    c.go("GET /internal/templates", "/internal/templates", None)
        .await;
    let a = c
        .go(
            "POST /internal/templates",
            "/internal/templates",
            Some(json!({})),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());

    // Runs, as JSON and as a stream, and refusals.
    let run =
        json!({"command": "echo hello", "env": {"A": "1"}, "limits": {"vcpus": 1}, "tmp": null});
    let a = c.go("POST /v1/run", "/v1/run", Some(run)).await;
    assert_eq!(
        (a.status, &a.json()["stdout"]),
        (StatusCode::OK, &json!("hello\n"))
    );
    let run = json!({"command": ["echo-err", "oops"], "timeout_seconds": 10, "user": "root"});
    let a = c.go_with("POST /v1/run", "/v1/run", &sse, Some(run)).await;
    let names: Vec<String> = events(&a.body).into_iter().map(|e| e.0).collect();
    assert_eq!(
        names.first().map(String::as_str),
        Some("start"),
        "{names:?}"
    );
    assert_eq!(names.last().map(String::as_str), Some("exit"), "{names:?}");
    assert!(names.contains(&"stderr".to_string()), "{names:?}");
    let json = "application/json";
    let a = c
        .raw(
            "POST /v1/run",
            "/v1/run",
            json,
            r#"{"command": "true", "bogus": 1}"#,
        )
        .await;
    assert_eq!(code(&a), "unknown_field");
    let a = c
        .raw("POST /v1/run", "/v1/run", json, r#"{"command": "#)
        .await;
    assert_eq!(code(&a), "invalid_json");
    let a = c.raw("POST /v1/run", "/v1/run", "text/plain", "{}").await;
    assert_eq!(code(&a), "unsupported_media_type");

    // A kept sandbox.
    let create = json!({"name": "box", "metadata": {"team": "a"}, "env": {"A": "1"},
        "secret_env": {"S": "x"}, "stop": {"signal": "TERM", "grace_ms": 100}});
    let key = [("idempotency-key", "k-1")];
    let a = c
        .go_with("POST /v1/sandboxes", "/v1/sandboxes", &key, Some(create))
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json());
    assert!(a.json()["token"].is_string());
    let id = id_of(&a);
    c.go("GET /v1/sandboxes", "/v1/sandboxes", None).await;
    let q = "/v1/sandboxes?metadata.team=a&limit=1&status=running";
    let a = c.go("GET /v1/sandboxes", q, None).await;
    assert_eq!(
        a.json()["data"].as_array().map(Vec::len),
        Some(1),
        "{}",
        a.json()
    );
    let a = c
        .go("GET /v1/sandboxes", "/v1/sandboxes?bogus=1", None)
        .await;
    assert_eq!(code(&a), "unknown_parameter");
    c.go("GET /v1/sandboxes/{id}", "/v1/sandboxes/box", None)
        .await;
    c.go("GET /v1/sandboxes/{id}", "/v1/sandboxes/nobody", None)
        .await;
    let patch = "PATCH /v1/sandboxes/{id}";
    c.go(
        patch,
        "/v1/sandboxes/box",
        Some(json!({"expires_at": null})),
    )
    .await;
    c.go(
        patch,
        "/v1/sandboxes/box",
        Some(json!({"egress": {"deny_ports": [25]}})),
    )
    .await;

    // Its commands: one that ends, one that reads its input, one ended by a signal.
    let exec = "POST /v1/sandboxes/{id}/exec";
    let at = "/v1/sandboxes/box/exec";
    let a = c
        .go(
            exec,
            at,
            Some(json!({"command": "echo one two", "wait_seconds": 5})),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json());
    let done = id_of(&a);
    let cat = id_of(
        &c.go(
            exec,
            at,
            Some(json!({"command": "cat", "stdin_open": true})),
        )
        .await,
    );
    let stdin = "POST /v1/sandboxes/{id}/exec/{exec_id}/stdin";
    let input = json!({"data": "abc", "close": true});
    let a = c.go(stdin, &format!("{at}/{cat}/stdin"), Some(input)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    let get = "GET /v1/sandboxes/{id}/exec/{exec_id}";
    let a = c
        .go(
            get,
            &format!("{at}/{cat}?wait_seconds=5&encoding=base64"),
            None,
        )
        .await;
    assert_eq!(a.json()["status"], "exited", "{}", a.json());
    let long = id_of(&c.go(exec, at, Some(json!({"command": "sleep 30"}))).await);
    let signal = "POST /v1/sandboxes/{id}/exec/{exec_id}/signal";
    let kill = json!({"signal": "SIGKILL"});
    let a = c
        .go(signal, &format!("{at}/{long}/signal"), Some(kill))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    c.go(get, &format!("{at}/{long}?wait_seconds=5"), None)
        .await;
    let a = c
        .go(signal, &format!("{at}/{long}/signal"), Some(json!({})))
        .await;
    assert_eq!(code(&a), "exec_ended");
    c.go("GET /v1/sandboxes/{id}/exec", at, None).await;
    let output = "GET /v1/sandboxes/{id}/exec/{exec_id}/output";
    let a = c
        .go(output, &format!("{at}/{done}/output?from=2"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    let a = c
        .go_with(output, &format!("{at}/{done}/output"), &sse, None)
        .await;
    assert_eq!(a.media(), "text/event-stream");
    let resume = [("last-event-id", "3")];
    let uri = format!("{at}/{done}/output?stream=true&encoding=base64");
    c.go_with(output, &uri, &resume, None).await;
    c.go(output, &format!("{at}/exe-none/output"), None).await;
    let run = "POST /v1/sandboxes/{id}/run";
    let a = c
        .go(
            run,
            "/v1/sandboxes/box/run",
            Some(json!({"command": ["echo", "ran"]})),
        )
        .await;
    assert_eq!(a.json()["stdout"], "ran\n", "{}", a.json());
    let a = c
        .go_with(
            run,
            "/v1/sandboxes/box/run",
            &sse,
            Some(json!({"command": "true"})),
        )
        .await;
    assert_eq!(a.media(), "text/event-stream");
    let terminal = "GET /v1/sandboxes/{id}/exec/{exec_id}/terminal";
    let a = c.go(terminal, &format!("{at}/{done}/terminal"), None).await;
    assert_eq!(code(&a), "invalid_field", "not a WebSocket");

    // Files: the fake agent serves none, so these are its refusals.
    let files = "/v1/sandboxes/box/files";
    c.go(
        "GET /v1/sandboxes/{id}/files",
        &format!("{files}?path=/etc/hostname"),
        None,
    )
    .await;
    c.go(
        "GET /v1/sandboxes/{id}/files/list",
        &format!("{files}/list?path=/"),
        None,
    )
    .await;
    let a = c
        .go(
            "GET /v1/sandboxes/{id}/files/stat",
            &format!("{files}/stat?bogus=1"),
            None,
        )
        .await;
    assert_eq!(code(&a), "fs_invalid");
    let mkdir = json!({"path": "/w", "parents": true, "mode": "0755"});
    c.go(
        "POST /v1/sandboxes/{id}/files/mkdir",
        &format!("{files}/mkdir"),
        Some(mkdir),
    )
    .await;
    let grep = json!({"pattern": "x", "include": ["*.rs"], "max_matches": 3});
    let uri = format!("{files}/grep?path=/w");
    c.go("POST /v1/sandboxes/{id}/files/grep", &uri, Some(grep))
        .await;
    let uri = format!("{files}?path=/w/f");
    c.raw("PUT /v1/sandboxes/{id}/files", &uri, "text/plain", "bytes")
        .await;

    // Sleep, snapshots and forks: a node without CRIU refuses them.
    c.go(
        "POST /v1/sandboxes/{id}/sleep",
        "/v1/sandboxes/box/sleep",
        None,
    )
    .await;
    c.go(
        "POST /v1/sandboxes/{id}/wake",
        "/v1/sandboxes/box/wake",
        Some(json!({})),
    )
    .await;
    let snap = json!({"name": "before"});
    c.go(
        "POST /v1/sandboxes/{id}/snapshots",
        "/v1/sandboxes/box/snapshots",
        Some(snap),
    )
    .await;
    c.go(
        "POST /v1/sandboxes/{id}/fork",
        "/v1/sandboxes/box/fork",
        Some(json!({"count": 2})),
    )
    .await;
    let a = c.go("GET /v1/snapshots", "/v1/snapshots", None).await;
    assert_eq!(a.status, StatusCode::OK);
    c.go("GET /v1/snapshots/{id}", "/v1/snapshots/before", None)
        .await;

    // Volumes: a node without a disk refuses them.
    let volume = json!({"name": "data", "size_bytes": 1048576});
    c.go("POST /v1/volumes", "/v1/volumes", Some(volume)).await;
    c.go("GET /v1/volumes", "/v1/volumes", None).await;

    // Secrets.
    let put = "PUT /v1/secrets/{name}";
    let secret = json!({"value": "s3cret", "allowed_hosts": ["api.example.com", "*.example.org"]});
    let a = c.go(put, "/v1/secrets/tok", Some(secret)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.json());
    let a = c
        .go(put, "/v1/secrets/tok", Some(json!({"value": "other"})))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    c.go("GET /v1/secrets", "/v1/secrets", None).await;
    c.go("GET /v1/secrets/{name}", "/v1/secrets/tok", None)
        .await;
    let a = c
        .go("DELETE /v1/secrets/{name}", "/v1/secrets/tok", None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    let a = c
        .go("GET /v1/secrets/{name}", "/v1/secrets/tok", None)
        .await;
    assert_eq!(code(&a), "secret_not_found");

    // Images: the list, a refusal, and a pull that fails (nothing listens there).
    c.go("GET /v1/images", "/v1/images", None).await;
    let pull = "POST /v1/images/pull";
    let a = c
        .go(pull, "/v1/images/pull", Some(json!({"image": "base"})))
        .await;
    assert_eq!(code(&a), "invalid_image");
    let nowhere = json!({"image": "127.0.0.1:9/none/img:1"});
    let a = c.go(pull, "/v1/images/pull", Some(nowhere)).await;
    let last = events(&a.body).pop().map(|e| e.0);
    assert_eq!(last.as_deref(), Some("error"));

    // The functions interface.
    let call = "POST /v1/functions/{function_id}";
    let a = c
        .go(call, "/v1/functions/sandbox::list", Some(json!({})))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    c.go(
        call,
        "/v1/functions/sandbox::exec",
        Some(json!({"id": "nobody"})),
    )
    .await;

    // A restart, then the deletes.
    let uri = format!("/v1/sandboxes/{id}/restart");
    let a = c.go("POST /v1/sandboxes/{id}/restart", &uri, None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.json());
    let a = c
        .go("DELETE /v1/sandboxes/{id}", "/v1/sandboxes/box", None)
        .await;
    assert_eq!(a.json()["status"], "deleted", "{}", a.json());
    c.go("DELETE /v1/snapshots/{id}", "/v1/snapshots/before", None)
        .await;
    c.go("DELETE /v1/volumes/{id}", "/v1/volumes/data", None)
        .await;

    // Successes of most kinds were checked.
    let ok: BTreeSet<(&str, &str)> =
        c.ck.seen
            .iter()
            .filter(|(_, _, s)| (200..300).contains(s))
            .map(|(m, p, _)| (m.as_str(), p.as_str()))
            .collect();
    eprintln!(
        "answers checked: {} (operation, status) pairs; successes of {} of {} operations",
        c.ck.seen.len(),
        ok.len(),
        operations(&c.ck.doc).len()
    );
    assert!(
        ok.len() >= 25,
        "successes of {} operations: {ok:?}",
        ok.len()
    );
    stop(&node).await;
}

//! E2B compatibility: E2B's own SDKs, the real ones from PyPI and npm (pinned and installed by
//! scripts/e2b-sdks.sh, which test.sh runs), drive a node unchanged through `--e2b-listen`,
//! pointed at it by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY only. The SDKs' scripts are
//! in tests/e2b/; each prints a line per check. Plus what the SDKs do not show: the key
//! checks, E2B's error body, envd's access token, and envd through the preview listener.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common::{free_port, unique, TestNode};

/// E2B's form of key: `e2b_` and 40 hex digits.
const KEY: &str = "e2b_53b0cd1f8a70d2c1b0a4fd6e9a0b7e0c5d2f1a3b";

/// Where scripts/e2b-sdks.sh put the SDKs.
fn sdk_dir() -> PathBuf {
    let dir = std::env::var_os("SBX_E2B_SDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/e2b-sdk"));
    assert!(
        dir.join("stamp").is_file(),
        "E2B's SDKs are not installed in {}: run scripts/e2b-sdks.sh (test.sh does)",
        dir.display()
    );
    dir
}

fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2b")
}

/// A node with the E2B listener and one key; its E2B address.
fn node() -> (TestNode, String, PathBuf) {
    let dir = std::env::temp_dir().join(unique("sbx-test-e2b"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("{KEY}\n")).unwrap();
    let e2b = format!("127.0.0.1:{}", free_port());
    let mut node =
        TestNode::start_with(&["--api-keys", keys.to_str().unwrap(), "--e2b-listen", &e2b]);
    node.auth = Some(format!("Bearer {KEY}"));
    (node, e2b, dir)
}

/// Runs an SDK script (python3 of the venv, or node for .mjs) against the node; its output.
fn run_script(e2b: &str, script: &str) -> String {
    let sdk = sdk_dir();
    let path = scripts().join(script);
    let url = format!("http://{e2b}");
    let mut cmd = if script.ends_with(".mjs") {
        // The script is run from the SDK's node project, so that `import 'e2b'` finds it.
        let copy = sdk.join("npm").join(script);
        std::fs::copy(&path, &copy).unwrap();
        let mut c = Command::new("node");
        c.arg(&copy).current_dir(sdk.join("npm"));
        c
    } else {
        let mut c = Command::new(sdk.join("venv/bin/python"));
        c.arg(&path);
        c
    };
    let path_env = format!(
        "{}:{}",
        sdk.join("venv/bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = cmd
        .env("PATH", path_env)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("all passed"),
        "{script} failed ({}):\n{text}",
        out.status
    );
    text
}

fn call(method: &str, url: &str, headers: &[(&str, &str)], body: Option<&str>) -> (u16, String) {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    let mut req = agent.request(method, url);
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let r = match body {
        Some(b) => req.send_string(b),
        None => req.call(),
    };
    match r {
        Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

#[test]
fn e2b_s_python_sdk_drives_a_node_unchanged() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "sdk_basics.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn e2b_s_code_interpreter_sdk_runs_code_with_state() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "code_interpreter.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn e2b_s_code_interpreter_sdk_gets_e2b_s_results_and_charts() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "code_interpreter_results.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn e2b_s_code_interpreter_sdk_contexts_streams_and_timeouts() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "code_interpreter_contexts.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn e2b_s_npm_sdk_drives_a_node_unchanged() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "basics.mjs");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn keys_tokens_and_errors_are_e2b_s() {
    let (node, e2b, dir) = node();
    let base = format!("http://{e2b}");
    // The control plane: X-API-KEY, E2B's error body.
    for headers in [vec![], vec![("X-API-KEY", "e2b_00")]] {
        let (status, body) = call("GET", &format!("{base}/v2/sandboxes"), &headers, None);
        assert_eq!(status, 401, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["code"], 401, "{v}");
        assert!(v["message"].as_str().unwrap().contains("X-API-KEY"), "{v}");
    }
    let key = [("X-API-KEY", KEY), ("Content-Type", "application/json")];
    let (status, body) = call(
        "POST",
        &format!("{base}/sandboxes"),
        &key,
        Some(r#"{"templateID":"base","timeout":60}"#),
    );
    assert_eq!(status, 201, "{body}");
    let sb: Value = serde_json::from_str(&body).unwrap();
    let id = sb["sandboxID"].as_str().unwrap().to_string();
    let token = sb["envdAccessToken"].as_str().unwrap().to_string();
    assert!(token.starts_with("sbt_"), "{sb}");
    assert_eq!(sb["envdVersion"], "0.6.4", "{sb}");
    // Paging: X-Next-Token, then nextToken.
    let (status, body) = call(
        "POST",
        &format!("{base}/v2/sandboxes"),
        &key,
        Some(r#"{"templateID":"base","timeout":60,"metadata":{"page":"yes"}}"#),
    );
    assert_eq!(status, 201, "{body}");
    let second = serde_json::from_str::<Value>(&body).unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_string();
    let agent = ureq::AgentBuilder::new().build();
    let page = |q: &str| {
        let r = agent
            .get(&format!("{base}/v2/sandboxes?{q}"))
            .set("X-API-KEY", KEY)
            .call()
            .unwrap();
        let next = r.header("x-next-token").map(str::to_string);
        let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
        let ids: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["sandboxID"].as_str().unwrap().to_string())
            .collect();
        (ids, next)
    };
    let (first_page, next) = page("limit=1&state=running");
    assert_eq!(first_page.len(), 1);
    let next = next.expect("X-Next-Token");
    let (second_page, last) = page(&format!("limit=1&nextToken={next}"));
    assert_eq!(second_page.len(), 1);
    assert_ne!(first_page, second_page);
    assert!(last.is_none(), "{last:?}");
    let mut both = [first_page[0].clone(), second_page[0].clone()];
    both.sort();
    let mut want = [id.clone(), second.clone()];
    want.sort();
    assert_eq!(both, want);
    assert_eq!(page("metadata=page%3Dyes").0, vec![second.clone()]);
    assert!(page("state=paused").0.is_empty());
    let (status, _) = call("DELETE", &format!("{base}/sandboxes/{second}"), &key, None);
    assert_eq!(status, 204);
    // What the node does not do is refused, not ignored.
    let (status, body) = call(
        "POST",
        &format!("{base}/v2/sandboxes"),
        &key,
        Some(r#"{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}"#),
    );
    assert_eq!(status, 501, "{body}");
    assert!(body.contains("not served"), "{body}");
    // Pause is the node's sleep (held asleep): 204, then 409; listed paused; connect resumes
    // it (201).
    let (status, body) = call("POST", &format!("{base}/sandboxes/{id}/pause"), &key, None);
    assert_eq!(status, 204, "{body}");
    let (status, body) = call("POST", &format!("{base}/sandboxes/{id}/pause"), &key, None);
    assert_eq!(status, 409, "{body}");
    assert_eq!(page("state=paused").0, vec![id.clone()]);
    let (status, body) = call(
        "POST",
        &format!("{base}/sandboxes/{id}/connect"),
        &key,
        Some(r#"{"timeout":60}"#),
    );
    assert_eq!(status, 201, "{body}");
    assert!(page("state=paused").0.is_empty());
    let (status, body) = call(
        "GET",
        &format!("{base}/sandboxes/sbx-0000000000000000"),
        &key,
        None,
    );
    assert_eq!(status, 404, "{body}");
    // envd: the sandbox's token, nothing else (the node has keys: no loopback pass).
    let envd = |token: Option<&str>| {
        let mut h = vec![
            ("E2b-Sandbox-Id", id.as_str()),
            ("E2b-Sandbox-Port", "49983"),
        ];
        if let Some(t) = token {
            h.push(("X-Access-Token", t));
        }
        call("GET", &format!("{base}/health"), &h, None).0
    };
    assert_eq!(envd(Some(&token)), 204);
    assert_eq!(envd(None), 401);
    assert_eq!(envd(Some("sbt_wrong")), 401);
    // envd through the preview listener: 49983-{id}.{domain}.
    let preview = node.preview_addr().expect("a preview listener");
    let host = format!("49983-{id}.localhost");
    let (status, _) = call(
        "GET",
        &format!("http://{preview}/health"),
        &[("Host", &host), ("X-Access-Token", &token)],
        None,
    );
    assert_eq!(status, 204);
    let (status, _) = call(
        "GET",
        &format!("http://{preview}/health"),
        &[("Host", &host)],
        None,
    );
    assert_eq!(status, 401);
    let (status, body) = call("DELETE", &format!("{base}/sandboxes/{id}"), &key, None);
    assert_eq!(status, 204, "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// `call` with a body of bytes and no Content-Type but those of `headers` (ureq's
/// `send_string` would add text/plain): (status, body).
fn call_bytes(method: &str, url: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    let mut req = agent.request(method, url);
    for (k, v) in headers {
        req = req.set(k, v);
    }
    match req.send_bytes(body) {
        Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

/// A server of the stdlib alone, on the port of its first argument: every GET answered with
/// its path and headers, as JSON.
const ECHO: &str = r#"
import sys, json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        h = {k.lower(): v for k, v in self.headers.items()}
        body = json.dumps({"path": self.path, "headers": h}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"#;

/// Creates a sandbox through the E2B listener at `base` (with `key`, if any): (id, token).
fn e2b_sandbox(base: &str, key: Option<&str>) -> (String, String) {
    let mut h = vec![("Content-Type", "application/json")];
    if let Some(k) = key {
        h.push(("X-API-KEY", k));
    }
    let (status, body) = call(
        "POST",
        &format!("{base}/sandboxes"),
        &h,
        Some(r#"{"templateID":"base","timeout":120}"#),
    );
    assert_eq!(status, 201, "{body}");
    let sb: Value = serde_json::from_str(&body).unwrap();
    (
        sb["sandboxID"].as_str().unwrap().to_string(),
        sb["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

#[test]
fn the_node_s_credentials_never_reach_a_sandbox_s_service() {
    let (node, e2b, dir) = node();
    let base = format!("http://{e2b}");
    let (id, token) = e2b_sandbox(&base, Some(KEY));
    let bearer = format!("Bearer {KEY}");
    let r = node.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &[("Authorization", bearer.as_str())],
        serde_json::json!({ "command": ["python3", "-c", ECHO, "8000"] })
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 201, "start the server: {}", r.text());
    let port = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("E2b-Sandbox-Port", "8000"),
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut h = port.to_vec();
        h.push(("X-Access-Token", &token));
        let (status, body) = call("GET", &format!("{base}/up"), &h, None);
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "port 8000 did not open: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let cookie = format!("theirs=1; sbx_token={token}");
    let seen = |url: &str, headers: &[(&str, &str)]| {
        let (status, body) = call("GET", url, headers, None);
        assert_eq!(status, 200, "{body}");
        assert!(
            !body.contains(KEY) && !body.contains(&token),
            "the service saw a credential of the node: {body}"
        );
        let v: Value = serde_json::from_str(&body).unwrap();
        v
    };
    // Every credential of the node at once, through the E2B listener: none reaches the
    // service; what is the service's own does.
    let mut all = port.to_vec();
    all.extend([
        ("X-API-KEY", KEY),
        ("Authorization", bearer.as_str()),
        ("X-Access-Token", token.as_str()),
        ("E2B-Traffic-Access-Token", token.as_str()),
        ("X-Sbx-Token", token.as_str()),
        ("Cookie", cookie.as_str()),
        ("X-Mine", "kept"),
    ]);
    let v = seen(&format!("{base}/headers?a=1&sbx_token={token}"), &all);
    let h = &v["headers"];
    for name in [
        "x-api-key",
        "authorization",
        "x-access-token",
        "e2b-traffic-access-token",
        "x-sbx-token",
    ] {
        assert!(h.get(name).is_none(), "{name} reached the service: {v}");
    }
    assert_eq!(h["cookie"], "theirs=1", "{v}");
    assert_eq!(h["x-mine"], "kept", "{v}");
    assert_eq!(v["path"], "/headers?a=1", "{v}");
    // Each key form alone lets the caller in, and stays behind.
    for k in [("X-API-KEY", KEY), ("Authorization", bearer.as_str())] {
        let mut h = port.to_vec();
        h.push(k);
        let v = seen(&format!("{base}/headers"), &h);
        assert!(v["headers"].get(k.0.to_ascii_lowercase()).is_none(), "{v}");
    }
    // The preview listener takes them out too.
    let preview = node.preview_addr().expect("a preview listener");
    let pport = preview.rsplit(':').next().unwrap();
    let host = format!("8000-{id}.localhost:{pport}");
    let v = seen(
        &format!("http://{preview}/headers"),
        &[
            ("Host", host.as_str()),
            ("X-API-KEY", KEY),
            ("Authorization", bearer.as_str()),
            ("X-Access-Token", token.as_str()),
        ],
    );
    for name in ["x-api-key", "authorization", "x-access-token"] {
        assert!(
            v["headers"].get(name).is_none(),
            "{name} reached the service: {v}"
        );
    }
    let (status, body) = call(
        "DELETE",
        &format!("{base}/sandboxes/{id}"),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(status, 204, "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_keyless_node_s_e2b_listener_serves_loopback_hosts_and_its_own_pages_only() {
    let e2b = format!("127.0.0.1:{}", free_port());
    let node = TestNode::start_with(&["--e2b-listen", &e2b, "--cors-origin", "http://app.example"]);
    let base = format!("http://{e2b}");
    let port = e2b.rsplit(':').next().unwrap();
    let evil_host = format!("evil.example:{port}");
    let json = ("Content-Type", "application/json");
    // A page whose name was rebound to 127.0.0.1 sends its own name: refused on every route.
    let (status, body) = call(
        "GET",
        &format!("{base}/v2/sandboxes"),
        &[("Host", &evil_host)],
        None,
    );
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("loopback"), "{body}");
    let (status, body) = call(
        "POST",
        &format!("{base}/sandboxes"),
        &[("Host", &evil_host), json],
        Some(r#"{"templateID":"base"}"#),
    );
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("envdAccessToken"), "{body}");
    // A page of another origin: refused; the listener's own: served.
    let (status, body) = call(
        "GET",
        &format!("{base}/v2/sandboxes"),
        &[("Origin", "http://evil.example")],
        None,
    );
    assert_eq!(status, 403, "{body}");
    let own = format!("http://{e2b}");
    let (status, body) = call(
        "GET",
        &format!("{base}/v2/sandboxes"),
        &[("Origin", &own)],
        None,
    );
    assert_eq!(status, 200, "{body}");
    // One of --cors-origin: its preflight answered, its answers with CORS headers.
    let agent = ureq::AgentBuilder::new().build();
    let r = agent
        .request("OPTIONS", &format!("{base}/sandboxes"))
        .set("Origin", "http://app.example")
        .set("Access-Control-Request-Method", "POST")
        .set("Access-Control-Request-Headers", "x-api-key, content-type")
        .call()
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("x-api-key, content-type")
    );
    let r = agent
        .get(&format!("{base}/v2/sandboxes"))
        .set("Origin", "http://app.example")
        .call()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let (id, token) = e2b_sandbox(&base, None);
    let envd = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("E2b-Sandbox-Port", "49983"),
    ];
    let r = node.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &[],
        br#"{"command": "echo keep > /tmp/victim", "wait_seconds": 10}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let victim = || {
        let mut h = envd.to_vec();
        h.push(("X-Access-Token", &token));
        call("GET", &format!("{base}/files?path=/tmp/victim"), &h, None)
    };
    assert_eq!(victim(), (200, "keep\n".to_string()));
    // The sandbox side: the same Host rule (here even with the token).
    let start = r#"{"process":{"cmd":"/bin/sh","args":["-c","rm /tmp/victim"]}}"#;
    let mut h = envd.to_vec();
    h.extend([
        ("Host", evil_host.as_str()),
        json,
        ("Connect-Protocol-Version", "1"),
        ("X-Access-Token", token.as_str()),
    ]);
    let (status, body) = call(
        "POST",
        &format!("{base}/process.Process/Start"),
        &h,
        Some(start),
    );
    assert_eq!(status, 403, "{body}");
    let mut h = envd.to_vec();
    h.extend([("Origin", "http://evil.example"), json]);
    let (status, body) = call(
        "POST",
        &format!("{base}/filesystem.Filesystem/Remove"),
        &h,
        Some(r#"{"path":"/tmp/victim"}"#),
    );
    assert_eq!(status, 403, "{body}");
    // A request any page could send (no Content-Type, no header of its own) from loopback
    // changes nothing without the token.
    let remove = br#"{"path":"/tmp/victim"}"#;
    let (status, body) = call_bytes(
        "POST",
        &format!("{base}/filesystem.Filesystem/Remove"),
        &envd,
        remove,
    );
    assert_eq!(status, 403, "{body}");
    assert_eq!(victim(), (200, "keep\n".to_string()));
    // A client's request (Connect's headers) from loopback does, as before.
    let mut h = envd.to_vec();
    h.extend([json, ("Connect-Protocol-Version", "1")]);
    let (status, body) = call_bytes(
        "POST",
        &format!("{base}/filesystem.Filesystem/Remove"),
        &h,
        remove,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(victim().0, 404);
    let (status, body) = call("DELETE", &format!("{base}/sandboxes/{id}"), &[], None);
    assert_eq!(status, 204, "{body}");
    node.assert_clean(Duration::from_secs(20));
}

/// The gzip of `data`.
fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

#[test]
fn e2b_uploads_that_fail_leave_the_target_and_unknown_users_are_refused() {
    let (node, e2b, dir) = node();
    let base = format!("http://{e2b}");
    let (id, token) = e2b_sandbox(&base, Some(KEY));
    let envd = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("E2b-Sandbox-Port", "49983"),
        ("X-Access-Token", token.as_str()),
    ];
    let octets = ("Content-Type", "application/octet-stream");
    let upload = |path: &str, extra: &[(&str, &str)], body: &[u8]| {
        let mut h = envd.to_vec();
        h.push(octets);
        h.extend_from_slice(extra);
        call_bytes("POST", &format!("{base}/files?path={path}"), &h, body)
    };
    let read = |path: &str| call("GET", &format!("{base}/files?path={path}"), &envd, None);
    let holds = |path: &str, want: &str| {
        let (status, body) = read(path);
        assert!(
            status == 200 && body == want,
            "{path}: {status}, {} bytes, not {want:?}: {:?}",
            body.len(),
            body.chars().take(100).collect::<String>()
        );
    };
    let (status, body) = upload("/tmp/keep.txt", &[], b"original");
    assert_eq!(status, 200, "{body}");
    holds("/tmp/keep.txt", "original");
    // A gzip body cut off, and one that is not gzip: refused, the file as it was.
    let big: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut cut = gzip(&big);
    cut.truncate(cut.len() / 2);
    let gz = ("Content-Encoding", "gzip");
    for bad in [cut.as_slice(), b"not gzip at all".as_slice()] {
        let (status, body) = upload("/tmp/keep.txt", &[gz], bad);
        assert!(
            status >= 400,
            "a broken gzip body was taken: {status} {body}"
        );
        holds("/tmp/keep.txt", "original");
        // A new file: not left behind.
        let (status, body) = upload("/tmp/new.txt", &[gz], bad);
        assert!(
            status >= 400,
            "a broken gzip body was taken: {status} {body}"
        );
        assert_eq!(read("/tmp/new.txt").0, 404);
    }
    // A whole one is written.
    let (status, body) = upload("/tmp/keep.txt", &[gz], &gzip(b"replaced"));
    assert_eq!(status, 200, "{body}");
    holds("/tmp/keep.txt", "replaced");
    // A user the sandbox does not have is refused, not served as root; `user` (the SDK's
    // default) and root are served in their homes.
    let (status, body) = call(
        "GET",
        &format!("{base}/files?path=keep.txt&username=alice"),
        &envd,
        None,
    );
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("invalid username"), "{body}");
    let (status, body) = upload("x.txt&username=alice", &[], b"x");
    assert_eq!(status, 401, "{body}");
    let (status, body) = upload("home.txt", &[], b"mine");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("/home/user/home.txt"), "{body}");
    let (status, body) = upload("root.txt&username=root", &[], b"mine");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("/root/root.txt"), "{body}");
    let alice = format!("Basic {}", {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode("alice:")
    });
    let mut h = envd.to_vec();
    h.extend([
        ("Content-Type", "application/json"),
        ("Authorization", alice.as_str()),
    ]);
    let (status, body) = call(
        "POST",
        &format!("{base}/filesystem.Filesystem/Stat"),
        &h,
        Some(r#"{"path":"/tmp/keep.txt"}"#),
    );
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("invalid username"), "{body}");
    let (status, body) = call(
        "DELETE",
        &format!("{base}/sandboxes/{id}"),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(status, 204, "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// Calls a server stream of envd through the E2B listener (Connect: one envelope of `msg`);
/// the HTTP status and the envelopes of the answer (flags, JSON).
fn stream_call(url: &str, headers: &[(&str, &str)], msg: &Value) -> (u16, Vec<(u8, Value)>) {
    let payload = serde_json::to_vec(msg).unwrap();
    let mut body = vec![0u8];
    body.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    body.extend_from_slice(&payload);
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    let mut req = agent
        .post(url)
        .set("Content-Type", "application/connect+json")
        .set("Connect-Protocol-Version", "1");
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let resp = match req.send_bytes(&body) {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {url}: {e}"),
    };
    let status = resp.status();
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut bytes).unwrap();
    let mut envelopes = Vec::new();
    let mut at = 0;
    while at + 5 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        let json = &bytes[at + 5..at + 5 + len];
        envelopes.push((bytes[at], serde_json::from_slice(json).unwrap()));
        at += 5 + len;
    }
    assert_eq!(at, bytes.len(), "a cut envelope");
    (status, envelopes)
}

/// A start that cannot run (its directory, its program) is refused as envd refuses it,
/// told apart by the kind the agent gives it (not by its text); a command that runs is started.
#[test]
fn e2b_start_failures_are_told_by_their_kind() {
    let (node, e2b, dir) = node();
    let base = format!("http://{e2b}");
    let (id, token) = e2b_sandbox(&base, Some(KEY));
    let envd = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("E2b-Sandbox-Port", "49983"),
        ("X-Access-Token", token.as_str()),
    ];
    let start = |process: Value| {
        let (status, envelopes) = stream_call(
            &format!("{base}/process.Process/Start"),
            &envd,
            &serde_json::json!({ "process": process }),
        );
        assert_eq!(status, 200, "{envelopes:?}");
        envelopes
    };
    let refused = |process: Value| {
        let envelopes = start(process.clone());
        match envelopes.as_slice() {
            [(2, end)] => (
                end["error"]["code"].as_str().unwrap_or("").to_string(),
                end["error"]["message"].as_str().unwrap_or("").to_string(),
            ),
            other => panic!("{process}: not refused: {other:?}"),
        }
    };
    let invalid = |m: &str| ("invalid_argument".to_string(), m.to_string());
    assert_eq!(
        refused(serde_json::json!({"cmd": "ls", "cwd": "/no/such/dir"})),
        invalid("cwd '/no/such/dir' does not exist")
    );
    assert_eq!(
        refused(serde_json::json!({"cmd": "ls", "cwd": "/etc/passwd"})),
        invalid("cwd '/etc/passwd' is not a directory")
    );
    assert_eq!(
        refused(serde_json::json!({"cmd": "no-such-program-here", "args": ["x"]})),
        invalid("error starting process 'no-such-program-here': no-such-program-here: command not found")
    );
    assert_eq!(
        refused(serde_json::json!({"cmd": "/etc/passwd"})),
        invalid(
            "error starting process '/etc/passwd': /etc/passwd: Permission denied (os error 13)"
        )
    );
    // One that runs: started, its output, its end.
    let envelopes = start(serde_json::json!({"cmd": "/bin/sh", "args": ["-c", "echo hi"]}));
    let events: Vec<&Value> = envelopes
        .iter()
        .filter(|(flags, _)| flags & 2 == 0)
        .map(|(_, v)| &v["event"])
        .collect();
    assert!(
        events
            .first()
            .is_some_and(|e| e["start"]["pid"].as_u64().is_some_and(|p| p > 0)),
        "{envelopes:?}"
    );
    assert!(events.iter().any(|e| e["end"].is_object()), "{envelopes:?}");
    assert_eq!(
        envelopes.last().map(|(f, v)| (*f, v.clone())),
        Some((2, serde_json::json!({})))
    );
    let (status, body) = call(
        "DELETE",
        &format!("{base}/sandboxes/{id}"),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(status, 204, "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

// ---- E2B's snapshots, forks, metrics and network updates (helper E3, issue #30) ----

/// A node with the E2B listener, one key and `args`; its E2B address.
fn node_with(args: &[&str]) -> (TestNode, String, PathBuf) {
    let dir = std::env::temp_dir().join(unique("sbx-test-e2b-snap"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, format!("{KEY}\n")).unwrap();
    let e2b = format!("127.0.0.1:{}", free_port());
    let mut all = vec!["--api-keys", keys.to_str().unwrap(), "--e2b-listen", &e2b];
    all.extend_from_slice(args);
    let mut node = TestNode::start_with(&all);
    node.auth = Some(format!("Bearer {KEY}"));
    (node, e2b, dir)
}

/// Snapshots (named, listed by sandbox and name and paged, made into sandboxes that go on
/// with the processes, deleted), forks with their own timeout, metrics over a time range:
/// E2B's SDK on the node's snapshots, forks and cgroups.
#[test]
fn e2b_snapshots_forks_and_metrics_are_the_node_s() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "snap_snapshots.py");
    eprintln!("{out}");
    // What the script made is gone: its sandboxes and snapshots (a fork's own too).
    let bearer = format!("Bearer {KEY}");
    let r = node.get("/v1/snapshots", &[("Authorization", &bearer)]);
    let (status, body) = (r.status, r.json());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(0), "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// `update_network` of a running sandbox and the rules of a create, held by the node's
/// egress rules against the test internet's server (203.0.113.10:8080).
#[test]
fn e2b_network_updates_are_the_node_s_egress_rules() {
    let mut net = crate::network::TestInternet::start();
    net.spawn(&["python3", "-m", "http.server", "8080", "--bind", "0.0.0.0"]);
    crate::network::wait_tcp("203.0.113.10:8080");
    let range = format!("10.251.{}.0/24", std::process::id() % 250);
    let (node, e2b, dir) = node_with(&["--egress-default", "allow", "--net-range", &range]);
    let out = run_script(&e2b, "snap_network.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    drop(node);
    drop(net);
    let _ = std::fs::remove_dir_all(dir);
}

/// E2B's lists through its SDK: paging of running, paused and mixed sandboxes, `order`,
/// `started_after`, the template filter, kill.
#[test]
fn e2b_lists_page_order_and_filter_running_and_paused_sandboxes() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "lifecycle_list.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// A sandbox's life through E2B's SDK: pause is the node's sleep held asleep (not running,
/// `paused`, no timeout while paused), connect resumes it, timeouts end it (`is_running()`
/// false), a killed sandbox's command, `lifecycle` autoPause, a filesystem-only pause (explicit
/// and at the timeout: files kept, processes gone), `on_resume="reboot"`, an auto-resumed
/// sandbox that times out and pauses again, `maskRequestHost` (the Host a port is sent through
/// the preview listener and E2B's sandbox URL), what is refused.
#[test]
fn e2b_pause_connect_timeouts_and_kills_are_the_node_s_sleep_and_ends() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "lifecycle_pause.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// What an envd of 0.6.4 serves of files, through E2B's SDK: metadata as the files' `user.e2b.*`
/// extended attributes (written, read by stat, list and rename, cleared by an overwrite, set
/// out of band), a symlink as envd describes it, watch events with their entry and an
/// overwrite seen as a write, signed download and upload URLs of a secured sandbox (expired,
/// for another path or operation, or wrong: 401).
#[test]
fn e2b_file_metadata_symlinks_watch_entries_and_signed_urls() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "files_meta.py");
    eprintln!("{out}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

/// E2B's npm SDK's own examples of pause and resume (`betaPause`, `pause`, a filesystem-only
/// `pause({keepMemory: false})`, `connect`), snapshots (`createSnapshot`, a sandbox made from
/// one, listed, deleted) and forks: a file and a process survive a pause, a filesystem-only
/// pause keeps the file only, a snapshot's file and process are in the sandbox made from it.
#[test]
fn e2b_s_npm_sdk_pauses_snapshots_and_forks_as_its_examples_do() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "lifecycle.mjs");
    eprintln!("{out}");
    let bearer = format!("Bearer {KEY}");
    let r = node.get("/v1/snapshots", &[("Authorization", &bearer)]);
    let (status, body) = (r.status, r.json());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(0), "{body}");
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

// ---- Templates built through E2B's API (issue #30) ----

/// E2B's `Template` on the node's sandboxes, exec, files and snapshots: a build from the base
/// (copy, run_cmd, env, workdir, a start command and its ready check) under a name, `exists`,
/// a sandbox of it that sees the copied file, the workdir, the env and the started server; a
/// failing step's error with its log; a background build polled to ready; tags. Deleting the
/// templates by name (`DELETE /templates/{name}`) deletes their snapshots.
#[test]
fn e2b_templates_build_on_the_node_s_sandboxes_and_snapshots() {
    let (node, e2b, dir) = node();
    let out = run_script(&e2b, "templates.py");
    eprintln!("{out}");
    let names: Vec<&str> = out
        .lines()
        .find_map(|l| l.strip_prefix("names: "))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(names.len(), 2, "{out}");
    let bearer = format!("Bearer {KEY}");
    let r = node.get("/v1/snapshots", &[("Authorization", &bearer)]);
    assert_eq!(
        r.json()["data"].as_array().map(Vec::len),
        Some(2),
        "one snapshot per built template"
    );
    // Names and tags are the node's store's: a restarted node still makes sandboxes of them.
    let mut node = node;
    node.stop();
    node.restart();
    let alias = format!("http://{e2b}/templates/aliases/{}", names[0]);
    let (status, body) = call("GET", &alias, &[("X-API-KEY", KEY)], None);
    assert_eq!(status, 200, "{body}");
    let create = format!(r#"{{"templateID": "{}:prod", "timeout": 60}}"#, names[1]);
    let (status, body) = call(
        "POST",
        &format!("http://{e2b}/v2/sandboxes"),
        &[("X-API-KEY", KEY), ("Content-Type", "application/json")],
        Some(&create),
    );
    assert_eq!(status, 201, "{body}");
    let made: Value = serde_json::from_str(&body).unwrap();
    let id = made["sandboxID"].as_str().unwrap();
    assert_eq!(made["templateID"], format!("{}:prod", names[1]), "{body}");
    let (status, body) = call(
        "DELETE",
        &format!("http://{e2b}/sandboxes/{id}"),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(status, 204, "{body}");
    for n in &names {
        let url = format!("http://{e2b}/templates/{n}");
        let (status, body) = call("DELETE", &url, &[("X-API-KEY", KEY)], None);
        assert_eq!(status, 204, "{body}");
        let (status, _) = call("DELETE", &url, &[("X-API-KEY", KEY)], None);
        assert_eq!(status, 404, "deleted once");
        let alias = format!("http://{e2b}/templates/aliases/{n}");
        let (status, _) = call("GET", &alias, &[("X-API-KEY", KEY)], None);
        assert_eq!(status, 404, "its name is gone");
    }
    let r = node.get("/v1/snapshots", &[("Authorization", &bearer)]);
    assert_eq!(r.json()["data"].as_array().map(Vec::len), Some(0));
    // An upload URL is the node's only with its token.
    let bad = format!("http://{e2b}/e2b-uploads/{}?token=00", "ab".repeat(32));
    let (status, _) = call_bytes("PUT", &bad, &[], b"x");
    assert_eq!(status, 403);
    node.assert_clean(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir);
}

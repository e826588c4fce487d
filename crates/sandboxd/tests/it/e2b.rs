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
    assert_eq!(sb["envdVersion"], "0.5.7", "{sb}");
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
        Some(r#"{"templateID":"base","mcp":{"x":{}}}"#),
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

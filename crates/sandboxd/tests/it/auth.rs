//! A node started with `--api-keys FILE` serves only callers with one of its keys; `/healthz`
//! needs none.

use std::time::Duration;

use crate::common::{assert_error, unique, TestNode};
use serde_json::json;

#[test]
fn api_keys_are_required_and_checked() {
    let dir = std::env::temp_dir().join(unique("sbx-test-keys"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(
        &keys,
        "# the test's keys\nkey-one-7f3a\n\n  key-two-91bc  \n",
    )
    .unwrap();
    let mut node = TestNode::start_with(&["--api-keys", keys.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    let body = json!({ "command": "echo authorised" });

    let r = node.run_with(&body, &[]);
    assert_error(r.status, &r.json(), 401, "missing_api_key", None);

    for wrong in [
        "Bearer nope",
        "Bearer key-one-7f3",
        "Bearer # the test's keys",
        "key-one",
    ] {
        let r = node.run_with(&body, &[("Authorization", wrong)]);
        assert_error(r.status, &r.json(), 401, "invalid_api_key", None);
    }

    for right in ["Bearer key-one-7f3a", "Bearer key-two-91bc"] {
        let r = node.run_with(&body, &[("Authorization", right)]);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["stdout"], "authorised\n", "{v}");
    }

    // Refused callers get nothing else checked: no 400 before the 401.
    let r = node.post("/v1/run", &[], b"not json");
    assert_error(r.status, &r.json(), 401, "missing_api_key", None);

    let r = node.get("/healthz", &[]);
    assert_eq!(r.status, 200);
    let r = node.get("/healthz", &[("Authorization", "Bearer nope")]);
    assert_eq!(r.status, 200);
    let r = node.get("/internal/node", &[]);
    assert_error(r.status, &r.json(), 401, "missing_api_key", None);
    node.auth = Some("Bearer key-one-7f3a".into());
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn without_keys_loopback_callers_are_served() {
    let node = TestNode::start();
    let r = node.run_with(&json!({ "command": "true" }), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}

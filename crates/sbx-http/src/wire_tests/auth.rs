//! A node with API keys serves only callers with one of its keys; `/healthz` needs none. A
//! node without keys serves loopback callers only. (The keys file as `--api-keys` reads it:
//! `crates/sandboxd/tests/it/edge.rs`.)

use std::net::SocketAddr;

use serde_json::json;

use super::{Flags, Wire};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_required_and_checked() {
    let flags = Flags {
        api_keys: Some(vec!["key-one-7f3a".into(), "key-two-91bc".into()]),
        ..Flags::default()
    };
    let w = Wire::start_with("keys", flags, |_| {});
    let body = json!({ "command": "echo authorised" }).to_string();
    let run = |auth: Option<&'static str>| {
        let mut call = w.call("POST", "/v1/run").json_bytes(body.as_bytes());
        if let Some(a) = auth {
            call = call.header("Authorization", a);
        }
        call.send()
    };

    run(None).await.assert_error(401, "missing_api_key", None);
    for wrong in [
        "Bearer nope",
        "Bearer key-one-7f3",
        "Bearer # the test's keys",
        "key-one",
    ] {
        run(Some(wrong))
            .await
            .assert_error(401, "invalid_api_key", None);
    }
    w.assert_clean(false).await;
    for right in ["Bearer key-one-7f3a", "Bearer key-two-91bc"] {
        let a = run(Some(right)).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let v = a.json();
        assert_eq!(v["stdout"], "authorised\n", "{v}");
    }

    // Refused callers get nothing else checked: no 400 before the 401.
    w.post("/v1/run", b"not json")
        .await
        .assert_error(401, "missing_api_key", None);

    assert_eq!(w.get("/healthz").await.status, 200);
    let a = w
        .call("GET", "/healthz")
        .header("Authorization", "Bearer nope")
        .send()
        .await;
    assert_eq!(a.status, 200);
    w.get("/internal/node")
        .await
        .assert_error(401, "missing_api_key", None);
    // A key is a key from anywhere.
    let a = w
        .call("GET", "/internal/node")
        .header("Authorization", "Bearer key-one-7f3a")
        .from(SocketAddr::from(([192, 0, 2, 7], 40000)))
        .send()
        .await;
    assert_eq!(a.status, 200, "{}", a.text());
    w.assert_clean(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_loopback_callers_are_served() {
    let w = Wire::start("nokeys");
    let a = w.run(&json!({ "command": "true" })).await;
    assert_eq!(a.status, 200, "{}", a.text());
    // Another caller (the node listens on a public address) is not, Host or not.
    for peer in [
        SocketAddr::from(([192, 0, 2, 7], 40000)),
        "[2001:db8::1]:40000".parse().expect("an address"),
    ] {
        w.call("POST", "/v1/run")
            .json_bytes(br#"{"command": "true"}"#)
            .from(peer)
            .send()
            .await
            .assert_error(401, "missing_api_key", None);
    }
    w.assert_clean(true).await;
}

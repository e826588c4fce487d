//! The node's edge against what a browser page (or a rebinding name) can send, and the answers
//! the edge gives instead of a route's: every one the project's error body. (That the flags
//! `--cors-origin`, `--api-keys` and `--docs-url` reach the edge as `main` reads them:
//! `crates/sandboxd/tests/it/edge.rs`.)

use super::{Flags, Wire, HOST};

const RUN: &[u8] = br#"{"command": "echo ran"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_node_serves_loopback_hosts_json_bodies_and_its_own_origin_only() {
    let w = Wire::start("edgekeyless");

    // What a page can send without a preflight: a text/plain or form body, no type at all.
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        let mut call = w.call("POST", "/v1/run").body(RUN);
        if let Some(ct) = ct {
            call = call.header("Content-Type", ct);
        }
        let a = call.send().await;
        a.assert_error(415, "unsupported_media_type", Some("Content-Type"));
        assert_eq!(a.header("connection"), Some("close"), "{ct:?}");
    }
    // Another Host: a name rebound to 127.0.0.1 by a page.
    for host in [
        "evil.example.com",
        "evil.example.com:7700",
        "127.0.0.1.nip.io",
    ] {
        w.call("POST", "/v1/run")
            .header("Host", host)
            .json_bytes(RUN)
            .send()
            .await
            .assert_error(403, "forbidden_host", Some("Host"));
    }
    // The probe's request: all three at once.
    let a = w
        .call("POST", "/v1/run")
        .header("Host", "evil.example.com")
        .header("Origin", "http://evil.com")
        .header("Content-Type", "text/plain")
        .body(RUN)
        .send()
        .await;
    assert_eq!(a.status, 403, "{:?}", a.headers);
    // Another origin, with the right Host and type.
    for origin in ["http://evil.com", "null", "https://127.0.0.1:1"] {
        let a = w
            .call("POST", "/v1/run")
            .header("Origin", origin)
            .json_bytes(RUN)
            .send()
            .await;
        a.assert_error(403, "origin_not_allowed", Some("Origin"));
        assert_eq!(a.header("access-control-allow-origin"), None);
    }
    // A preflight of another origin gets no CORS answer.
    let a = w
        .call("OPTIONS", "/v1/run")
        .header("Origin", "http://evil.com")
        .header("Access-Control-Request-Method", "POST")
        .header("Access-Control-Request-Headers", "content-type")
        .send()
        .await;
    a.assert_error(403, "origin_not_allowed", Some("Origin"));
    assert_eq!(a.header("access-control-allow-origin"), None);
    w.assert_clean(false).await;

    // Served: loopback names and addresses, JSON with parameters, the node's own origin.
    let port = HOST.rsplit(':').next().expect("a port");
    for (host, origin) in [
        (HOST.to_string(), None),
        (format!("localhost:{port}"), None),
        (format!("LocalHost.:{port}"), None),
        (HOST.to_string(), Some(format!("http://{HOST}"))),
    ] {
        let mut call = w
            .call("POST", "/v1/run")
            .header("Host", &host)
            .header("Content-Type", "application/json; charset=utf-8")
            .body(RUN);
        if let Some(o) = origin {
            call = call.header("Origin", &o);
        }
        let a = call.send().await;
        assert_eq!(a.status, 200, "{host}: {}", a.text());
        assert_eq!(a.json()["stdout"], "ran\n");
    }
    // A POST without a body needs no type.
    w.call("POST", "/v1/sandboxes/sbx-aaaaaaaaaaaaaaaa/restart")
        .header("Content-Length", "0")
        .send()
        .await
        .assert_error(404, "sandbox_not_found", None);
    w.assert_clean(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_origin_allows_an_origin_and_answers_its_preflights() {
    let flags = Flags {
        cors_origins: vec!["https://app.example.com".into()],
        ..Flags::default()
    };
    let w = Wire::start_with("edgecors", flags, |_| {});
    let a = w
        .call("OPTIONS", "/v1/run")
        .header("Origin", "https://app.example.com")
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "content-type, idempotency-key",
        )
        .send()
        .await;
    assert_eq!(a.status, 204, "{:?}", a.headers);
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://app.example.com")
    );
    let methods = a.header("access-control-allow-methods").unwrap_or_default();
    assert!(
        methods.contains("POST") && methods.contains("DELETE"),
        "{methods}"
    );
    let headers = a.header("access-control-allow-headers").unwrap_or_default();
    assert!(
        headers.contains("content-type") && headers.contains("idempotency-key"),
        "{headers}"
    );
    assert!(a.header("access-control-max-age").is_some());

    let a = w
        .call("POST", "/v1/run")
        .header("Origin", "https://app.example.com")
        .json_bytes(RUN)
        .send()
        .await;
    assert_eq!(a.status, 200, "{:?}", a.headers);
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://app.example.com")
    );
    assert!(a
        .header("access-control-expose-headers")
        .is_some_and(|h| h.contains("x-request-id")));
    // Still only that one.
    w.call("POST", "/v1/run")
        .header("Origin", "https://app.example.com.evil.com")
        .json_bytes(RUN)
        .send()
        .await
        .assert_error(403, "origin_not_allowed", Some("Origin"));
    // An OPTIONS that is no preflight is what it was.
    w.call("OPTIONS", "/v1/run")
        .send()
        .await
        .assert_error(405, "method_not_allowed", None);
    w.assert_clean(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_api_keys_any_host_is_served_but_not_another_origin() {
    let flags = Flags {
        api_keys: Some(vec!["edge-key-1".into()]),
        ..Flags::default()
    };
    let w = Wire::start_with("edgekeys", flags, |_| {});
    let a = w
        .call("GET", "/internal/node")
        .header("Host", "node.example.com:7700")
        .header("Authorization", "Bearer edge-key-1")
        .send()
        .await;
    assert_eq!(a.status, 200, "{:?}", a.headers);
    w.call("POST", "/v1/run")
        .header("Host", "node.example.com")
        .header("Authorization", "Bearer edge-key-1")
        .header("Origin", "http://evil.com")
        .json_bytes(RUN)
        .send()
        .await
        .assert_error(403, "origin_not_allowed", Some("Origin"));
    w.call("POST", "/v1/run")
        .header("Host", "node.example.com")
        .header("Authorization", "Bearer edge-key-1")
        .header("Content-Type", "text/plain")
        .body(RUN)
        .send()
        .await
        .assert_error(415, "unsupported_media_type", Some("Content-Type"));
    w.assert_clean(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_wrong_answers_of_the_edge() {
    let w = Wire::start("edgesmall");
    let run_q = |accept: &'static str| {
        w.call("POST", "/v1/run")
            .json_bytes(br#"{"command": "echo q"}"#)
            .header("Accept", accept)
            .send()
    };
    // q=0: not acceptable; the answer is JSON.
    let a = run_q("text/event-stream;q=0, application/json").await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(a
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json")));
    assert_eq!(a.json()["stdout"], "q\n");
    let a = run_q("application/json, text/event-stream; q=0.5").await;
    assert_eq!(a.header("content-type"), Some("text/event-stream"));

    // A cursor that no page gave.
    for bad in [
        "garbage",
        "00000000000000000001.sbx-nope",
        "1.sbx-aaaaaaaaaaaaaaaa",
    ] {
        w.get(&format!("/v1/sandboxes?cursor={bad}"))
            .await
            .assert_error(400, "invalid_field", Some("cursor"));
    }
    let a = w
        .get("/v1/sandboxes?cursor=00000000000000000001.sbx-aaaaaaaaaaaaaaaa")
        .await;
    assert_eq!(a.status, 200, "{}", a.text());

    // Percent-escapes that are not UTF-8, in a path and in a query.
    w.get("/v1/sandboxes/%ff")
        .await
        .assert_error(400, "invalid_field", Some("path"));
    w.get("/v1/sandboxes?status=%ff")
        .await
        .assert_error(400, "invalid_field", Some("status"));
    w.get("/v1/sandboxes/sbx-aaaaaaaaaaaaaaaa/files/stat?path=%C3%28")
        .await
        .assert_error(400, "invalid_field", Some("path"));

    // An unknown field named by 10 MB: the error echoes 200 characters of it.
    let name = "n".repeat(10 << 20);
    let body = format!("{{\"command\": \"true\", \"{name}\": 1}}");
    let a = w.post("/v1/run", body.as_bytes()).await;
    assert!(a.body.len() < 8192, "{} bytes of error", a.body.len());
    let v = a.json();
    assert_eq!(a.status, 400, "{v}");
    assert_eq!(v["error"]["code"], "unknown_field");
    let param = v["error"]["param"].as_str().expect("a param");
    assert!(param.starts_with("nnnn") && param.ends_with('…'), "{param}");
    assert_eq!(param.chars().count(), 201);
    w.assert_clean(true).await;
}

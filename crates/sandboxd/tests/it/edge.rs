//! The flags of the node's edge as `main` reads them: `--api-keys FILE` (one key a line,
//! blank lines and `#` comments skipped, each line trimmed), `--cors-origin` (its trailing `/`
//! and case dropped), `--docs-url`. What the edge does with them (Host, Origin, preflights,
//! content types, keys, every refusal's body) is checked in-process on the fake driver:
//! `crates/sbx-http/src/wire_tests/{edge,auth}.rs`.

use std::time::Duration;

use crate::common::{assert_error, unique, TestNode};

#[test]
fn the_edge_flags_reach_it_as_main_reads_them() {
    let dir = std::env::temp_dir().join(unique("sbx-test-edge-flags"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(
        &keys,
        "# the test's keys\nkey-one-7f3a\n\n  key-two-91bc  \n",
    )
    .unwrap();
    let mut node = TestNode::start_with(&[
        "--api-keys",
        keys.to_str().unwrap(),
        "--cors-origin",
        "https://App.Example.com/",
        "--docs-url",
        "https://docs.example/errors#",
    ]);
    let _ = std::fs::remove_dir_all(&dir);

    let r = node.get("/internal/node", &[]);
    let v = r.json();
    assert_error(r.status, &v, 401, "missing_api_key", None);
    assert_eq!(
        v["error"]["docs_url"],
        "https://docs.example/errors#missing_api_key"
    );
    // A comment is no key.
    let r = node.get(
        "/internal/node",
        &[("Authorization", "Bearer # the test's keys")],
    );
    assert_error(r.status, &r.json(), 401, "invalid_api_key", None);
    // Each key, the second one trimmed; a page of the --cors-origin origin is served.
    for right in ["Bearer key-one-7f3a", "Bearer key-two-91bc"] {
        let r = node.get(
            "/internal/node",
            &[
                ("Authorization", right),
                ("Origin", "https://app.example.com"),
            ],
        );
        assert_eq!(r.status, 200, "{right}: {}", r.text());
        assert_eq!(
            r.header("access-control-allow-origin"),
            Some("https://app.example.com")
        );
    }
    let r = node.get("/healthz", &[]);
    assert_eq!(r.status, 200);
    node.auth = Some("Bearer key-one-7f3a".into());
    node.assert_clean(Duration::from_secs(10));
}

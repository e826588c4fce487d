//! A sandbox's calls at one API (a control plane's `/v1`, or a node's), shared by the fleet's
//! tests: a shell line waited for, a counter process and its count, a status waited for. Each
//! failure says what the fleet's logs hold.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::http::Http;

/// A process that counts into /tmp/c (written whole: a new file moved over it) and prints each
/// count, ten times a second.
pub const COUNTER: &str =
    "i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; echo $i; sleep 0.1; done";

/// The API at `base` (`http://HOST:PORT`), and the logs to show when a call fails.
pub struct At<'a> {
    pub http: &'a Http,
    pub base: String,
    pub logs: Box<dyn Fn() -> String + 'a>,
}

impl At<'_> {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A shell line in sandbox `id`, waited for (it must succeed): its command object.
    pub fn sh_obj(&self, id: &str, line: &str) -> Value {
        let r = self.http.post_json(
            &self.url(&format!("/v1/sandboxes/{id}/exec")),
            &json!({ "command": line, "wait_seconds": 60 }),
        );
        assert!(
            r.status == 200 || r.status == 201,
            "{line}: {} {}\n{}",
            r.status,
            r.text(),
            (self.logs)()
        );
        let v = r.json();
        assert_eq!(v["exit_code"], 0, "{line}: {v}");
        v
    }

    /// Its stdout.
    pub fn sh(&self, id: &str, line: &str) -> String {
        self.sh_obj(id, line)["stdout"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// The counter's value.
    pub fn count(&self, id: &str) -> u64 {
        let out = self.sh(id, "cat /tmp/c");
        out.trim()
            .parse()
            .unwrap_or_else(|e| panic!("not a count ({e}): {out:?}"))
    }

    /// The counter started as a command of its own: its id, once it has counted.
    pub fn start_counter(&self, id: &str) -> String {
        let exec_url = self.url(&format!("/v1/sandboxes/{id}/exec"));
        let r = self
            .http
            .post_json(&exec_url, &json!({ "command": ["sh", "-c", COUNTER] }));
        assert_eq!(
            r.status,
            201,
            "the counter: {}\n{}",
            r.text(),
            (self.logs)()
        );
        let exec = r.json()["id"].as_str().unwrap_or_default().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self
            .http
            .post_json(
                &exec_url,
                &json!({ "command": "test -s /tmp/c", "wait_seconds": 10 }),
            )
            .json()["exit_code"]
            != 0
        {
            assert!(
                Instant::now() < deadline,
                "the counter does not count\n{}",
                (self.logs)()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        exec
    }

    /// Waits until sandbox `id` has `status`: its object.
    pub fn wait_status(&self, id: &str, status: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.http.get(&self.url(&format!("/v1/sandboxes/{id}")));
            if r.status == 200 && r.json()["status"] == status {
                return r.json();
            }
            assert!(
                Instant::now() < deadline,
                "{id} is not {status} after {timeout:?}: {} {}\n{}",
                r.status,
                r.text(),
                (self.logs)()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

//! Requests of the fleet tests (raw HTTP: the tests check the wire the control plane answers
//! with), and the check of an error answer.

use std::time::Duration;

use serde_json::Value;

/// An answer read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.status, self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub struct Http {
    agent: ureq::Agent,
}

impl Http {
    pub fn new() -> Http {
        Http {
            agent: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(5))
                .timeout_read(Duration::from_secs(120))
                .timeout_write(Duration::from_secs(120))
                .build(),
        }
    }

    /// A request that may fail: its answer (also a 4xx or 5xx one), or a transport error.
    pub fn send(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<(&str, &[u8])>,
    ) -> Result<ureq::Response, String> {
        let mut req = self.agent.request(method, url);
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let sent = match body {
            Some((ctype, b)) => req.set("Content-Type", ctype).send_bytes(b),
            None => req.call(),
        };
        match sent {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(_, r)) => Ok(r),
            Err(e) => Err(format!("{method} {url}: {e}")),
        }
    }

    pub fn call(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<(&str, &[u8])>,
    ) -> Reply {
        let r = self
            .send(method, url, headers, body)
            .unwrap_or_else(|e| panic!("{e}"));
        let status = r.status();
        let headers = r
            .headers_names()
            .into_iter()
            .filter_map(|n| r.header(&n).map(|v| (n.clone(), v.to_string())))
            .collect();
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut r.into_reader(), &mut body)
            .unwrap_or_else(|e| panic!("{method} {url}: reading the answer: {e}"));
        Reply {
            status,
            headers,
            body,
        }
    }

    pub fn get(&self, url: &str) -> Reply {
        self.call("GET", url, &[], None)
    }

    pub fn delete(&self, url: &str) -> Reply {
        self.call("DELETE", url, &[], None)
    }

    pub fn post_json(&self, url: &str, v: &Value) -> Reply {
        let body = v.to_string();
        self.call(
            "POST",
            url,
            &[],
            Some(("application/json", body.as_bytes())),
        )
    }
}

/// The type of the error codes these tests meet.
fn type_of(status: u16) -> &'static str {
    match status {
        400 => "invalid_request",
        401 => "unauthenticated",
        403 => "forbidden",
        404 => "not_found",
        409 => "conflict",
        503 => "unavailable",
        _ => "?",
    }
}

/// An error answer exactly as the spec has it: the status, `{"error": {...}}` with its seven
/// keys and nothing else in it, the code, the param, the type of the status, the request id of
/// the answer's header. Its `error` object.
pub fn assert_error(r: &Reply, status: u16, code: &str, param: Option<&str>) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let e = v["error"].clone();
    let mut keys: Vec<&str> = e
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {v}"))
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "code",
            "docs_url",
            "message",
            "param",
            "request_id",
            "retryable",
            "type"
        ],
        "{v}"
    );
    assert_eq!(e["code"], code, "{v}");
    assert_eq!(e["type"], type_of(status), "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(
        e["request_id"].as_str(),
        r.header("x-request-id"),
        "the body's request id is the answer's: {v}"
    );
    e
}

//! Who may call the control plane: the node's rule, checked here on its own (the control plane
//! is a client of nodes and does not link their front ends). With API keys (`--api-keys FILE`,
//! one a line, the same file as the nodes'), a request carries `Authorization: Bearer KEY`;
//! without them, only loopback callers that name a loopback `Host` are served. A sandbox's token
//! (`sbt_…`) is passed on to the sandbox's node, which alone knows it, for the routes of a
//! sandbox only. A browser's `Origin` other than the control plane's own is refused.

use std::collections::HashSet;
use std::net::SocketAddr;

use axum::http::{header, HeaderMap};
use sbx_api::{ApiError, ErrorCode};

/// The prefix of a sandbox's token.
pub const TOKEN_PREFIX: &str = "sbt_";

/// Reads a key file: one key a line; blank lines and `#` comments skipped. `None` when it holds
/// no key.
pub fn parse_keys(text: &str) -> Option<HashSet<String>> {
    let keys: HashSet<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    (!keys.is_empty()).then_some(keys)
}

/// Whether `given` is one of `keys`, compared in constant time (every key is compared).
pub fn is_key(keys: &HashSet<String>, given: &str) -> bool {
    keys.iter().fold(false, |found, k| {
        found | ct_eq(k.as_bytes(), given.as_bytes())
    })
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `host` (a `Host` value, maybe with a port) is loopback: `localhost`, a name under
/// `.localhost`, 127.0.0.0/8 or ::1.
pub fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.starts_with(':') => v6,
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => host,
        }
    };
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// The credential of `Authorization` (`Bearer X` or `X`), trimmed.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim()
        })
}

/// Whether `path` is one of a sandbox's routes (`/v1/sandboxes/{id}` and below), which a
/// sandbox token may be sent to (its node decides what it may do).
fn sandbox_route(path: &str) -> bool {
    path.strip_prefix("/v1/sandboxes/")
        .is_some_and(|rest| !rest.is_empty())
}

/// The one decision of who may make a request (every route but `/healthz`).
pub fn check(
    keys: Option<&HashSet<String>>,
    peer: SocketAddr,
    path: &str,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    if keys.is_none() && !host.is_some_and(is_loopback_host) {
        return Err(ApiError::new(
            ErrorCode::ForbiddenHost,
            format!(
                "this control plane has no API keys and serves requests to a loopback name or \
                 address only, not to Host {:?}",
                host.unwrap_or("")
            ),
        )
        .with_param("Host"));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin
            .to_str()
            .unwrap_or("")
            .trim()
            .trim_end_matches('/')
            .to_ascii_lowercase();
        let own = host.map(|h| format!("http://{}", h.to_ascii_lowercase()));
        if own.as_deref() != Some(origin.as_str()) {
            return Err(ApiError::new(
                ErrorCode::OriginNotAllowed,
                format!("requests from pages of {origin:?} are refused by the control plane"),
            )
            .with_param("Origin"));
        }
    }
    let given = bearer(headers);
    if let (Some(keys), Some(g)) = (keys, given) {
        if is_key(keys, g) {
            return Ok(());
        }
    }
    if given.is_some_and(|g| g.starts_with(TOKEN_PREFIX)) {
        return if sandbox_route(path) {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::NeedsApiKey,
                "a sandbox token acts on its own sandbox only: this call needs an API key",
            ))
        };
    }
    match (keys, given) {
        (None, _) if peer.ip().is_loopback() => Ok(()),
        (None, _) => Err(ApiError::new(
            ErrorCode::MissingApiKey,
            "this control plane has no API keys and serves loopback callers only",
        )),
        (Some(_), None) => Err(ApiError::new(
            ErrorCode::MissingApiKey,
            "send Authorization: Bearer KEY",
        )),
        (Some(_), Some(_)) => Err(ApiError::new(
            ErrorCode::InvalidApiKey,
            "that API key is not valid",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header value"));
        }
        h
    }

    fn peer(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().expect("ip"), 40000)
    }

    fn code(r: Result<(), ApiError>) -> Option<ErrorCode> {
        r.err().map(|e| e.code)
    }

    #[test]
    fn without_keys_only_loopback_callers_and_hosts() {
        let h = headers(&[("host", "127.0.0.1:7701")]);
        assert_eq!(
            code(check(None, peer("127.0.0.1"), "/v1/sandboxes", &h)),
            None
        );
        assert_eq!(
            code(check(None, peer("10.0.0.2"), "/v1/sandboxes", &h)),
            Some(ErrorCode::MissingApiKey)
        );
        let far = headers(&[("host", "ctl.example.com")]);
        assert_eq!(
            code(check(None, peer("127.0.0.1"), "/v1/sandboxes", &far)),
            Some(ErrorCode::ForbiddenHost)
        );
        let page = headers(&[("host", "localhost:7701"), ("origin", "http://evil.test")]);
        assert_eq!(
            code(check(None, peer("127.0.0.1"), "/v1/sandboxes", &page)),
            Some(ErrorCode::OriginNotAllowed)
        );
        let own = headers(&[
            ("host", "localhost:7701"),
            ("origin", "http://localhost:7701/"),
        ]);
        assert_eq!(code(check(None, peer("127.0.0.1"), "/v1/run", &own)), None);
    }

    #[test]
    fn with_keys_a_key_is_needed_from_anywhere() {
        let keys = parse_keys("# fleet\nk-one\n\n  k-two  \n").expect("keys");
        assert_eq!(keys.len(), 2);
        let h = headers(&[
            ("host", "ctl.example.com"),
            ("authorization", "Bearer k-two"),
        ]);
        assert_eq!(
            code(check(Some(&keys), peer("10.1.1.1"), "/v1/run", &h)),
            None
        );
        let bad = headers(&[
            ("host", "ctl.example.com"),
            ("authorization", "Bearer k-three"),
        ]);
        assert_eq!(
            code(check(Some(&keys), peer("127.0.0.1"), "/v1/run", &bad)),
            Some(ErrorCode::InvalidApiKey)
        );
        let none = headers(&[("host", "ctl.example.com")]);
        assert_eq!(
            code(check(Some(&keys), peer("127.0.0.1"), "/v1/run", &none)),
            Some(ErrorCode::MissingApiKey)
        );
        // A sandbox's token goes on to its node, for its sandbox's routes only.
        let tok = headers(&[
            ("host", "ctl.example.com"),
            ("authorization", "Bearer sbt_x"),
        ]);
        assert_eq!(
            code(check(
                Some(&keys),
                peer("10.1.1.1"),
                "/v1/sandboxes/sbx-1/exec",
                &tok
            )),
            None
        );
        assert_eq!(
            code(check(
                Some(&keys),
                peer("10.1.1.1"),
                "/internal/nodes",
                &tok
            )),
            Some(ErrorCode::NeedsApiKey)
        );
        assert!(parse_keys("# nothing\n\n").is_none());
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "localhost:1",
            "a.localhost",
            "127.0.0.9:80",
            "[::1]:7701",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in ["example.com", "10.0.0.1:80", "[::2]", "localhost.evil.com"] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }
}

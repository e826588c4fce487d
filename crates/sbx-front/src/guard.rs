//! What the node's listeners (the API, E2B's, the preview's) decide alike about a request:
//! where it comes from (its `Host` and `Origin`), whether any web page could have sent it
//! without a CORS preflight, and which of its headers are the node's credentials, taken out
//! before the request reaches a sandbox.

use std::collections::HashSet;

use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::http::request::Parts;
use hyper::{Method, Uri};

use sbx_node::node::sandbox::TOKEN_PREFIX;

/// The header of the preview's sandbox token.
pub const SBX_TOKEN_HEADER: &str = "x-sbx-token";

/// The query parameter of the preview's sandbox token, and its cookie.
pub const SBX_TOKEN_PARAM: &str = "sbx_token";

/// Whether `host` (a `Host` value: a name or address, maybe with a port) is loopback:
/// `localhost`, a name under `.localhost`, 127.0.0.0/8 or ::1.
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

/// Why a request's origin is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A node without keys serves loopback names only; the `Host` given.
    Host(String),
    /// A page of another origin (lowercase, without a trailing `/`).
    Origin(String),
}

/// Where a request comes from. With `loopback_only` (a node without API keys) only a loopback
/// `Host` (a page that rebinds its own name to 127.0.0.1 still sends that name); an `Origin`
/// (a browser's request) only the listener's own (`{scheme}://{host}`) or one of `cors`
/// (`--cors-origin`, lowercase). The origin returned is one `cors` allows.
pub fn check_origin(
    loopback_only: bool,
    host: Option<&str>,
    origin: Option<&HeaderValue>,
    scheme: &str,
    cors: &[String],
) -> Result<Option<String>, Refusal> {
    if loopback_only && !host.is_some_and(is_loopback_host) {
        return Err(Refusal::Host(host.unwrap_or("").to_string()));
    }
    let Some(origin) = origin else {
        return Ok(None);
    };
    let origin = origin
        .to_str()
        .unwrap_or("")
        .trim()
        .trim_end_matches('/')
        .to_ascii_lowercase();
    if cors.contains(&origin) {
        return Ok(Some(origin));
    }
    let own = host.map(|h| format!("{scheme}://{}", h.trim().to_ascii_lowercase()));
    if own.as_deref() == Some(origin.as_str()) {
        return Ok(None);
    }
    Err(Refusal::Origin(origin))
}

/// Headers no page can set on a request to another origin without a CORS preflight (which
/// the sandbox side never answers): a request with one was not sent by a page behind the
/// user's back. E2B's SDKs send `X-Access-Token` (and Connect's `Connect-Protocol-Version`).
const PREFLIGHTED: [&str; 6] = [
    "authorization",
    "x-access-token",
    "e2b-traffic-access-token",
    "x-api-key",
    SBX_TOKEN_HEADER,
    "connect-protocol-version",
];

/// Whether a web page could have sent this request to another origin without a CORS
/// preflight: GET, HEAD or POST; no Content-Type, or text/plain, multipart/form-data or
/// application/x-www-form-urlencoded (an empty or unparsable one counted with them); none of
/// the headers a page cannot set so ([`PREFLIGHTED`]). Such a request proves nothing about
/// who sent it: on a node without keys, a loopback peer may be the user's browser.
pub fn browser_simple(method: &Method, headers: &HeaderMap) -> bool {
    if !(method == Method::GET || method == Method::HEAD || method == Method::POST) {
        return false;
    }
    if PREFLIGHTED.iter().any(|h| headers.contains_key(*h)) {
        return false;
    }
    headers.get_all(header::CONTENT_TYPE).iter().all(|v| {
        let essence = v
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        matches!(
            essence.as_str(),
            "" | "text/plain" | "multipart/form-data" | "application/x-www-form-urlencoded"
        )
    })
}

/// The node's credentials a request carried, taken out of it.
#[derive(Debug, Default)]
pub struct Credentials {
    /// `X-API-KEY`, or `Authorization` (`Bearer KEY` or `KEY`), held one of the node's keys.
    pub api_key: bool,
    /// Sandbox tokens (`sbt_…`) by the header that held them (lowercase names):
    /// `authorization`, `x-access-token`, `e2b-traffic-access-token`, `x-api-key`,
    /// `x-sbx-token` (this one whatever it held).
    pub tokens: Vec<(&'static str, String)>,
    /// The `sbx_token` query parameter.
    pub query: Option<String>,
    /// `sbx_token` cookies.
    pub cookies: Vec<String>,
}

impl Credentials {
    /// The tokens a header of `names` held.
    pub fn token_in<'a>(&'a self, names: &'a [&str]) -> impl Iterator<Item = &'a str> + 'a {
        self.tokens
            .iter()
            .filter(move |(n, _)| names.contains(n))
            .map(|(_, t)| t.as_str())
    }
}

/// Headers that carry a key or a token of the node when they hold one.
const CREDENTIAL_HEADERS: [&str; 4] = [
    "authorization",
    "x-api-key",
    "x-access-token",
    "e2b-traffic-access-token",
];

/// Takes every credential of the node out of a request bound for a sandbox (its service, or
/// envd's port), on every listener: `X-API-KEY` always (the header of E2B's API keys: what a
/// client sends in it is meant for the node, or for E2B); `Authorization`, `X-Access-Token`
/// and `E2B-Traffic-Access-Token` when they hold one of the node's keys or a sandbox token (any
/// `sbt_…`; any other value is the service's own, and stays: `Authorization: Basic` names
/// envd's user); the preview's `X-Sbx-Token`, `sbx_token` cookie and query parameter always.
pub fn take_credentials(parts: &mut Parts, api_keys: Option<&HashSet<String>>) -> Credentials {
    let mut c = Credentials::default();
    let is_key = |v: &str| api_keys.is_some_and(|keys| is_api_key(keys, v));
    for name in CREDENTIAL_HEADERS {
        let mut node_s = false;
        for v in parts.headers.get_all(name) {
            let Ok(v) = v.to_str() else { continue };
            let v = v.trim();
            let v = v
                .strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .map(str::trim)
                .unwrap_or(v);
            if is_key(v) {
                c.api_key = true;
                node_s = true;
            } else if v.starts_with(TOKEN_PREFIX) {
                c.tokens.push((name, v.to_string()));
                node_s = true;
            }
        }
        if node_s || name == "x-api-key" {
            parts.headers.remove(name);
        }
    }
    for v in parts.headers.get_all(SBX_TOKEN_HEADER) {
        if let Ok(v) = v.to_str() {
            c.tokens.push((SBX_TOKEN_HEADER, v.trim().to_string()));
        }
    }
    parts.headers.remove(SBX_TOKEN_HEADER);
    take_cookies(&mut parts.headers, &mut c);
    take_query(&mut parts.uri, &mut c);
    c
}

/// The `sbx_token` cookies out of every `Cookie` header (HTTP/2 sends one a pair), the rest
/// kept in one header.
fn take_cookies(headers: &mut HeaderMap, c: &mut Credentials) {
    let mut kept: Vec<String> = Vec::new();
    for v in headers.get_all(header::COOKIE) {
        let Ok(v) = v.to_str() else { continue };
        for pair in v.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((name, value)) if name.trim() == SBX_TOKEN_PARAM => {
                    c.cookies.push(value.trim().trim_matches('"').to_string())
                }
                _ => kept.push(pair.to_string()),
            }
        }
    }
    if headers.contains_key(header::COOKIE) {
        headers.remove(header::COOKIE);
        if let Ok(v) = HeaderValue::from_str(&kept.join("; ")) {
            if !kept.is_empty() {
                headers.insert(header::COOKIE, v);
            }
        }
    }
}

/// The `sbx_token` query parameter out of the URI (percent-escaped or not).
fn take_query(uri: &mut Uri, c: &mut Credentials) {
    let Some(q) = uri.query() else { return };
    let mut rest: Vec<&str> = Vec::new();
    let mut found = false;
    for pair in q.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_encoding::percent_decode_str(name).decode_utf8_lossy();
        if name == SBX_TOKEN_PARAM {
            let v = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            c.query = Some(v.into_owned());
            found = true;
        } else {
            rest.push(pair);
        }
    }
    if !found {
        return;
    }
    let path = uri.path();
    let pq = if rest.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", rest.join("&"))
    };
    let mut b = hyper::http::uri::Builder::new();
    if let Some(s) = uri.scheme() {
        b = b.scheme(s.clone());
    }
    if let Some(a) = uri.authority() {
        b = b.authority(a.clone());
    }
    *uri = b
        .path_and_query(pq)
        .build()
        .unwrap_or_else(|_| Uri::from_static("/"));
}

/// `path_and_query` as a redirect's `Location` that stays on the same host: a leading run of
/// `/` and `\` (which a browser reads as `//host`, another host) becomes one `/`.
pub fn same_host_location(path_and_query: &str) -> String {
    let rest = path_and_query.trim_start_matches(['/', '\\']);
    format!("/{rest}")
}

/// Whether `given` is one of `keys`: each compared in constant time, all of them every time.
pub fn is_api_key(keys: &HashSet<String>, given: &str) -> bool {
    use subtle::ConstantTimeEq;
    keys.iter().fold(false, |found, k| {
        found | bool::from(k.as_bytes().ct_eq(given.as_bytes()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = hyper::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).expect("request").into_parts().0
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "localhost:7700",
            "LOCALHOST.",
            "a.localhost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:7700",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.com",
            "localhost.evil.com",
            "127.0.0.1.nip.io",
            "10.0.0.1:7700",
            "[::2]:1",
            "[::1]x",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn origins_and_hosts() {
        let o = |s: &'static str| HeaderValue::from_static(s);
        let cors = vec!["https://app.example".to_string()];
        let c = |lo, host, origin: Option<HeaderValue>, scheme| {
            check_origin(lo, host, origin.as_ref(), scheme, &cors)
        };
        assert_eq!(c(true, Some("127.0.0.1:1"), None, "http"), Ok(None));
        assert_eq!(
            c(true, Some("evil.example:1"), None, "http"),
            Err(Refusal::Host("evil.example:1".into()))
        );
        assert_eq!(c(false, Some("evil.example:1"), None, "http"), Ok(None));
        assert_eq!(
            c(
                true,
                Some("localhost:1"),
                Some(o("http://localhost:1/")),
                "http"
            ),
            Ok(None)
        );
        assert_eq!(
            c(
                false,
                Some("a.localhost"),
                Some(o("https://a.localhost")),
                "http"
            ),
            Err(Refusal::Origin("https://a.localhost".into()))
        );
        assert_eq!(
            c(
                false,
                Some("a.localhost"),
                Some(o("https://a.localhost")),
                "https"
            ),
            Ok(None)
        );
        assert_eq!(
            c(
                true,
                Some("localhost"),
                Some(o("HTTPS://app.example")),
                "http"
            ),
            Ok(Some("https://app.example".into()))
        );
        assert_eq!(
            c(true, Some("localhost"), Some(o("null")), "http"),
            Err(Refusal::Origin("null".into()))
        );
    }

    #[test]
    fn what_a_page_can_send_without_a_preflight() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.append(*k, HeaderValue::from_static(v));
            }
            m
        };
        assert!(browser_simple(&Method::POST, &h(&[])));
        assert!(browser_simple(&Method::POST, &h(&[("content-type", "")])));
        assert!(browser_simple(
            &Method::POST,
            &h(&[("content-type", "multipart/form-data; boundary=x")])
        ));
        assert!(browser_simple(
            &Method::POST,
            &h(&[
                ("content-type", "Text/Plain;charset=utf-8"),
                ("cookie", "a=1")
            ])
        ));
        assert!(!browser_simple(&Method::PUT, &h(&[])));
        assert!(!browser_simple(
            &Method::POST,
            &h(&[("content-type", "application/json")])
        ));
        assert!(!browser_simple(
            &Method::POST,
            &h(&[("content-type", "text/plain"), ("x-access-token", "sbt_1")])
        ));
        assert!(!browser_simple(
            &Method::POST,
            &h(&[("connect-protocol-version", "1")])
        ));
    }

    #[test]
    fn credentials_are_taken_out_and_the_rest_kept() {
        let keys: HashSet<String> = ["key-1".to_string()].into();
        let mut p = parts(
            "/a/b?x=1&sbx_token=sbt_abc&y=2",
            &[
                ("x-sbx-token", "sbt_h"),
                ("cookie", "a=1; sbx_token=sbt_c; b=2"),
                ("cookie", "c=3"),
                ("authorization", "Bearer key-1"),
                ("x-api-key", "key-1"),
                ("x-access-token", "sbt_x"),
                ("e2b-traffic-access-token", "sbt_t"),
                ("x-mine", "kept"),
            ],
        );
        let c = take_credentials(&mut p, Some(&keys));
        assert!(c.api_key);
        assert_eq!(
            c.tokens,
            vec![
                ("x-access-token", "sbt_x".to_string()),
                ("e2b-traffic-access-token", "sbt_t".to_string()),
                ("x-sbx-token", "sbt_h".to_string()),
            ]
        );
        assert_eq!(c.query.as_deref(), Some("sbt_abc"));
        assert_eq!(c.cookies, vec!["sbt_c".to_string()]);
        assert_eq!(p.uri.to_string(), "/a/b?x=1&y=2");
        for h in [
            "x-sbx-token",
            "authorization",
            "x-api-key",
            "x-access-token",
            "e2b-traffic-access-token",
        ] {
            assert!(p.headers.get(h).is_none(), "{h}");
        }
        let cookies: Vec<_> = p.headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, vec!["a=1; b=2; c=3"]);
        assert_eq!(p.headers.len(), 2);

        // What is not the node's stays: the service's own Authorization, envd's Basic user; a
        // sandbox token in Authorization goes, and X-API-KEY whatever it holds. A keyless node
        // has no keys.
        for (auth, kept) in [
            ("Bearer theirs", true),
            ("Basic dXNlcjo=", true),
            ("Bearer sbt_0123", false),
            ("key-1", false),
        ] {
            let mut p = parts(
                "/p?sbx_token=t",
                &[
                    ("authorization", auth),
                    ("x-api-key", "theirs"),
                    ("cookie", "sbx_token=x"),
                ],
            );
            let c = take_credentials(&mut p, Some(&keys));
            assert_eq!(p.headers.contains_key("authorization"), kept, "{auth}");
            assert!(!p.headers.contains_key("x-api-key"));
            assert!(p.headers.get("cookie").is_none());
            assert_eq!(p.uri.to_string(), "/p");
            assert_eq!(c.api_key, auth == "key-1");
        }
        let mut p = parts("/", &[("x-api-key", "key-1")]);
        let c = take_credentials(&mut p, None);
        assert!(!c.api_key && !p.headers.contains_key("x-api-key"));
    }

    #[test]
    fn redirects_stay_on_the_host() {
        assert_eq!(same_host_location("/a?b=1"), "/a?b=1");
        assert_eq!(same_host_location("//evil.example/"), "/evil.example/");
        assert_eq!(same_host_location("/\\evil.example"), "/evil.example");
        assert_eq!(same_host_location("\\\\evil"), "/evil");
        assert_eq!(same_host_location(""), "/");
    }
}

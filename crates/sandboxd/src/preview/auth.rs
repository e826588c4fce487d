//! Who may open a sandbox's port through the preview listener. A public port (`public_ports`,
//! or any port but `public_ports_except`) anybody; another one a request with the sandbox's
//! token (header `X-Sbx-Token`, query `?sbx_token=`, which is answered with a 307 to the URL
//! without it and a cookie for that host, or that cookie) or `Authorization: Bearer KEY` with
//! one of the node's API keys. Each of these is taken out of the request, whatever the port:
//! the sandbox's service never sees a credential of the node.

use std::collections::HashSet;

use hyper::header::{self, HeaderValue};
use hyper::http::request::Parts;
use hyper::Uri;

use crate::node::sandbox::PreviewTarget;

/// The header that carries a sandbox's token.
pub(super) const TOKEN_HEADER: &str = "x-sbx-token";

/// The query parameter that carries it once, and the cookie that carries it after.
pub(super) const TOKEN_PARAM: &str = "sbx_token";

/// What becomes of a request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// On to the sandbox (its credentials taken out).
    Pass,
    /// A right `?sbx_token=`: 307 to `location` with `Set-Cookie: cookie`.
    Redirect { location: String, cookie: String },
    /// 401 invalid_token.
    Refuse,
}

/// Decides about a request to the port of `target`, and takes its credentials out of `parts`.
pub(super) fn decide(
    parts: &mut Parts,
    target: &PreviewTarget,
    api_keys: Option<&HashSet<String>>,
    https: bool,
) -> Decision {
    let creds = take_credentials(parts, api_keys);
    if target.public {
        return Decision::Pass;
    }
    if let Some(t) = &creds.query {
        if !target.token_matches(t) {
            return Decision::Refuse;
        }
        let location = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        let secure = if https { "; Secure" } else { "" };
        let cookie = format!("{TOKEN_PARAM}={t}; Path=/; HttpOnly; SameSite=Lax{secure}");
        return Decision::Redirect { location, cookie };
    }
    let token_ok = |t: &Option<String>| t.as_deref().is_some_and(|t| target.token_matches(t));
    if creds.api_key
        || token_ok(&creds.header)
        || creds.cookies.iter().any(|c| target.token_matches(c))
    {
        return Decision::Pass;
    }
    Decision::Refuse
}

/// The credentials a request carried.
#[derive(Debug, Default)]
struct Credentials {
    header: Option<String>,
    query: Option<String>,
    cookies: Vec<String>,
    /// `Authorization: Bearer KEY` with one of the node's keys.
    api_key: bool,
}

/// Takes every credential of the node out of the request: `X-Sbx-Token`, the `sbx_token`
/// query parameter and cookie, an `Authorization` that holds one of the node's API keys (any
/// other `Authorization` is the service's own, and stays).
fn take_credentials(parts: &mut Parts, api_keys: Option<&HashSet<String>>) -> Credentials {
    let mut c = Credentials {
        header: parts
            .headers
            .get(TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_string()),
        ..Credentials::default()
    };
    parts.headers.remove(TOKEN_HEADER);
    if let Some(keys) = api_keys {
        let key = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if key.is_some_and(|k| crate::http::is_api_key(keys, k)) {
            c.api_key = true;
            parts.headers.remove(header::AUTHORIZATION);
        }
    }
    // Cookies: every `Cookie` header (HTTP/2 sends one a pair), ours taken out, the rest kept
    // in one header.
    let mut kept: Vec<String> = Vec::new();
    for v in parts.headers.get_all(header::COOKIE) {
        let Ok(v) = v.to_str() else { continue };
        for pair in v.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((name, value)) if name.trim() == TOKEN_PARAM => {
                    c.cookies.push(value.trim().trim_matches('"').to_string())
                }
                _ => kept.push(pair.to_string()),
            }
        }
    }
    if parts.headers.contains_key(header::COOKIE) {
        parts.headers.remove(header::COOKIE);
        if let Ok(v) = HeaderValue::from_str(&kept.join("; ")) {
            if !kept.is_empty() {
                parts.headers.insert(header::COOKIE, v);
            }
        }
    }
    // The query parameter.
    if let Some(q) = parts.uri.query() {
        let mut rest: Vec<&str> = Vec::new();
        for pair in q.split('&') {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if name == TOKEN_PARAM {
                let v = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
                c.query = Some(v.into_owned());
            } else {
                rest.push(pair);
            }
        }
        if c.query.is_some() {
            let path = parts.uri.path();
            let pq = if rest.is_empty() {
                path.to_string()
            } else {
                format!("{path}?{}", rest.join("&"))
            };
            let mut uri = hyper::http::uri::Builder::new();
            if let Some(s) = parts.uri.scheme() {
                uri = uri.scheme(s.clone());
            }
            if let Some(a) = parts.uri.authority() {
                uri = uri.authority(a.clone());
            }
            parts.uri = uri
                .path_and_query(pq)
                .build()
                .unwrap_or_else(|_| Uri::from_static("/"));
        }
    }
    c
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
    fn credentials_are_taken_out_and_the_rest_kept() {
        let keys: HashSet<String> = ["key-1".to_string()].into();
        let mut p = parts(
            "/a/b?x=1&sbx_token=sbt_abc&y=2",
            &[
                ("x-sbx-token", "sbt_h"),
                ("cookie", "a=1; sbx_token=sbt_c; b=2"),
                ("cookie", "c=3"),
                ("authorization", "Bearer key-1"),
            ],
        );
        let c = take_credentials(&mut p, Some(&keys));
        assert_eq!(c.header.as_deref(), Some("sbt_h"));
        assert_eq!(c.query.as_deref(), Some("sbt_abc"));
        assert_eq!(c.cookies, vec!["sbt_c".to_string()]);
        assert!(c.api_key);
        assert_eq!(p.uri.to_string(), "/a/b?x=1&y=2");
        assert!(p.headers.get("x-sbx-token").is_none());
        assert!(p.headers.get("authorization").is_none());
        let cookies: Vec<_> = p.headers.get_all("cookie").iter().collect();
        assert_eq!(cookies, vec!["a=1; b=2; c=3"]);

        // The service's own Authorization stays; a query of the token alone leaves the path.
        let mut p = parts(
            "/p?sbx_token=t",
            &[
                ("authorization", "Bearer theirs"),
                ("cookie", "sbx_token=x"),
            ],
        );
        let c = take_credentials(&mut p, Some(&keys));
        assert!(!c.api_key);
        assert_eq!(
            p.headers.get("authorization").map(|v| v.as_bytes()),
            Some(&b"Bearer theirs"[..])
        );
        assert!(p.headers.get("cookie").is_none());
        assert_eq!(p.uri.to_string(), "/p");
    }
}

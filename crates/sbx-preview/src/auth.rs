//! Who may open a sandbox's port through the preview listener. A public port (`public_ports`,
//! or any port but `public_ports_except`) anybody; another one a request with the sandbox's
//! token (header `X-Sbx-Token`, query `?sbx_token=`, which is answered with a 307 to the URL
//! without it and a cookie for that host, or that cookie) or one of the node's API keys
//! (`Authorization: Bearer KEY`, or `X-API-KEY`). Every credential of the node is taken out of the request
//! (`crate::guard::take_credentials`, as E2B's listener does), whatever the port: the
//! sandbox's service never sees one.

use std::collections::HashSet;

use hyper::http::request::Parts;

use crate::guard::{SBX_TOKEN_HEADER, SBX_TOKEN_PARAM};
use crate::node::sandbox::PreviewTarget;

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
    let creds = crate::guard::take_credentials(parts, api_keys);
    if target.public {
        return Decision::Pass;
    }
    if let Some(t) = &creds.query {
        if !target.token_matches(t) {
            return Decision::Refuse;
        }
        // The same URL without the token; on this host whatever the path looks like (a
        // path of `//other.example/` would send the browser there).
        let location = crate::guard::same_host_location(
            parts
                .uri
                .path_and_query()
                .map(|pq| pq.as_str())
                .unwrap_or("/"),
        );
        let secure = if https { "; Secure" } else { "" };
        let cookie = format!("{SBX_TOKEN_PARAM}={t}; Path=/; HttpOnly; SameSite=Lax{secure}");
        return Decision::Redirect { location, cookie };
    }
    if creds.api_key
        || creds
            .token_in(&[SBX_TOKEN_HEADER])
            .any(|t| target.token_matches(t))
        || creds.cookies.iter().any(|c| target.token_matches(c))
    {
        return Decision::Pass;
    }
    Decision::Refuse
}

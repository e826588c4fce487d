//! Hop-by-hop headers (RFC 9110 7.6.1): of one connection, never passed on by the node's
//! proxies (the preview listener, the egress proxy).

use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers of one hop, never passed on (RFC 9110 7.6.1), besides those `Connection` names.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Takes the hop-by-hop headers out; `Upgrade` too unless `upgrading`, when `Connection:
/// upgrade` and `Upgrade` are what is asked of the next hop.
pub fn strip_hop_by_hop(h: &mut HeaderMap, upgrading: bool) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    let upgrade = h.get(header::UPGRADE).cloned();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
    h.remove(header::UPGRADE);
    if upgrading {
        if let Some(u) = upgrade {
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, u);
        }
    }
}

//! Small helpers: unique names, ids' and request ids' shapes, base64, times, truncation.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::DecodePaddingMode;
use base64::Engine;

/// A unique name for files and markers: pid, a counter and the clock.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{}-{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut cut = n;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} bytes)", &s[..cut], s.len())
}

/// `^[A-Za-z0-9._\-]{1,64}$`
pub fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// The spec's id shape: the prefix, `-` and 16 characters of the id alphabet.
pub fn is_id(prefix: &str, s: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else {
        return false;
    };
    rest.len() == 16
        && rest
            .bytes()
            .all(|b| b"0123456789abcdefghjkmnpqrstvwxyz".contains(&b))
}

/// Standard base64, padded.
pub fn b64_encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

/// Standard base64 (padding optional).
pub fn b64_decode(s: &str) -> Vec<u8> {
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    LENIENT
        .decode(s)
        .unwrap_or_else(|e| panic!("{s:?} is not base64: {e}"))
}

/// The time `from_now` from now, as RFC 3339 in UTC with milliseconds (`expires_at`).
pub fn rfc3339_in(from_now: Duration) -> String {
    let t = SystemTime::now() + from_now;
    let d = t.duration_since(UNIX_EPOCH).expect("after 1970");
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// A map of names to values (`env`, `metadata`, `secret_env` of a typed request).
pub fn kv(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

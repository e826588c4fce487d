//! Ids, request ids and names.
//!
//! An id is a prefix, a hyphen and 16 random characters of the alphabet
//! `0123456789abcdefghjkmnpqrstvwxyz` (`[0-9a-hjkmnp-tv-z]`: no i, l, o, u), e.g.
//! `sbx-k3v9q0d7xw2m4nfa`. A name is what a caller gives a sandbox, a snapshot or a volume:
//! a DNS label that cannot be taken for an id.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The 32 characters of an id's random part.
pub const ID_ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
/// How many random characters follow an id's prefix and hyphen.
pub const ID_RANDOM_LEN: usize = 16;

/// Prefix of a sandbox's id.
pub const SANDBOX_PREFIX: &str = "sbx";
/// Prefix of a command's (exec's) id.
pub const EXEC_PREFIX: &str = "exe";
/// Prefix of a snapshot's id.
pub const SNAPSHOT_PREFIX: &str = "snap";
/// Prefix of a volume's id.
pub const VOLUME_PREFIX: &str = "vol";
/// Prefix of an event's id.
pub const EVENT_PREFIX: &str = "evt";
/// Prefix of a request id the node makes.
pub const REQUEST_PREFIX: &str = "req";

/// What a name may not start with, so that it cannot be taken for an id.
pub const RESERVED_NAME_PREFIXES: [&str; 6] = ["sbx-", "exe-", "snap-", "vol-", "evt-", "req-"];

/// Longest request id (`X-Request-Id`).
pub const MAX_REQUEST_ID_LEN: usize = 64;
/// Longest name.
pub const MAX_NAME_LEN: usize = 63;

/// A new id: `prefix`, `-`, and 16 random characters of [`ID_ALPHABET`].
///
/// The randomness comes from the OS (`getrandom`). Should the OS refuse, the characters come
/// from std's randomly keyed hasher over a process-wide counter: still unpredictable enough
/// for ids, and this function never fails.
pub fn new_id(prefix: &str) -> String {
    let bytes = random_bytes();
    let mut id = String::with_capacity(prefix.len() + 1 + ID_RANDOM_LEN);
    id.push_str(prefix);
    id.push('-');
    for b in bytes {
        // 256 is a multiple of 32: every character is equally likely.
        id.push(char::from(ID_ALPHABET[usize::from(b & 31)]));
    }
    id
}

/// An id of `prefix` derived from `seed` (the first 16 bytes of a digest of it): the same
/// seed gives the same id, as an Idempotency-Key's retry needs.
pub fn derived_id(prefix: &str, seed: &[u8; 16]) -> String {
    let mut id = String::with_capacity(prefix.len() + 1 + ID_RANDOM_LEN);
    id.push_str(prefix);
    id.push('-');
    for b in seed.iter().take(ID_RANDOM_LEN) {
        id.push(char::from(ID_ALPHABET[usize::from(b & 31)]));
    }
    id
}

/// Whether `s` is an id of `prefix`: `prefix-` and 16 characters of [`ID_ALPHABET`].
pub fn is_id(prefix: &str, s: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix) else {
        return false;
    };
    let Some(random) = rest.strip_prefix('-') else {
        return false;
    };
    random.len() == ID_RANDOM_LEN && random.bytes().all(|b| ID_ALPHABET.contains(&b))
}

/// Whether `s` may be used as a request id: `^[A-Za-z0-9._\-]{1,64}$`.
pub fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_REQUEST_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// A new request id: `req-` and 16 random characters.
pub fn new_request_id() -> String {
    new_id(REQUEST_PREFIX)
}

/// The request id of a request: the caller's `X-Request-Id` where it is a valid one, else a
/// new one ("Anything else is ignored, and the node makes an id").
pub fn request_id_or_new(header: Option<&str>) -> String {
    match header {
        Some(h) if valid_request_id(h) => h.to_owned(),
        _ => new_request_id(),
    }
}

/// Whether `s` is a valid name: `^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`, not starting with an
/// id prefix (see [`RESERVED_NAME_PREFIXES`]).
pub fn valid_name(s: &str) -> bool {
    let b = s.as_bytes();
    let edge_ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let (Some(&first), Some(&last)) = (b.first(), b.last()) else {
        return false;
    };
    b.len() <= MAX_NAME_LEN
        && edge_ok(first)
        && edge_ok(last)
        && b.iter().all(|&c| edge_ok(c) || c == b'-')
        && !RESERVED_NAME_PREFIXES.iter().any(|p| s.starts_with(p))
}

fn random_bytes() -> [u8; ID_RANDOM_LEN] {
    let mut buf = [0u8; ID_RANDOM_LEN];
    if getrandom::getrandom(&mut buf).is_err() {
        fallback_fill(&mut buf);
    }
    buf
}

/// Fills `buf` from std's `RandomState` (keyed from the OS once per thread, then stepped for
/// each new state) over a process-wide counter.
fn fallback_fill(buf: &mut [u8]) {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    for chunk in buf.chunks_mut(8) {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        let word = h.finish().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_id_has_prefix_and_16_alphabet_chars() {
        for prefix in ["sbx", "exe", "snap", "vol", "evt", "req"] {
            let id = new_id(prefix);
            assert!(id.starts_with(&format!("{prefix}-")), "{id}");
            assert_eq!(id.len(), prefix.len() + 1 + 16);
            assert!(is_id(prefix, &id), "{id}");
            let random = &id[prefix.len() + 1..];
            assert!(random
                .chars()
                .all(|c| matches!(c, '0'..='9' | 'a'..='h' | 'j' | 'k' | 'm' | 'n' | 'p'..='t' | 'v'..='z')));
        }
    }

    #[test]
    fn new_ids_differ() {
        let a = new_id("sbx");
        let b = new_id("sbx");
        assert_ne!(a, b);
    }

    #[test]
    fn alphabet_is_the_specs() {
        let expected: Vec<u8> = (b'0'..=b'9')
            .chain(b'a'..=b'h')
            .chain([b'j', b'k', b'm', b'n'])
            .chain(b'p'..=b't')
            .chain(b'v'..=b'z')
            .collect();
        assert_eq!(ID_ALPHABET.to_vec(), expected);
    }

    #[test]
    fn fallback_fills_every_byte_differently() {
        let mut a = [0u8; 16];
        let mut b = [0u8; 16];
        fallback_fill(&mut a);
        fallback_fill(&mut b);
        assert_ne!(a, b);
    }

    #[test]
    fn is_id_rejects_wrong_shapes() {
        assert!(is_id("sbx", "sbx-0123456789abcdef"));
        assert!(!is_id("sbx", "exe-0123456789abcdef"));
        assert!(!is_id("sbx", "sbx0123456789abcdef0"));
        assert!(!is_id("sbx", "sbx-0123456789abcde"));
        assert!(!is_id("sbx", "sbx-0123456789abcdefg"));
        assert!(!is_id("sbx", "sbx-0123456789abcdei"));
        assert!(!is_id("sbx", "sbx-0123456789abcdeu"));
        assert!(!is_id("sbx", "sbx-0123456789ABCDEF"));
        assert!(!is_id("sbx", ""));
    }

    #[test]
    fn request_ids() {
        assert!(valid_request_id("a"));
        assert!(valid_request_id("Req_1.2-3"));
        assert!(valid_request_id(&"x".repeat(64)));
        assert!(!valid_request_id(&"x".repeat(65)));
        assert!(!valid_request_id(""));
        assert!(!valid_request_id("a b"));
        assert!(!valid_request_id("a/b"));
        assert!(!valid_request_id("é"));
        let id = new_request_id();
        assert!(is_id("req", &id));
        assert!(valid_request_id(&id));
        assert_eq!(request_id_or_new(Some("mine-1")), "mine-1");
        assert!(is_id("req", &request_id_or_new(Some("not valid"))));
        assert!(is_id("req", &request_id_or_new(None)));
    }

    #[test]
    fn names() {
        assert!(valid_name("a"));
        assert!(valid_name("web-1"));
        assert!(valid_name("sbx"));
        assert!(valid_name("sbxa-1"));
        assert!(valid_name(&"a".repeat(63)));
        assert!(!valid_name(&"a".repeat(64)));
        assert!(!valid_name(""));
        assert!(!valid_name("-a"));
        assert!(!valid_name("a-"));
        assert!(!valid_name("A"));
        assert!(!valid_name("a_b"));
        assert!(!valid_name("a.b"));
        for p in RESERVED_NAME_PREFIXES {
            assert!(!valid_name(&format!("{p}x")), "{p}");
        }
    }
}

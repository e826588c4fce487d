//! Fuzzing of [`normalize`], bounded in time so that it runs in `cargo test`: a seeded random
//! harness (`SBX_FUZZ_SEED` to replay one seed, `SBX_FUZZ_ITERS` and `SBX_FUZZ_SECONDS` for a
//! longer run). Paths are made of `/`, `.`, `..`, names, NUL and non-ASCII characters, some
//! around the 4096-byte limit.
//! Properties: no panic; refused exactly when empty, with a NUL byte, or over 4096 bytes (code
//! `invalid`, the caller's param); otherwise an absolute path with no empty, `.` or `..`
//! component, which normalises to itself, and which, without `..` in the input, keeps the
//! input's names in order.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Component;
use std::time::{Duration, Instant};

use sbx_proto::FsErrorCode;

use super::normalize;

/// SplitMix64: small, seeded, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn path(&mut self) -> String {
        const PARTS: &[&str] = &[
            "/", "/", "/", ".", "..", "...", "a", "etc", "shadow", "\0", " ", "é", "中", "😀",
            "\u{202e}", "\\", "..\\..", "%2e%2e", "~", "-", "\n",
        ];
        let n = match self.below(20) {
            0 => 1500 + self.below(1000),
            _ => self.below(24),
        };
        (0..n).map(|_| PARTS[self.below(PARTS.len())]).collect()
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn check(p: &str) {
    let refused = p.is_empty() || p.contains('\0') || p.len() > 4096;
    let n = match normalize(p, "path") {
        Ok(n) => n,
        Err(e) => {
            assert!(refused, "refused: {e:?}");
            assert_eq!(e.code, FsErrorCode::Invalid);
            assert_eq!(e.param.as_deref(), Some("path"));
            return;
        }
    };
    assert!(!refused, "accepted as {n:?}");
    let s = n.to_str().expect("the input was UTF-8");
    assert!(s.starts_with('/'), "{s:?}");
    assert!(s == "/" || !s.ends_with('/'), "{s:?}");
    assert!(!s.contains("//"), "{s:?}");
    assert!(s.len() <= p.len() + 1, "{s:?} is longer than {p:?}");
    let mut comps = n.components();
    assert_eq!(comps.next(), Some(Component::RootDir));
    for c in comps {
        assert!(matches!(c, Component::Normal(_)), "{c:?} in {s:?}");
    }
    assert_eq!(normalize(s, "path").expect("a normal path").as_path(), n);
    if !p.split('/').any(|c| c == "..") {
        let names: Vec<&str> = p
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        assert_eq!(s, format!("/{}", names.join("/")));
    }
}

#[test]
fn fuzz_normalize() {
    let seed = env_or("SBX_FUZZ_SEED", 0x5b7f_0017u64);
    let iters = env_or("SBX_FUZZ_ITERS", 50_000u64);
    let budget = Duration::from_secs(env_or("SBX_FUZZ_SECONDS", 4u64));
    let mut rng = Rng(seed);
    let start = Instant::now();
    let mut n = 0;
    while n < iters && start.elapsed() < budget {
        let p = rng.path();
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| check(&p))) {
            let what = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("normalize: execution {n} (SBX_FUZZ_SEED={seed}): {what}\ninput: {p:?}");
        }
        n += 1;
    }
    println!(
        "fuzz normalize: {n} executions in {:.2?}, seed {seed}, no panic",
        start.elapsed()
    );
    assert!(n >= 1000, "only {n} executions");
}

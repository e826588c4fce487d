//! A tree far bigger than what the store may hold in memory goes up and down streamed: the
//! process's peak resident memory grows by less than half the tree. (Its own test binary: the
//! peak is the process's.)

mod common;

use std::io::Write;
use std::path::Path;

use common::noise;
use sbx_blob::Store;

const FILES: usize = 4;
const FILE_MB: usize = 64;

/// The process's peak resident set (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("a number of kB");
    kb * 1024
}

/// Incompressible files written a MiB at a time (never whole in memory here either).
fn make_big_tree(root: &Path) -> u64 {
    std::fs::create_dir_all(root).unwrap();
    for i in 0..FILES {
        let mut f = std::fs::File::create(root.join(format!("pages-{i}.img"))).unwrap();
        for mb in 0..FILE_MB {
            f.write_all(&noise((i * 1000 + mb) as u64 + 1, 1 << 20))
                .unwrap();
        }
    }
    ((FILES * FILE_MB) as u64) << 20
}

#[test]
fn a_big_tree_goes_up_and_down_with_bounded_memory() {
    let top = tempfile::tempdir().unwrap();
    let src = top.path().join("src");
    let size = make_big_tree(&src);
    let store = Store::open(&format!("file://{}", top.path().join("store").display())).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let before = peak_rss();
    let put = rt.block_on(store.put_tree("big", &src)).unwrap();
    assert!(put.stored_bytes > size, "noise does not compress: {put:?}");
    let dest = top.path().join("dest");
    let got = rt.block_on(store.get_tree("big", &dest)).unwrap();
    assert_eq!(got.bytes, put.bytes);
    let grown = peak_rss().saturating_sub(before);
    eprintln!(
        "{} MiB up in {} ms, down in {} ms; peak memory grew {} MiB",
        size >> 20,
        put.ms,
        got.ms,
        grown >> 20
    );
    assert!(
        grown < size / 2,
        "peak memory grew {} MiB for a tree of {} MiB",
        grown >> 20,
        size >> 20
    );
    for i in 0..FILES {
        let name = format!("pages-{i}.img");
        assert_eq!(
            std::fs::metadata(dest.join(&name)).unwrap().len(),
            (FILE_MB as u64) << 20
        );
    }
}

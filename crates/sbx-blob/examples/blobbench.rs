//! The object store's throughput: put and get of a 50 MiB tree (like CRIU's images: pages that
//! do not compress, pages that do, and many small files) through a directory and through
//! SeaweedFS's S3 on loopback, each run's ms and MB/s (of the tree's plain bytes) and the median.
//!
//!   cargo run --release -p sbx-blob --example blobbench [-- --runs N] [--store URL]...
//!
//! Without `--store`: a directory store in a temp dir, and SeaweedFS when `weed` is found
//! ($SBX_WEED, PATH, or scripts/seaweedfs.sh's /opt/sbx-seaweedfs). `--store URL` benches that
//! store instead (S3 settings from the AWS_* variables), as often as given.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::path::Path;

use sbx_blob::{Stats, Store};

fn make_tree(root: &Path) -> u64 {
    let mut total = 0u64;
    std::fs::create_dir_all(root.join("small")).expect("the tree's directory");
    for i in 0..8u64 {
        let mut f = std::fs::File::create(root.join(format!("pages-{i}.img"))).expect("a file");
        // 5 MiB: half noise, half text.
        let mut data = common::noise(i + 100, 5 << 19);
        data.extend(b"GET /index.html 200 ".iter().cycle().take(5 << 19));
        f.write_all(&data).expect("a write");
        total += data.len() as u64;
    }
    for i in 0..2560u64 {
        let data = if i % 2 == 0 {
            common::noise(i, 4096)
        } else {
            vec![b'a'; 4096]
        };
        std::fs::write(root.join(format!("small/f{i}")), &data).expect("a small file");
        total += 4096;
    }
    total
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

async fn bench(store: &Store, src: &Path, work: &Path, runs: usize) {
    println!("store {}", store.describe());
    // Each store's downloads in a folder of their own.
    let work = &work.join(format!("{:p}", store));
    let mut puts = Vec::new();
    let mut gets = Vec::new();
    let mut last: Option<Stats> = None;
    for run in 0..runs {
        let key = format!("bench/run-{run}.tar.zst");
        let put = match store.put_tree(&key, src).await {
            Ok(s) => s,
            Err(e) => {
                println!("  put failed: {e}");
                return;
            }
        };
        let dest = work.join(format!("get-{run}"));
        let get = match store.get_tree(&key, &dest).await {
            Ok(s) => s,
            Err(e) => {
                println!("  get failed: {e}");
                return;
            }
        };
        println!(
            "  run {run}: put {:>5} ms {:>7.1} MB/s   get {:>5} ms {:>7.1} MB/s",
            put.ms,
            put.mb_per_s(),
            get.ms,
            get.mb_per_s()
        );
        // Kept until the end: ext4 makes files slowly where many were just deleted.
        let _ = store.delete(&key).await;
        puts.push(put.ms);
        gets.push(get.ms);
        last = Some(put);
    }
    if let Some(s) = last {
        let mb = s.bytes as f64 / 1e6;
        let (p, g) = (median(puts), median(gets));
        println!(
            "  median: put {p} ms ({:.1} MB/s), get {g} ms ({:.1} MB/s); {:.1} MB stored of {mb:.1} MB",
            mb / (p.max(1) as f64 / 1e3),
            mb / (g.max(1) as f64 / 1e3),
            s.stored_bytes as f64 / 1e6
        );
    }
}

fn main() {
    let mut runs = 5usize;
    let mut urls = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--runs" => runs = args.next().and_then(|n| n.parse().ok()).unwrap_or(runs),
            "--store" => urls.extend(args.next()),
            other => {
                eprintln!("blobbench: unknown argument {other} (--runs N, --store URL)");
                std::process::exit(2);
            }
        }
    }
    let top = tempfile::tempdir().expect("a temp dir");
    let src = top.path().join("src");
    let size = make_tree(&src);
    println!("tree: {:.1} MB in {} files", size as f64 / 1e6, 8 + 2560);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let work = top.path().join("work");
    std::fs::create_dir_all(&work).expect("the work dir");
    if !urls.is_empty() {
        for url in urls {
            match Store::open(&url) {
                Ok(store) => rt.block_on(bench(&store, &src, &work, runs)),
                Err(e) => println!("{url}: {e}"),
            }
        }
        return;
    }
    let dir = Store::open(&format!("file://{}", top.path().join("store").display()))
        .expect("a directory store");
    rt.block_on(bench(&dir, &src, &work, runs));
    match sbx_blob::testing::find_weed() {
        Some(bin) => {
            let weed = sbx_blob::testing::Weed::start(&bin);
            weed.make_bucket("sbx-bench");
            match Store::open_with_env("s3://sbx-bench/b", weed.env()) {
                Ok(store) => rt.block_on(bench(&store, &src, &work, runs)),
                Err(e) => println!("SeaweedFS: {e}"),
            }
        }
        None => println!("SeaweedFS: skipped (no weed: scripts/seaweedfs.sh installs it)"),
    }
}

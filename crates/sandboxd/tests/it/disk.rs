//! Each sandbox's disk has the node's size (`--disk-bytes`), each volume its own: a writer
//! past it gets an error (EDQUOT, "Disk quota exceeded": btrfs qgroups), the node serves the
//! next request and a neighbour writes on; the space comes back when the files go.

use std::time::Duration;

use crate::common::{get_json, stdout, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(20);
const DISK: u64 = 64 << 20;

fn sh(node: &TestNode, id: &str, command: &str) -> Value {
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({ "command": command }),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{command}: {v}");
    v
}

/// Writes MiB after MiB until the write fails, then says how far it got.
const FILL: &str = "i=0; while dd if=/dev/zero of=$F bs=1M count=1 seek=$i conv=notrunc,fsync \
                    status=none 2>/dev/shm/err; do i=$((i+1)); [ $i -ge 1000 ] && break; done; \
                    echo $i; cat /dev/shm/err >&2";

#[test]
fn a_full_disk_stops_its_sandbox_alone() {
    let node = TestNode::start_with(&["--disk-bytes", &DISK.to_string(), "--warm-pool", "2"]);
    let (_, info) = get_json(&node, "/internal/node");
    assert_eq!(info["disk_bytes"], DISK, "{info}");
    assert_eq!(info["disk"]["filesystem"], "btrfs", "{info}");
    assert!(
        info["disk"]["free_bytes"].as_u64().unwrap() > DISK,
        "{info}"
    );
    let a = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();

    let v = sh(&node, &a, &format!("F=/big; {FILL}"));
    let written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!((32..64).contains(&written), "stopped at {written} MiB: {v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap()
            .contains("Disk quota exceeded"),
        "{v}"
    );
    // The sandbox itself goes on; so do the node and the neighbour.
    let v = sh(&node, &a, "echo still here");
    assert_eq!(stdout(&v), "still here\n", "{v}");
    assert_eq!(node.get("/healthz", &[]).status, 200);
    let v = sh(
        &node,
        &b,
        "dd if=/dev/zero of=/ok bs=1M count=16 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    // A run (a sandbox of the warm pool) has the same size.
    let v = node.run_ok(&json!({"command": format!("F=/big; {FILL}")}));
    let run_written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!(run_written < 64, "a run wrote {run_written} MiB: {v}");
    // Its files gone, it has its room again.
    let v = sh(
        &node,
        &a,
        "rm /big && sync && sleep 1 && dd if=/dev/zero of=/again bs=1M count=16 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    node.delete_sandbox(&a);
    node.delete_sandbox(&b);
    node.assert_clean(CLEAN);
}

#[test]
fn a_full_volume_stops_at_its_size() {
    let node = TestNode::start();
    let r = node.post_json(
        "/v1/volumes",
        &json!({"name": "small", "size_bytes": 16 << 20}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let a = node.create_sandbox(&json!({"volumes": [{"path": "/vol", "volume": "small"}]}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = sh(&node, &a, &format!("F=/vol/big; {FILL}"));
    let written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!((8..16).contains(&written), "stopped at {written} MiB: {v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap()
            .contains("Disk quota exceeded"),
        "{v}"
    );
    // Its own disk is not the volume's.
    let v = sh(
        &node,
        &a,
        "dd if=/dev/zero of=/root/ok bs=1M count=32 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    let v = sh(
        &node,
        &b,
        "dd if=/dev/zero of=/ok bs=1M count=32 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    assert_eq!(node.get("/healthz", &[]).status, 200);
    let (_, vol) = get_json(&node, "/v1/volumes/small");
    let used = vol["used_bytes"].as_u64().unwrap();
    assert!(((8 << 20)..=(16 << 20)).contains(&used), "{vol}");
    node.delete_sandbox(&a);
    node.delete_sandbox(&b);
    let r = node.delete("/v1/volumes/small", &[]);
    assert_eq!(r.status, 204, "{}", r.text());
    node.assert_clean(CLEAN);
}

/// The node's image (DATA_DIR/disk.img): its length and the bytes the host has allocated to it.
fn image_blocks(node: &TestNode) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(node.data_dir.join("disk.img")).expect("the node's disk.img");
    (m.len(), m.blocks() * 512)
}

/// A node of a small disk (1 GiB, sandboxes' disks of 128 MiB, no overcommit) promises no
/// more than it holds: creates past it are refused (503 drive_full, and so is a volume), GET
/// /healthz says why; every sandbox it made fills its own disk to its limit (EDQUOT), none
/// finds the disk full (ENOSPC) or broken (EIO); the image's blocks are the host's from the
/// start; a sandbox deleted gives its room back.
#[test]
fn the_disk_promises_no_more_than_it_holds() {
    const SMALL: u64 = 128 << 20;
    let node = TestNode::start_with(&[
        "--disk-image-bytes",
        "1073741824",
        "--disk-bytes",
        &SMALL.to_string(),
        "--disk-overcommit",
        "1",
        "--warm-pool",
        "0",
    ]);
    let (len, allocated) = image_blocks(&node);
    assert_eq!(len, 1 << 30);
    assert!(
        allocated >= len,
        "disk.img is sparse: {allocated} of {len} bytes allocated"
    );
    let (_, info) = get_json(&node, "/internal/node");
    let promise = &info["disk"]["promise"];
    assert_eq!(promise["overcommit"], 1.0, "{info}");
    assert_eq!(promise["promised_bytes"], 0, "{info}");
    let size = promise["size_bytes"].as_u64().unwrap();
    let promisable = promise["promisable_bytes"].as_u64().unwrap();
    assert!(promisable < size && size <= 1 << 30, "{info}");
    let fits = (promisable / SMALL) as usize;
    assert!((4..8).contains(&fits), "{fits} sandboxes: {info}");

    let ids: Vec<String> = (0..fits)
        .map(|_| {
            node.create_sandbox(&json!({}))["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let (_, info) = get_json(&node, "/internal/node");
    assert_eq!(
        info["disk"]["promise"]["promised_bytes"],
        fits as u64 * SMALL,
        "{info}"
    );
    // One more sandbox, a run, a volume: past the promise.
    let r = node.post_json("/v1/sandboxes", &json!({}));
    assert_eq!(r.status, 503, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], "drive_full", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--disk-overcommit"), "{msg}");
    let (status, v) = node.run(&json!({"command": "true"}));
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "drive_full", "{v}");
    let r = node.post_json("/v1/volumes", &json!({"size_bytes": SMALL}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "drive_full", "{}", r.text());
    // GET /healthz says the node cannot make one (once its last answer, of up to a second
    // ago, is renewed).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let r = loop {
        let r = node.get("/healthz", &[]);
        if r.status != 200 || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("node_disk"), "{}", r.text());

    // Each fills its disk: its own limit stops it, never the disk.
    for id in &ids {
        let v = sh(&node, id, &format!("F=/big; {FILL}"));
        let written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
        let err = v["stderr"].as_str().unwrap();
        assert!(
            err.contains("Disk quota exceeded"),
            "{id} after {written} MiB: {v}"
        );
        assert!(
            (64..128).contains(&written),
            "{id} stopped at {written} MiB: {v}"
        );
    }
    // And still writes after, within its room: the disk was never full.
    let v = sh(
        &node,
        &ids[0],
        "rm /big && sync && sleep 1 && echo fine > /small && cat /small",
    );
    assert_eq!(stdout(&v), "fine\n", "{v}");

    // A sandbox deleted: its room is promised again.
    node.delete_sandbox(&ids[fits - 1]);
    let deadline = std::time::Instant::now() + CLEAN;
    let again = loop {
        let r = node.post_json("/v1/sandboxes", &json!({}));
        if r.status == 201 || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(again.status, 201, "{}", again.text());
    let last = again.json()["id"].as_str().unwrap().to_string();
    for id in ids[..fits - 1].iter().chain([&last]) {
        node.delete_sandbox(id);
    }
    node.assert_clean(CLEAN);
}

/// A node whose disk the host has not the room for does not start (its sandboxes' writes would
/// fail with EIO once the host's filesystem ran out under the image): it says so and how to
/// choose a smaller one, and leaves no image behind.
#[test]
fn a_node_refuses_a_disk_the_host_has_no_room_for() {
    let root = std::env::temp_dir().join(format!(
        "sbx-test-noroom-{}-{}",
        std::process::id(),
        crate::common::unique("d")
    ));
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let out = std::process::Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(&data)
        .output()
        .expect("df");
    let free: u64 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df's answer");
    let too_big = free + (4 << 30);
    let mut child = std::process::Command::new(crate::common::sandboxd_bin())
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", crate::common::free_port()))
        .arg("--data-dir")
        .arg(&data)
        .arg("--images-dir")
        .arg(crate::common::images_dir())
        .args([
            "--cgroup-name",
            &format!("sbx-test-noroom-{}", std::process::id()),
        ])
        .args(["--egress-default", "none", "--preview-listen", "off"])
        .args(["--disk-image-bytes", &too_big.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start sandboxd");
    // It ends at once; one that serves is ended after 20 s (and the test fails).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    let image = data.join("disk.img");
    let left = image.exists() || data.join("disk.img.tmp").exists();
    let _ = std::fs::remove_dir_all(&root);
    let status = status.unwrap_or_else(|| {
        panic!("the node started with a disk of {too_big} bytes on a host with {free} free:\n{err}")
    });
    assert!(!status.success(), "{err}");
    assert!(err.contains("smaller --disk-image-bytes"), "{err}");
    assert!(!left, "an image was left: {err}");
}

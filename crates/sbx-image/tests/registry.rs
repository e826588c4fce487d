//! Pulls from a real registry on loopback: Debian's `docker-registry` (distribution 2.8),
//! started per test with its own storage and port, killed and removed when the test ends (also
//! when it fails). Images are built here by hand (layer tars, config, manifests, an index with
//! linux/amd64 and linux/arm64) and pushed with the registry's own push API.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use sbx_image::{Credentials, ImageError, Progress, Store, OPAQUE_XATTR};
use sbx_testreg::{hex_of, sha256, Compression, IndexEntry, Layer, Registry, Tar, OCI_MANIFEST};
use serde_json::json;

const BASE: u32 = 100_000;

// ---------------------------------------------------------------------------------------------
// The registry (sbx-testreg) and a store that speaks plain HTTP to it.

fn store_of(reg: &Registry, root: &Path) -> Store {
    Store::new(root.to_path_buf(), BASE, vec![reg.host()])
}

/// A read-only overlay mount, unmounted when dropped.
struct Mount(PathBuf);

impl Mount {
    fn overlay(lowerdir: &str, target: &Path) -> Mount {
        let status = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!("lowerdir={lowerdir}"))
            .arg(target)
            .status()
            .unwrap();
        assert!(status.success(), "mount overlay: {status}");
        Mount(target.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

// ---------------------------------------------------------------------------------------------
// Images.

/// The test image's three layers: gzip, zstd, and plain tar with whiteouts and an opaque dir.
fn app_layers() -> Vec<Layer> {
    let base = Tar::new()
        .dir("etc/")
        .file("etc/os-release", b"ID=sbx-test\n")
        .file("etc/remove-me", b"soon gone\n")
        .dir("usr/")
        .dir("usr/bin/")
        .add(
            tar::EntryType::Regular,
            "usr/bin/tool",
            0o4755,
            (0, 0),
            b"#!/bin/sh\n",
        )
        .link(tar::EntryType::Link, "usr/bin/tool-again", "usr/bin/tool")
        .link(tar::EntryType::Symlink, "bin", "usr/bin")
        .add(tar::EntryType::Directory, "home/", 0o755, (0, 0), b"")
        .add(
            tar::EntryType::Directory,
            "home/user/",
            0o700,
            (1000, 1000),
            b"",
        )
        .add(
            tar::EntryType::Regular,
            "home/user/notes",
            0o600,
            (1000, 1000),
            b"mine\n",
        )
        .dir("var/")
        .dir("var/cache/")
        .file("var/cache/stale", b"old\n")
        .dir("dev/")
        .dev("dev/null", 1, 3)
        .done();
    let app = Tar::new()
        .dir("opt/")
        .dir("opt/app/")
        .add(
            tar::EntryType::Regular,
            "opt/app/run",
            0o755,
            (0, 0),
            b"#!/bin/sh\necho hi\n",
        )
        .done();
    let deletes = Tar::new()
        .dir("etc/")
        .file("etc/.wh.remove-me", b"")
        .dir("var/")
        .dir("var/cache/")
        .file("var/cache/.wh..wh..opq", b"")
        .file("var/cache/fresh", b"new\n")
        .done();
    vec![
        Layer::new(base, Compression::Gzip),
        Layer::new(app, Compression::Zstd),
        Layer::new(deletes, Compression::None),
    ]
}

fn config_json(layers: &[Layer], arch: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "architecture": arch,
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "APP=1"],
            "WorkingDir": "/opt/app",
            "User": "1000:1000",
            "Entrypoint": ["/opt/app/run"],
            "Cmd": ["--serve"],
            "StopSignal": "SIGINT",
            "Labels": {"sbx.start": "/opt/app/run --serve", "sbx.ready": "http:8080/health"}
        },
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>()}
    }))
    .unwrap()
}

/// Pushes layers, config and an OCI manifest (untagged); returns (manifest digest, size).
fn push_image(reg: &Registry, repo: &str, layers: &[Layer], config: &[u8]) -> (String, usize) {
    reg.push_image(repo, None, layers, config).unwrap()
}

/// Pushes the app image for amd64 and a different one for arm64 under an index tagged `tag`.
/// Returns (index digest, amd64 manifest digest, amd64 layers).
fn push_app(reg: &Registry, repo: &str, tag: &str) -> (String, String, Vec<Layer>) {
    let layers = app_layers();
    let (amd64, amd64_size) = push_image(reg, repo, &layers, &config_json(&layers, "amd64"));
    let arm_layers = vec![Layer::new(
        Tar::new().file("arch", b"arm64\n").done(),
        Compression::Gzip,
    )];
    let (arm64, arm64_size) =
        push_image(reg, repo, &arm_layers, &config_json(&arm_layers, "arm64"));
    let index_digest = reg
        .push_index(
            repo,
            tag,
            &[
                IndexEntry {
                    digest: &arm64,
                    size: arm64_size,
                    architecture: "arm64",
                    variant: Some("v8"),
                },
                IndexEntry {
                    digest: &amd64,
                    size: amd64_size,
                    architecture: "amd64",
                    variant: None,
                },
            ],
        )
        .unwrap();
    (index_digest, amd64, layers)
}

type Seen = Arc<Mutex<Vec<Progress>>>;

fn recorder() -> (Seen, impl Fn(Progress) + Send + Sync) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    (seen, move |p| s.lock().unwrap().push(p))
}

fn no_progress(_: Progress) {}

/// Names in a store directory (temp files included).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|it| {
            it.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn temps(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for d in ["", "blobs/sha256", "layers", "images", "refs", "refs/index"] {
        for n in names(&root.join(d)) {
            if n.starts_with(".tmp-") {
                found.push(format!("{d}/{n}"));
            }
        }
    }
    found
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[tokio::test]
async fn pull_by_tag_and_digest() {
    let reg = Registry::start(None).unwrap();
    let (index_digest, amd64, layers) = push_app(&reg, "team/app", "1.0");
    let store_dir = tempfile::tempdir().unwrap();
    let root = store_dir.path();
    let store = store_of(&reg, root);
    let by_tag = format!("{}/team/app:1.0", reg.host());

    let (seen, progress) = recorder();
    let image = store.pull(&by_tag, None, &progress).await.unwrap();
    assert_eq!(image.digest, amd64, "the index's linux/amd64 image");
    assert_eq!(image.reference, by_tag);
    let want: Vec<PathBuf> = layers
        .iter()
        .map(|l| root.join("layers").join(hex_of(&l.diff_id)))
        .collect();
    assert_eq!(image.layers, want, "bottom first, named by diff_id");

    // Progress: every layer, ending at its size.
    let seen = seen.lock().unwrap().clone();
    for l in &layers {
        let last = seen.iter().rfind(|p| p.layer == l.digest()).unwrap();
        assert_eq!(
            (last.done, last.total),
            (l.blob.len() as u64, l.blob.len() as u64)
        );
    }

    // The config.
    let c = &image.config;
    assert_eq!(c.env, vec!["PATH=/usr/local/bin:/usr/bin:/bin", "APP=1"]);
    assert_eq!(c.working_dir.as_deref(), Some("/opt/app"));
    assert_eq!(c.user.as_deref(), Some("1000:1000"));
    assert_eq!(c.entrypoint, Some(vec!["/opt/app/run".to_string()]));
    assert_eq!(c.cmd, Some(vec!["--serve".to_string()]));
    assert_eq!(c.stop_signal.as_deref(), Some("SIGINT"));
    assert_eq!(c.labels["sbx.start"], "/opt/app/run --serve");
    assert_eq!(c.labels["sbx.ready"], "http:8080/health");

    // The layers' files.
    let [base, app, deletes] = &image.layers[..] else {
        panic!("three layers")
    };
    let m =
        |p: PathBuf| fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(
        fs::read(base.join("etc/os-release")).unwrap(),
        b"ID=sbx-test\n"
    );
    let tool = m(base.join("usr/bin/tool"));
    assert_eq!(
        (tool.uid(), tool.gid(), tool.mode() & 0o7777),
        (BASE, BASE, 0o4755)
    );
    assert_eq!(tool.mtime(), 1_700_000_000);
    assert_eq!(m(base.join("usr/bin/tool-again")).ino(), tool.ino());
    assert_eq!(
        fs::read_link(base.join("bin")).unwrap(),
        Path::new("usr/bin")
    );
    let home = m(base.join("home/user"));
    assert_eq!(
        (home.uid(), home.gid(), home.mode() & 0o7777),
        (BASE + 1000, BASE + 1000, 0o700)
    );
    let notes = m(base.join("home/user/notes"));
    assert_eq!((notes.uid(), notes.mode() & 0o7777), (BASE + 1000, 0o600));
    let null = m(base.join("dev/null"));
    assert!(null.file_type().is_char_device());
    assert_eq!(null.rdev(), nix::sys::stat::makedev(1, 3));
    assert!(m(app.join("opt/app/run")).mode() & 0o111 != 0);
    let wh = m(deletes.join("etc/remove-me"));
    assert!(
        wh.file_type().is_char_device() && wh.rdev() == 0,
        "whiteout"
    );
    assert!(!deletes.join("etc/.wh.remove-me").exists());
    assert_eq!(
        xattr::get(deletes.join("var/cache"), OPAQUE_XATTR)
            .unwrap()
            .as_deref(),
        Some(&b"y"[..])
    );
    assert!(!deletes.join("var/cache/.wh..wh..opq").exists());
    assert_eq!(fs::read(deletes.join("var/cache/fresh")).unwrap(), b"new\n");
    assert!(!root.join("layers").join("arch").exists());

    // What the kernel makes of them: an overlay of the layers (top first) shows the files
    // the image means, whiteouts and the opaque directory applied.
    {
        let mnt = tempfile::tempdir().unwrap();
        let lower: Vec<String> = image
            .layers
            .iter()
            .rev()
            .map(|p| p.display().to_string())
            .collect();
        let _mount = Mount::overlay(&lower.join(":"), mnt.path());
        let m = mnt.path();
        assert_eq!(
            fs::read(m.join("etc/os-release")).unwrap(),
            b"ID=sbx-test\n"
        );
        assert!(!m.join("etc/remove-me").exists(), "whited out");
        assert!(
            !m.join("var/cache/stale").exists(),
            "hidden by the opaque directory"
        );
        assert_eq!(fs::read(m.join("var/cache/fresh")).unwrap(), b"new\n");
        assert_eq!(
            fs::read(m.join("opt/app/run")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert_eq!(fs::read(m.join("bin/tool")).unwrap(), b"#!/bin/sh\n");
        assert_eq!(
            fs::metadata(m.join("usr/bin/tool")).unwrap().mode() & 0o7777,
            0o4755
        );
    }

    // The store's layout.
    assert!(root
        .join("images")
        .join(format!("{}.json", hex_of(&amd64)))
        .is_file());
    for d in [&amd64, &index_digest]
        .into_iter()
        .cloned()
        .chain(layers.iter().map(Layer::digest))
    {
        assert!(
            root.join("blobs/sha256").join(hex_of(&d)).is_file(),
            "blob {d}"
        );
    }
    assert!(root
        .join("refs/index")
        .join(hex_of(&index_digest))
        .is_file());
    assert_eq!(names(&root.join("layers")).len(), 3);
    assert!(temps(root).is_empty(), "{:?}", temps(root));

    // Again by tag: the manifest only. By either digest: no request at all.
    let (blobs, manifests) = (reg.gets("blobs"), reg.gets("manifests"));
    let again = store.pull(&by_tag, None, &no_progress).await.unwrap();
    assert_eq!(again, image);
    assert_eq!(
        (reg.gets("blobs"), reg.gets("manifests")),
        (blobs, manifests + 1)
    );
    for d in [&index_digest, &amd64] {
        let by_digest = format!("{}/team/app@{d}", reg.host());
        let img = store.pull(&by_digest, None, &no_progress).await.unwrap();
        assert_eq!(
            (img.digest.as_str(), &img.layers),
            (amd64.as_str(), &image.layers)
        );
        assert_eq!(img.reference, by_digest);
        assert_eq!(store.get(&by_digest).unwrap().digest, amd64);
    }
    assert_eq!(
        (reg.gets("blobs"), reg.gets("manifests")),
        (blobs, manifests + 1)
    );

    // Local look-ups.
    assert_eq!(store.get(&by_tag).unwrap(), image);
    assert!(store.get(&format!("{}/team/app:2.0", reg.host())).is_none());
    assert!(store.get("not a reference").is_none());

    // A fresh store pulls by digest straight away; layers shared with another image are not
    // fetched again.
    let other_dir = tempfile::tempdir().unwrap();
    let other = store_of(&reg, other_dir.path());
    let by_digest = format!("{}/team/app@{amd64}", reg.host());
    let img = other.pull(&by_digest, None, &no_progress).await.unwrap();
    assert_eq!(img.digest, amd64);
    let shared = Layer::new(Tar::new().file("extra", b"x").done(), Compression::Gzip);
    let mut two = app_layers();
    two.truncate(1);
    two.push(shared);
    let (second, _) = push_image(&reg, "team/app", &two, &config_json(&two, "amd64"));
    let blobs = reg.gets("blobs");
    let img2 = other
        .pull(
            &format!("{}/team/app@{second}", reg.host()),
            None,
            &no_progress,
        )
        .await
        .unwrap();
    assert_eq!(
        img2.layers[0], img.layers[0],
        "the shared layer is one directory"
    );
    // The config and the new layer only.
    assert_eq!(reg.gets("blobs"), blobs + 2);

    // Unknown tags and repositories.
    for missing in ["team/app:nope", "team/nothing:1"] {
        let r = store
            .pull(&format!("{}/{missing}", reg.host()), None, &no_progress)
            .await;
        assert!(
            matches!(r, Err(ImageError::NotFound(_))),
            "{missing}: {r:?}"
        );
    }
    assert!(matches!(
        store.pull("Bad:ref:", None, &no_progress).await,
        Err(ImageError::InvalidReference { .. })
    ));
}

#[tokio::test]
async fn blobs_that_do_not_match_their_digest_are_refused() {
    let reg = Registry::start(None).unwrap();
    let layers = app_layers();
    let (digest, _) = push_image(&reg, "corrupt", &layers, &config_json(&layers, "amd64"));
    reg.push_manifest(
        "corrupt",
        "1",
        OCI_MANIFEST,
        &fs::read(reg.blob_data(&digest)).unwrap(),
    )
    .unwrap();
    // The registry now serves other bytes (of the same size) for the second layer.
    let data = reg.blob_data(&layers[1].digest());
    let mut body = fs::read(&data).unwrap();
    let mid = body.len() / 2;
    body[mid] ^= 0x55;
    fs::write(&data, &body).unwrap();

    let store_dir = tempfile::tempdir().unwrap();
    let root = store_dir.path();
    let store = store_of(&reg, root);
    let r = store
        .pull(&format!("{}/corrupt:1", reg.host()), None, &no_progress)
        .await;
    match r {
        Err(ImageError::DigestMismatch { expected, .. }) => {
            assert_eq!(expected, layers[1].digest())
        }
        other => panic!("{other:?}"),
    }
    assert!(!root
        .join("blobs/sha256")
        .join(hex_of(&layers[1].digest()))
        .exists());
    assert!(names(&root.join("layers")).is_empty(), "no layer is made");
    assert!(names(&root.join("images")).is_empty());
    assert_eq!(names(&root.join("refs")), vec!["index"]);
    assert!(temps(root).is_empty(), "{:?}", temps(root));

    // A config naming a wrong diff_id: the layer's blob is right, its tar is not what the
    // image says it is.
    let reg2 = Registry::start(None).unwrap();
    let good = app_layers();
    let mut lying = config_json(&good, "amd64");
    let s = String::from_utf8(lying.clone()).unwrap();
    lying = s
        .replace(&good[2].diff_id, &format!("sha256:{}", "ab".repeat(32)))
        .into_bytes();
    let (digest, _) = push_image(&reg2, "lies", &good, &lying);
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = store_of(&reg2, dir2.path());
    let r = store2
        .pull(
            &format!("{}/lies@{digest}", reg2.host()),
            None,
            &no_progress,
        )
        .await;
    assert!(matches!(r, Err(ImageError::DigestMismatch { .. })), "{r:?}");
    // The honest layers may stay (they are complete); the lying one is not there.
    assert!(!dir2.path().join("layers").join("ab".repeat(32)).exists());
    assert!(names(&dir2.path().join("images")).is_empty());
    assert!(temps(dir2.path()).is_empty(), "{:?}", temps(dir2.path()));
}

#[tokio::test]
async fn private_registry_needs_credentials() {
    let password = "s3cret-Pa55word";
    let reg = Registry::start(Some(("sbx", password))).unwrap();
    let (_, amd64, _) = push_app(&reg, "private/app", "v1");
    let store_dir = tempfile::tempdir().unwrap();
    let store = store_of(&reg, store_dir.path());
    let reference = format!("{}/private/app:v1", reg.host());

    let r = store.pull(&reference, None, &no_progress).await;
    assert!(
        matches!(&r, Err(ImageError::Unauthorized { registry }) if *registry == reg.host()),
        "{r:?}"
    );

    let wrong = Credentials {
        username: "sbx".into(),
        password: "not-the-password".into(),
    };
    let r = store.pull(&reference, Some(&wrong), &no_progress).await;
    let e = r.unwrap_err();
    assert!(matches!(e, ImageError::Unauthorized { .. }), "{e:?}");
    assert!(!format!("{e} {e:?}").contains("not-the-password"));

    let right = Credentials {
        username: "sbx".into(),
        password: password.into(),
    };
    assert!(!format!("{right:?}").contains(password));
    let image = store
        .pull(&reference, Some(&right), &no_progress)
        .await
        .unwrap();
    assert_eq!(image.digest, amd64);
    assert_eq!(image.layers.len(), 3);

    // The store has it now: `pull` by digest answers from the store; `pull_from_registry`
    // asks the registry (its manifest only), which refuses without the login.
    let by_digest = format!("{}/private/app@{amd64}", reg.host());
    let blobs = reg.gets("blobs");
    assert_eq!(
        store.pull(&by_digest, None, &no_progress).await.unwrap(),
        store.get(&by_digest).unwrap()
    );
    for creds in [None, Some(&wrong)] {
        let r = store
            .pull_from_registry(&by_digest, creds, &no_progress)
            .await;
        assert!(matches!(r, Err(ImageError::Unauthorized { .. })), "{r:?}");
    }
    let manifests = reg.gets("manifests");
    let again = store
        .pull_from_registry(&by_digest, Some(&right), &no_progress)
        .await
        .unwrap();
    assert_eq!(again.digest, amd64);
    assert_eq!(reg.gets("manifests"), manifests + 1);
    assert_eq!(reg.gets("blobs"), blobs, "no blob fetched again");
}

#[tokio::test]
async fn a_dropped_pull_leaves_nothing_and_the_next_one_completes() {
    let reg = Registry::start(None).unwrap();
    // A first layer big enough to be seen midway: 8 MiB that gzip cannot shrink.
    let mut noise = vec![0u8; 8 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in noise.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let mut layers = vec![Layer::new(
        Tar::new().file("noise", &noise).done(),
        Compression::Gzip,
    )];
    layers.extend(app_layers());
    let (digest, _) = push_image(&reg, "big", &layers, &config_json(&layers, "amd64"));
    reg.push_manifest(
        "big",
        "1",
        OCI_MANIFEST,
        &fs::read(reg.blob_data(&digest)).unwrap(),
    )
    .unwrap();

    let store_dir = tempfile::tempdir().unwrap();
    let root = store_dir.path();
    let store = store_of(&reg, root);
    let reference = format!("{}/big:1", reg.host());
    let started = Arc::new(tokio::sync::Notify::new());
    let first = layers[0].digest();
    let signal = started.clone();
    let progress = move |p: Progress| {
        if p.layer == first && p.done > 0 && p.done < p.total {
            signal.notify_one();
        }
    };
    tokio::select! {
        biased;
        _ = started.notified() => {}
        r = store.pull(&reference, None, &progress) => panic!("the pull ended first: {r:?}"),
    }
    // The pull is dropped: no image, no layer, no ref, no temp file.
    assert!(names(&root.join("images")).is_empty());
    assert!(names(&root.join("layers")).is_empty());
    assert_eq!(names(&root.join("refs")), vec!["index"]);
    assert!(temps(root).is_empty(), "{:?}", temps(root));
    assert!(store.get(&reference).is_none());

    // What a killed process would leave: temp files, removed by the next pull.
    fs::create_dir(root.join("layers/.tmp-1-0-half")).unwrap();
    fs::write(root.join("layers/.tmp-1-0-half/file"), b"x").unwrap();
    fs::write(root.join("blobs/sha256/.tmp-1-1-part"), b"x").unwrap();
    let image = store.pull(&reference, None, &no_progress).await.unwrap();
    assert_eq!(image.layers.len(), 4);
    assert_eq!(fs::read(image.layers[0].join("noise")).unwrap(), noise);
    assert!(temps(root).is_empty(), "{:?}", temps(root));
}

#[tokio::test]
async fn gc_removes_what_no_image_uses() {
    let reg = Registry::start(None).unwrap();
    let (_, amd64, layers) = push_app(&reg, "gc/app", "1");
    let mut other_layers = app_layers();
    other_layers.truncate(1);
    other_layers.push(Layer::new(
        Tar::new().file("only-b", b"b").done(),
        Compression::Zstd,
    ));
    let (b_digest, _) = push_image(
        &reg,
        "gc/app",
        &other_layers,
        &config_json(&other_layers, "amd64"),
    );

    let store_dir = tempfile::tempdir().unwrap();
    let root = store_dir.path();
    let store = store_of(&reg, root);
    assert_eq!(store.gc().unwrap(), Default::default());
    let a_ref = format!("{}/gc/app:1", reg.host());
    let a = store.pull(&a_ref, None, &no_progress).await.unwrap();
    let b_ref = format!("{}/gc/app@{b_digest}", reg.host());
    let b = store.pull(&b_ref, None, &no_progress).await.unwrap();
    assert_eq!(a.layers[0], b.layers[0]);

    // Nothing to collect yet.
    let report = store.gc().unwrap();
    assert_eq!(report, Default::default());
    assert_eq!(store.get(&a_ref).unwrap(), a);

    // Garbage: a stray blob, a stray layer, temp files, a ref to an image no longer here.
    fs::write(root.join("blobs/sha256").join("0".repeat(64)), b"stray").unwrap();
    fs::create_dir(root.join("layers").join("1".repeat(64))).unwrap();
    fs::write(root.join("images/.tmp-1-2-x"), b"{").unwrap();
    fs::create_dir(root.join("layers/.tmp-1-3-y")).unwrap();
    let report = store.gc().unwrap();
    assert_eq!(
        (
            report.blobs_removed,
            report.layers_removed,
            report.temps_removed,
            report.bytes_freed
        ),
        (1, 1, 2, 5)
    );
    assert_eq!(store.get(&a_ref).unwrap(), a);
    assert_eq!(store.get(&b_ref).unwrap(), b);

    // Image A removed (as the node would): its own layers and blobs go, the shared one stays.
    fs::remove_file(root.join("images").join(format!("{}.json", hex_of(&amd64)))).unwrap();
    let report = store.gc().unwrap();
    assert_eq!(report.layers_removed, 2, "{report:?}");
    // A's manifest, index, config and two own layers.
    assert_eq!(report.blobs_removed, 5, "{report:?}");
    assert_eq!(
        report.records_removed, 2,
        "the tag and the index ref: {report:?}"
    );
    assert!(store.get(&a_ref).is_none());
    assert_eq!(store.get(&b_ref).unwrap(), b);
    for l in &layers[1..] {
        assert!(!root.join("layers").join(hex_of(&l.diff_id)).exists());
    }
    let mut left: BTreeMap<String, usize> = BTreeMap::new();
    for d in ["blobs/sha256", "layers", "images", "refs"] {
        left.insert(d.into(), names(&root.join(d)).len());
    }
    // B: manifest, config, two layers; refs holds only its index dir (B was pulled by digest).
    assert_eq!(left["blobs/sha256"], 4);
    assert_eq!(left["layers"], 2);
    assert_eq!(left["images"], 1);
    assert_eq!(left["refs"], 1);
}

#[tokio::test]
async fn gc_stops_at_a_record_it_cannot_read() {
    let reg = Registry::start(None).unwrap();
    let (_, _, layers) = push_app(&reg, "gc/keep", "1");
    let store_dir = tempfile::tempdir().unwrap();
    let root = store_dir.path();
    let store = store_of(&reg, root);
    let reference = format!("{}/gc/keep:1", reg.host());
    let image = store.pull(&reference, None, &no_progress).await.unwrap();
    let stray = root.join("layers").join("2".repeat(64));
    fs::create_dir(&stray).unwrap();
    // A record whose read fails (a directory where a file should be): nothing is removed,
    // neither the garbage nor, above all, anything of an image gc could not see.
    let unreadable = root.join("images").join(format!("{}.json", "3".repeat(64)));
    fs::create_dir(&unreadable).unwrap();
    let r = store.gc();
    assert!(matches!(r, Err(ImageError::Io { .. })), "{r:?}");
    assert!(stray.is_dir());
    assert!(unreadable.is_dir());
    for l in &layers {
        assert!(root.join("layers").join(hex_of(&l.diff_id)).is_dir());
    }
    assert_eq!(store.get(&reference).unwrap(), image);
    // Once it can be read again (here: gone), gc goes on.
    fs::remove_dir(&unreadable).unwrap();
    let report = store.gc().unwrap();
    assert_eq!(report.layers_removed, 1, "{report:?}");
    assert!(!stray.exists());
    assert_eq!(store.get(&reference).unwrap(), image);
}

#[tokio::test]
async fn docker_v2_manifests_and_concurrent_pulls() {
    const LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
    const MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    let reg = Registry::start(None).unwrap();
    let layers = vec![
        Layer::new(
            Tar::new().file("etc/hostname", b"docker\n").done(),
            Compression::Gzip,
        ),
        Layer::new(
            Tar::new().file("etc/.wh.hostname", b"").done(),
            Compression::Gzip,
        ),
    ];
    for l in &layers {
        reg.push_blob("legacy", &l.blob).unwrap();
    }
    let config = config_json(&layers, "amd64");
    let config_digest = reg.push_blob("legacy", &config).unwrap();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": layers.iter().map(|l| json!({
            "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "digest": l.digest(), "size": l.blob.len()
        })).collect::<Vec<_>>()
    }))
    .unwrap();
    let digest = reg
        .push_manifest("legacy", &sha256(&manifest), MANIFEST, &manifest)
        .unwrap();
    let list = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": LIST,
        "manifests": [{"mediaType": MANIFEST, "digest": digest, "size": manifest.len(),
                       "platform": {"architecture": "amd64", "os": "linux"}}]
    }))
    .unwrap();
    reg.push_manifest("legacy", "latest", LIST, &list).unwrap();

    // Two pulls of the same image into one store at once: both complete, one copy of each
    // layer, no temp file left.
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(&reg, dir.path());
    let reference = format!("{}/legacy", reg.host());
    let (a, b) = tokio::join!(
        store.pull(&reference, None, &no_progress),
        store.pull(&reference, None, &no_progress)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a, b);
    assert_eq!(a.digest, digest);
    assert_eq!(a.reference, format!("{}/legacy:latest", reg.host()));
    assert_eq!(names(&dir.path().join("layers")).len(), 2);
    assert!(temps(dir.path()).is_empty(), "{:?}", temps(dir.path()));
    let wh = fs::symlink_metadata(a.layers[1].join("etc/hostname")).unwrap();
    assert!(wh.file_type().is_char_device());
}

#[tokio::test]
async fn plain_http_only_for_listed_registries() {
    let reg = Registry::start(None).unwrap();
    push_app(&reg, "app", "1");
    let dir = tempfile::tempdir().unwrap();
    let reference = format!("{}/app:1", reg.host());
    for insecure in [vec![], vec![format!("127.0.0.1:{}", reg.port() + 1)]] {
        let store = Store::new(dir.path().to_path_buf(), BASE, insecure);
        let r = store.pull(&reference, None, &no_progress).await;
        assert!(
            matches!(&r, Err(ImageError::Network { registry, .. }) if *registry == reg.host()),
            "{r:?}"
        );
    }
    assert_eq!(
        reg.gets("manifests"),
        0,
        "nothing was asked over plain HTTP"
    );
    let store = store_of(&reg, dir.path());
    store.pull(&reference, None, &no_progress).await.unwrap();
    // The same store root with another uid base is refused, not mixed.
    let other = Store::new(dir.path().to_path_buf(), BASE + 1, vec![reg.host()]);
    assert!(matches!(
        other.pull(&reference, None, &no_progress).await,
        Err(ImageError::Io { .. })
    ));
    assert!(other.get(&reference).is_none());
}

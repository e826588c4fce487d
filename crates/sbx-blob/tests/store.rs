//! The store's round trips, against a directory (always) and a real SeaweedFS on loopback (when
//! `weed` is found: $SBX_WEED, PATH, or scripts/seaweedfs.sh's install).

mod common;

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use sbx_blob::testing::{find_weed, Weed};
use sbx_blob::{BlobError, Format, Kind, Store};

/// The size of the big file of a tree.
const BIG: usize = 64 << 20;

/// What a case gets: the store, a scratch directory, the store's directory (file://), and
/// (S3) the keys of the multipart uploads under way.
struct Case<'a> {
    store: Store,
    work: &'a Path,
    local: Option<PathBuf>,
    pending: Option<&'a (dyn Fn() -> Vec<String> + Sync)>,
}

fn dir_store(top: &Path) -> (Store, PathBuf) {
    let root = top.join("store");
    let store = Store::open(&format!("file://{}", root.display())).unwrap();
    (store, root)
}

async fn tree_round_trip(c: &Case<'_>) {
    let src = c.work.join("src");
    make_tree(&src, BIG);
    let put = c.store.put_tree("trees/one.tar.zst", &src).await.unwrap();
    assert!(put.bytes > BIG as u64, "{put:?}");
    assert!(
        put.stored_bytes < put.bytes,
        "half the big file compresses: {put:?}"
    );
    assert_eq!(put.sha256.len(), 64);
    assert_eq!(
        put.entries,
        walk(&src).len() as u64,
        "every entry but none twice"
    );
    assert!(c.store.exists("trees/one.tar.zst").await.unwrap());
    let dest = c.work.join("dest/new");
    let got = c.store.get_tree("trees/one.tar.zst", &dest).await.unwrap();
    assert_eq!(got.bytes, put.bytes);
    assert_eq!(got.stored_bytes, put.stored_bytes);
    assert_eq!(got.sha256, put.sha256);
    assert_eq!(got.entries, put.entries);
    assert_same_tree(&src, &dest);
    // The holes stay holes.
    let a = allocated(&src.join("sparse.img"));
    if a < 8 << 20 {
        let b = allocated(&dest.join("sparse.img"));
        assert!(
            b < 8 << 20,
            "{b} bytes allocated for a file of 1 MiB of data"
        );
    }
    // Into an existing empty directory too.
    let empty = c.work.join("empty-dest");
    std::fs::create_dir(&empty).unwrap();
    c.store.get_tree("trees/one.tar.zst", &empty).await.unwrap();
    assert_same_tree(&src, &empty);
    // The comparison sees a byte, a mode and an attribute changed.
    let differs = |change: &dyn Fn(&Path)| {
        let copy = c.work.join("changed");
        let _ = std::fs::remove_dir_all(&copy);
        let c2 = copy.clone();
        let s = c.store.clone();
        let rt = tokio::runtime::Handle::current();
        tokio::task::block_in_place(|| rt.block_on(s.get_tree("trees/one.tar.zst", &c2))).unwrap();
        change(&copy);
        let same = std::panic::catch_unwind(|| assert_same_tree(&src, &copy)).is_ok();
        std::fs::remove_dir_all(&copy).unwrap();
        !same
    };
    assert!(differs(&|d: &Path| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join("big.bin"))
            .unwrap();
        f.write_all_at(b"!", 12_345).unwrap();
        let t = filetime::FileTime::from_unix_time(1_600_000_000, 0);
        filetime::set_file_times(d.join("big.bin"), t, t).unwrap();
    }));
    assert!(differs(&|d: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.join("run.sh"), std::fs::Permissions::from_mode(0o700)).unwrap();
    }));
    assert!(differs(&|d: &Path| {
        rustix::fs::lsetxattr(
            d.join("etc/app/config.toml"),
            "user.sbx.note",
            b"other",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
    }));
}

async fn wrong_sources_and_destinations(c: &Case<'_>) {
    let src = c.work.join("small");
    std::fs::create_dir_all(src.join("d")).unwrap();
    std::fs::write(src.join("d/f"), b"x").unwrap();
    c.store.put_tree("w/small", &src).await.unwrap();
    // A destination with something in it, or a file.
    let full = c.work.join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep"), b"mine").unwrap();
    let e = c.store.get_tree("w/small", &full).await.unwrap_err();
    assert!(matches!(e, BlobError::DestinationInUse { .. }), "{e}");
    assert_eq!(std::fs::read(full.join("keep")).unwrap(), b"mine");
    let e = c
        .store
        .get_tree("w/small", &full.join("keep"))
        .await
        .unwrap_err();
    assert!(matches!(e, BlobError::DestinationInUse { .. }), "{e}");
    // A key with nothing: NotFound, and the destination not left made.
    let dest = c.work.join("never");
    let e = c.store.get_tree("w/nothing-here", &dest).await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(!dest.exists(), "a failed download left its destination");
    let e = c
        .store
        .get_file("w/nothing-here", &c.work.join("never-file"))
        .await
        .unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(!c.work.join("never-file").exists());
    // Sources that are not directories; keys that are not keys.
    let e = c.store.put_tree("w/x", &src.join("d/f")).await.unwrap_err();
    assert!(matches!(e, BlobError::NotADirectory { .. }), "{e}");
    let e = c
        .store
        .put_tree("w/x", &c.work.join("missing"))
        .await
        .unwrap_err();
    assert!(matches!(e, BlobError::Io { .. }), "{e}");
    assert!(!c.store.exists("w/x").await.unwrap());
    for key in ["", "a//b", "../x", "a/./b"] {
        let e = c.store.put_tree(key, &src).await.unwrap_err();
        assert!(matches!(e, BlobError::BadName { .. }), "{key:?}: {e}");
    }
    // A tree object read as a file is what it is: its bytes, here a tar stream.
    let tar = c.work.join("small.tar");
    c.store.get_file("w/small", &tar).await.unwrap();
    let mut names = Vec::new();
    for e in tar::Archive::new(std::fs::File::open(&tar).unwrap())
        .entries()
        .unwrap()
    {
        names.push(e.unwrap().path().unwrap().display().to_string());
    }
    assert_eq!(names, [".", "d", "d/f"]);
}

async fn epochs_and_manifests(c: &Case<'_>) {
    let s = &c.store;
    let id = "sbx-0123456789abcdef";
    assert_eq!(s.epochs(id).await.unwrap(), Vec::<u64>::new());
    assert_eq!(s.latest(id).await.unwrap(), None);
    let e = s.manifest(id, 9).await.unwrap_err();
    assert!(e.is_not_found(), "{e}");

    let images = c.work.join("images");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::write(images.join("pages-1.img"), noise(1, 3 << 20)).unwrap();
    std::fs::write(images.join("inventory.img"), b"inv").unwrap();
    let disk = c.work.join("disk.img");
    {
        let f = std::fs::File::create(&disk).unwrap();
        f.set_len(32 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"superblock", 65536).unwrap();
    }

    // Epoch 1, whole.
    let mut w = s.epoch_writer(id, 1).await.unwrap();
    let mem = w.put_tree("memory", &images).await.unwrap();
    let dsk = w.put_file("disk", &disk).await.unwrap();
    assert_eq!(dsk.bytes, 32 << 20);
    assert!(dsk.stored_bytes < 1 << 20, "zeros compress: {dsk:?}");
    let m1 = w
        .finish("build-a", "img-debian", Kind::Sleep)
        .await
        .unwrap();
    assert_eq!(m1.parts.len(), 2);
    assert_eq!(m1.part("memory").unwrap().format, Format::Tar);
    assert_eq!(m1.part("memory").unwrap().stored_bytes, mem.stored_bytes);
    assert_eq!(
        m1.part("disk").unwrap().sha256.as_deref(),
        Some(dsk.sha256.as_str())
    );
    assert!(m1.written_at.ends_with('Z'), "{}", m1.written_at);
    assert!(s
        .exists(&format!("sandboxes/{id}/e1/memory.tar.zst"))
        .await
        .unwrap());
    assert!(s
        .exists(&format!("sandboxes/{id}/e1/disk.zst"))
        .await
        .unwrap());
    assert_eq!(s.manifest(id, 1).await.unwrap(), m1);
    assert_eq!(s.latest(id).await.unwrap(), Some(m1.clone()));
    // An epoch is written once.
    let e = s.epoch_writer(id, 1).await.unwrap_err();
    assert!(matches!(e, BlobError::EpochWritten { epoch: 1, .. }), "{e}");

    // Epoch 2: parts, then the writer dropped: no manifest, so not the latest.
    {
        let mut w = s.epoch_writer(id, 2).await.unwrap();
        w.put_tree("memory", &images).await.unwrap();
        let e = w.put_tree("memory", &images).await.unwrap_err();
        assert!(matches!(e, BlobError::BadName { .. }), "{e}");
    }
    assert_eq!(s.epochs(id).await.unwrap(), vec![1, 2]);
    assert_eq!(s.latest(id).await.unwrap(), Some(m1.clone()));
    assert!(s.manifest(id, 2).await.unwrap_err().is_not_found());

    // Epoch 10 (sorted as a number, not as text), a snapshot.
    let mut w = s.epoch_writer(id, 10).await.unwrap();
    w.put_tree("memory", &images).await.unwrap();
    let m10 = w
        .finish("build-a", "img-debian", Kind::Snapshot)
        .await
        .unwrap();
    assert_eq!(s.epochs(id).await.unwrap(), vec![1, 2, 10]);
    assert_eq!(s.latest(id).await.unwrap(), Some(m10.clone()));

    // The parts come back checked.
    let back = c.work.join("back");
    let st = s.get_part_tree(&m1, "memory", &back).await.unwrap();
    assert_eq!(st.sha256, mem.sha256);
    assert_same_tree(&images, &back);
    let disk_back = c.work.join("disk-back.img");
    s.get_part_file(&m1, "disk", &disk_back).await.unwrap();
    assert_eq!(
        std::fs::read(&disk_back).unwrap(),
        std::fs::read(&disk).unwrap()
    );
    assert!(
        allocated(&disk_back) < 4 << 20,
        "the disk image came back sparse"
    );
    let (bytes, _) = s.get_part_writer(&m1, "disk", Vec::new()).await.unwrap();
    assert_eq!(bytes.len(), 32 << 20);
    let e = s
        .get_part_tree(&m1, "nope", &c.work.join("nope"))
        .await
        .unwrap_err();
    assert!(matches!(e, BlobError::NoSuchPart { .. }), "{e}");

    // Deletes: e1's leaves e10 (a folder, not a prefix of text); the latest goes back to the
    // highest whole epoch, and there is none when only a partial one is left.
    s.delete_epoch(id, 1).await.unwrap();
    assert_eq!(s.epochs(id).await.unwrap(), vec![2, 10]);
    assert_eq!(s.latest(id).await.unwrap(), Some(m10.clone()));
    assert!(s.manifest(id, 1).await.unwrap_err().is_not_found());
    s.delete_epoch(id, 10).await.unwrap();
    assert_eq!(s.epochs(id).await.unwrap(), vec![2]);
    assert_eq!(s.latest(id).await.unwrap(), None);
    // Deleting what is gone is no error.
    s.delete_epoch(id, 10).await.unwrap();
    // Another sandbox's epochs are its own.
    let other = "sbx-other";
    let mut w = s.epoch_writer(other, 1).await.unwrap();
    w.put_reader("stream", io::Cursor::new(b"btrfs send".to_vec()))
        .await
        .unwrap();
    let mo = w.finish("b", "i", Kind::Sleep).await.unwrap();
    assert_eq!(mo.part("stream").unwrap().format, Format::Raw);
    s.delete_sandbox(id).await.unwrap();
    assert_eq!(s.epochs(id).await.unwrap(), Vec::<u64>::new());
    assert_eq!(s.latest(id).await.unwrap(), None);
    assert_eq!(s.latest(other).await.unwrap(), Some(mo));
    s.delete_sandbox(other).await.unwrap();
    if let Some(local) = &c.local {
        let left: Vec<_> = files_under(local)
            .into_iter()
            .filter(|p| p.starts_with("sandboxes"))
            .collect();
        assert!(left.is_empty(), "deleted sandboxes left {left:?}");
    }
}

async fn damaged_parts_are_refused(c: &Case<'_>) {
    let s = &c.store;
    let id = "sbx-damaged";
    let src = c.work.join("dmg-src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a"), noise(3, 100_000)).unwrap();
    let mut w = s.epoch_writer(id, 1).await.unwrap();
    w.put_tree("memory", &src).await.unwrap();
    let m = w.finish("b", "i", Kind::Sleep).await.unwrap();
    // Another object put in its place (valid zstd and tar, not what the manifest says).
    let other = c.work.join("dmg-other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("a"), noise(4, 100_000)).unwrap();
    let key = sbx_blob::part_key(id, 1, "memory", Format::Tar).unwrap();
    s.put_tree(&key, &other).await.unwrap();
    let dest = c.work.join("dmg-dest");
    let e = s.get_part_tree(&m, "memory", &dest).await.unwrap_err();
    assert!(matches!(e, BlobError::Corrupt { .. }), "{e}");
    assert!(!dest.exists(), "a refused part left its files");
    // zstd of something that is not a tar stream.
    let raw_key = "damaged/not-tar";
    s.put_reader(
        raw_key,
        io::Cursor::new(b"garbage, not a tar stream".repeat(40)),
    )
    .await
    .unwrap();
    let e = s.get_tree(raw_key, &dest).await.unwrap_err();
    assert!(matches!(e, BlobError::Corrupt { .. }), "{e}");
    assert!(!dest.exists());
    // Not zstd at all (written past the store, in its directory).
    if let Some(local) = &c.local {
        std::fs::write(local.join(raw_key), b"not zstd, not anything").unwrap();
        let e = s.get_tree(raw_key, &dest).await.unwrap_err();
        assert!(matches!(e, BlobError::Corrupt { .. }), "{e}");
        assert!(!dest.exists());
        let e = s.get_writer(raw_key, Vec::new()).await.unwrap_err();
        assert!(matches!(e, BlobError::Corrupt { .. }), "{e}");
    }
    s.delete(raw_key).await.unwrap();
    s.delete_sandbox(id).await.unwrap();
}

/// A reader that gives noise up to `fail_at` bytes, then fails (or never ends: `None`).
struct Source {
    given: usize,
    fail_at: Option<usize>,
    block: Vec<u8>,
}

impl Source {
    fn new(fail_at: Option<usize>) -> Self {
        Source {
            given: 0,
            fail_at,
            block: noise(11, 1 << 16),
        }
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.fail_at.is_some_and(|f| self.given >= f) {
            return Err(io::Error::other("the source broke"));
        }
        let n = buf.len().min(self.block.len());
        buf[..n].copy_from_slice(&self.block[..n]);
        // Not the same block twice in a row (zstd would make nothing of it).
        self.block.rotate_left(7);
        self.given += n;
        Ok(n)
    }
}

/// No object at `key`, and (a directory's store) no file of it, within a few seconds.
async fn assert_nothing_left(c: &Case<'_>, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let exists = c.store.exists(key).await.unwrap();
        let staged: Vec<PathBuf> = match &c.local {
            Some(local) => files_under(local)
                .into_iter()
                .filter(|p| p.display().to_string().starts_with(key))
                .collect(),
            None => Vec::new(),
        };
        let pending: Vec<String> = match c.pending {
            Some(list) => list().into_iter().filter(|k| k.ends_with(key)).collect(),
            None => Vec::new(),
        };
        if !exists && staged.is_empty() && pending.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key}: an upload that did not finish left: object {exists}, files {staged:?}, \
             multipart uploads {pending:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn failed_and_dropped_uploads_leave_nothing(c: &Case<'_>) {
    // A source that fails after 20 MiB (parts already sent): the upload is aborted.
    let e = c
        .store
        .put_reader("cut/failed", Source::new(Some(20 << 20)))
        .await
        .unwrap_err();
    assert!(matches!(e, BlobError::Io { .. }), "{e}");
    assert!(e.to_string().contains("the source broke"), "{e}");
    assert_nothing_left(c, "cut/failed").await;
    // An upload whose future is dropped midway (a cancelled task).
    let res = tokio::time::timeout(
        Duration::from_millis(1500),
        c.store.put_reader("cut/dropped", Source::new(None)),
    )
    .await;
    assert!(res.is_err(), "an endless upload ended: {res:?}");
    assert_nothing_left(c, "cut/dropped").await;
    // An epoch whose part fails: no manifest.
    let id = "sbx-cut";
    let mut w = c.store.epoch_writer(id, 1).await.unwrap();
    assert!(w
        .put_reader("memory", Source::new(Some(1 << 20)))
        .await
        .is_err());
    drop(w);
    assert_eq!(c.store.latest(id).await.unwrap(), None);
    c.store.delete_sandbox(id).await.unwrap();
}

async fn streams_round_trip(c: &Case<'_>) {
    let data = noise(5, 9 << 20);
    let put = c
        .store
        .put_reader("streams/a", io::Cursor::new(data.clone()))
        .await
        .unwrap();
    assert_eq!(put.bytes, data.len() as u64);
    let (back, got) = c.store.get_writer("streams/a", Vec::new()).await.unwrap();
    assert!(back == data, "the stream changed");
    assert_eq!(got.sha256, put.sha256);
    // An empty stream is an object too.
    c.store
        .put_reader("streams/empty", io::empty())
        .await
        .unwrap();
    let (back, _) = c
        .store
        .get_writer("streams/empty", Vec::new())
        .await
        .unwrap();
    assert!(back.is_empty());
    // A file that exists is not overwritten.
    let dest = c.work.join("taken");
    std::fs::write(&dest, b"mine").unwrap();
    let e = c.store.get_file("streams/a", &dest).await.unwrap_err();
    assert!(matches!(e, BlobError::DestinationInUse { .. }), "{e}");
    assert_eq!(std::fs::read(&dest).unwrap(), b"mine");
    c.store.delete("streams/a").await.unwrap();
    c.store.delete("streams/a").await.unwrap();
    assert!(!c.store.exists("streams/a").await.unwrap());
}

async fn all_cases(c: &Case<'_>) {
    tree_round_trip(c).await;
    wrong_sources_and_destinations(c).await;
    epochs_and_manifests(c).await;
    damaged_parts_are_refused(c).await;
    failed_and_dropped_uploads_leave_nothing(c).await;
    streams_round_trip(c).await;
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

macro_rules! dir_case {
    ($name:ident) => {
        #[test]
        fn $name() {
            let top = tempfile::tempdir().unwrap();
            let (store, local) = dir_store(top.path());
            let work = top.path().join("work");
            std::fs::create_dir(&work).unwrap();
            let c = Case {
                store,
                work: &work,
                local: Some(local),
                pending: None,
            };
            runtime().block_on(super::$name(&c));
        }
    };
}

mod dir {
    use super::*;
    dir_case!(tree_round_trip);
    dir_case!(wrong_sources_and_destinations);
    dir_case!(epochs_and_manifests);
    dir_case!(damaged_parts_are_refused);
    dir_case!(failed_and_dropped_uploads_leave_nothing);
    dir_case!(streams_round_trip);
}

/// Every case against SeaweedFS's S3 (one server for them all, a bucket and a prefix).
#[test]
fn s3_seaweedfs() {
    let Some(bin) = find_weed() else {
        eprintln!(
            "SKIPPED s3_seaweedfs: no `weed` ($SBX_WEED, PATH, /opt/sbx-seaweedfs): \
             install it with scripts/seaweedfs.sh"
        );
        return;
    };
    let weed = Weed::start(&bin);
    weed.make_bucket("sbx-test");
    let store =
        Store::open_with_env("s3://sbx-test/fleet/one", weed.env()).expect("the S3 store opens");
    assert!(store.describe().contains("s3://sbx-test/fleet/one"));
    assert!(!store.describe().contains("sbx-test-secret-key"));
    let work = tempfile::tempdir().unwrap();
    let pending = || -> Vec<String> {
        let text = weed.http_text("GET", "/sbx-test?uploads").unwrap();
        text.split("<Key>")
            .skip(1)
            .filter_map(|s| s.split_once("</Key>").map(|(k, _)| k.to_string()))
            .collect()
    };
    let c = Case {
        store,
        work: work.path(),
        local: None,
        pending: Some(&pending),
    };
    runtime().block_on(all_cases(&c));
    assert_eq!(pending(), Vec::<String>::new(), "multipart uploads left");
    // The objects are under the prefix, and nothing else is in the bucket.
    let listing = weed.http_text("GET", "/sbx-test?list-type=2").unwrap();
    assert!(
        listing.contains("<Key>fleet/one/trees/one.tar.zst</Key>"),
        "{listing}"
    );
    assert!(!listing.contains("<Key>sandboxes"), "{listing}");
}

#[test]
fn store_urls_are_checked() {
    for url in [
        "/var/lib/sbx/store",
        "file://relative/path",
        "http://127.0.0.1:8333/b",
        "s3://",
        "s3://bucket/a//b",
        "s3://key:secret@bucket/p",
        "file:///tmp/x?y=1",
        "gs://bucket",
    ] {
        let e = Store::open_with_env(url, Vec::<(String, String)>::new()).unwrap_err();
        assert!(matches!(e, BlobError::BadUrl { .. }), "{url}: {e}");
        assert!(e.to_string().contains("s3://bucket[/prefix]"), "{e}");
    }
    let e = Store::open_with_env(
        "s3://b/p",
        [
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
            ("AWS_ACCESS_KEY_ID", "k"),
        ],
    )
    .unwrap_err();
    assert!(e.to_string().contains("AWS_ALLOW_HTTP"), "{e}");
    let s = Store::open_with_env(
        "s3://b/p",
        [
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
            ("AWS_SECRET_ACCESS_KEY", "very-secret"),
            ("AWS_REGION", "eu-west-3"),
        ],
    )
    .unwrap();
    assert_eq!(
        s.describe(),
        "s3://b/p (endpoint http://127.0.0.1:1, region eu-west-3)"
    );
    let top = tempfile::tempdir().unwrap();
    let made = top.path().join("a/b");
    let s = Store::open(&format!("file://{}", made.display())).unwrap();
    assert!(made.is_dir(), "the store's directory is made");
    assert_eq!(s.describe(), format!("file://{}", made.display()));
}

//! Volumes (`/v1/volumes`, `volumes` of a create and a run): a volume's files outlive its
//! sandboxes and the node, a shared one is mounted by two sandboxes at once, read_only
//! refuses writes, `copy` gives a new volume what the image has at its path (owners, modes,
//! times, xattrs, a symlink, a hard link), and every refusal of the seed from a real request.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use crate::common::{
    self, assert_error, assert_refused, create_with, exec_req, get_json, run_req, TestNode,
};
use sbx_api::{
    ExecObject, RunRequest, SandboxStatus, SandboxVolume, VolumeCreate, VolumeMount, VolumeObject,
};
use sbx_client::Client;
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(20);

/// A volume named `name`, shared or not, of the node's default size.
fn volume(name: &str, shared: bool) -> VolumeCreate {
    VolumeCreate {
        name: Some(name.into()),
        size_bytes: None,
        shared,
    }
}

fn create_volume(c: &Client, v: &VolumeCreate) -> VolumeObject {
    let v = c
        .create_volume(v)
        .unwrap_or_else(|e| panic!("create volume {v:?}: {e}"));
    assert_eq!(v.object, "volume", "{v:?}");
    assert!(common::is_id("vol", &v.id), "{v:?}");
    v
}

/// The volume `volume` mounted at `path`.
fn mount(path: &str, volume: &str) -> VolumeMount {
    VolumeMount {
        path: path.into(),
        volume: volume.into(),
        read_only: false,
        copy: false,
        version: None,
    }
}

/// A shell line run in the sandbox to its end (`POST …/run`).
fn sh(c: &Client, id: &str, command: &str) -> ExecObject {
    c.exec_run(id, &exec_req(command))
        .unwrap_or_else(|e| panic!("{command}: {e}"))
}

/// A run of `command` with the volumes `volumes`.
fn run_with(command: &str, volumes: Vec<VolumeMount>) -> RunRequest {
    RunRequest {
        volumes,
        ..run_req(command)
    }
}

/// A kept sandbox with the volumes `volumes` (and the image `image`): its id once it is up.
fn sandbox_with(c: &Client, image: Option<&str>, volumes: Vec<VolumeMount>) -> String {
    let v = c
        .create_sandbox(&create_with(|s| {
            s.image = image.map(str::to_string);
            s.volumes = volumes;
        }))
        .expect("create");
    let v = c
        .wait_started(&v.id, Duration::from_millis(100), |waited| {
            assert!(waited < Duration::from_secs(60), "still starting");
        })
        .expect("wait for its start");
    assert_eq!(v.status, SandboxStatus::Running, "{v:?}");
    v.id.clone()
}

/// The volume's directory on the host.
fn volume_dir(node: &TestNode, id: &str) -> PathBuf {
    node.data_dir.join("disk/volumes").join(id)
}

#[test]
fn a_volume_outlives_its_sandboxes_and_the_node() {
    let mut node = TestNode::start();
    let c = node.client();
    let vol = create_volume(
        &c,
        &VolumeCreate {
            size_bytes: Some(64 << 20),
            ..volume("keep", false)
        },
    );
    let vid = vol.id.clone();
    assert_eq!(vol.size_bytes, 64 << 20);
    assert!(!vol.shared);
    assert!(vol.sandboxes.is_empty());
    // Owned by the sandboxes' root.
    assert_eq!(
        fs::metadata(volume_dir(&node, &vid)).unwrap().uid(),
        100_000
    );

    // A run writes, by name.
    let v = c
        .run(&run_with(
            "id -u; stat -c %u /data; echo first > /data/a",
            vec![mount("/data", "keep")],
        ))
        .expect("a run");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    assert_eq!(v.stdout, "0\n0\n", "{v:?}");

    // A kept sandbox reads it (by id), writes more, is deleted.
    let sb = c
        .create_sandbox(&create_with(|s| s.volumes = vec![mount("/srv/v", &vid)]))
        .expect("create");
    let sid = sb.id.clone();
    assert_eq!(
        sb.volumes,
        [SandboxVolume {
            volume: vid.clone(),
            path: "/srv/v".into(),
            read_only: false
        }]
    );
    let v = c.volume(&vid).expect("the volume");
    assert_eq!(v.sandboxes, std::slice::from_ref(&sid), "{v:?}");
    let v = sh(&c, &sid, "cat /srv/v/a; echo second > /srv/v/b");
    assert_eq!(v.stdout, "first\n", "{v:?}");
    c.delete_sandbox(&sid).expect("delete");
    let v = c.volumes().expect("the volumes");
    assert_eq!(v.data[0].id, vid, "{v:?}");
    assert!(v.data[0].sandboxes.is_empty(), "{v:?}");

    // The node restarts: the volume and its files are there.
    node.stop();
    node.restart();
    let c = node.client();
    assert_eq!(c.volume("keep").expect("the volume").id, vid);
    let v = c
        .run(&run_with("cat /data/a /data/b", vec![mount("/data", &vid)]))
        .expect("a run");
    assert_eq!(v.stdout, "first\nsecond\n", "{v:?}");
    // (used_bytes: a number, typed.)
    c.volume("keep").expect("the volume");

    // Deleted: 204 (the wire's: sent as it is), its files gone, then 404.
    let r = node.delete(&format!("/v1/volumes/{vid}"), &[]);
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(!volume_dir(&node, &vid).exists());
    assert_refused(c.volume("keep"), 404, "volume_not_found", None);
    node.assert_clean(CLEAN);
}

#[test]
fn a_shared_volume_is_mounted_by_two_and_read_only_refuses_writes() {
    let node = TestNode::start();
    let c = node.client();
    create_volume(&c, &volume("common", true));
    create_volume(&c, &volume("mine", false));
    let a = sandbox_with(
        &c,
        None,
        vec![mount("/shared", "common"), mount("/mine", "mine")],
    );
    let b = sandbox_with(
        &c,
        None,
        vec![VolumeMount {
            read_only: true,
            ..mount("/shared", "common")
        }],
    );
    // What one writes the other reads at once; the read-only one cannot write.
    sh(&c, &a, "echo from-a > /shared/note");
    let v = sh(
        &c,
        &b,
        "cat /shared/note; echo x > /shared/other; echo rc=$?",
    );
    assert_eq!(v.stdout, "from-a\nrc=2\n", "{v:?}");
    assert!(v.stderr.contains("Read-only file system"), "{v:?}");
    // Nor by remounting it: the sandbox's root has no CAP_SYS_ADMIN.
    let v = sh(
        &c,
        &b,
        "mount -o remount,rw /shared; touch /shared/x; echo rc=$?",
    );
    assert!(v.stdout.ends_with("rc=1\n"), "{v:?}");
    let v = c.volume("common").expect("the volume");
    let mut users = v.sandboxes.clone();
    users.sort();
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    assert_eq!(users, want, "{v:?}");

    // The exclusive one is a's: another sandbox, or a run, is refused; so is its delete.
    assert_refused(
        c.create_sandbox(&create_with(|s| s.volumes = vec![mount("/m", "mine")])),
        409,
        "volume_in_use",
        Some("volumes[0].volume"),
    );
    assert_refused(
        c.run(&run_with("true", vec![mount("/m", "mine")])),
        409,
        "volume_in_use",
        Some("volumes[0].volume"),
    );
    assert_refused(c.delete_volume("mine"), 409, "volume_in_use", None);
    assert_refused(c.delete_volume("common"), 409, "volume_in_use", None);
    // Once a is gone, mine is free again.
    c.delete_sandbox(&a).expect("delete");
    let v = c
        .run(&run_with("ls /m", vec![mount("/m", "mine")]))
        .expect("a run");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    c.delete_sandbox(&b).expect("delete");
    for n in ["mine", "common"] {
        c.delete_volume(n)
            .unwrap_or_else(|e| panic!("delete {n}: {e}"));
    }
    node.assert_clean(CLEAN);
}

#[test]
fn every_refusal_of_volumes_comes_from_a_real_request() {
    let node = TestNode::start();
    // POST /v1/volumes.
    for (body, status, code, param) in [
        (
            json!({"name": "Bad_Name"}),
            400,
            "invalid_name",
            Some("name"),
        ),
        (json!({"name": "vol-x"}), 400, "invalid_name", Some("name")),
        (
            json!({"size_bytes": 10}),
            400,
            "invalid_field",
            Some("size_bytes"),
        ),
        (
            json!({"size_bytes": 1u64 << 50}),
            400,
            "invalid_field",
            Some("size_bytes"),
        ),
        (json!({"shared": 1}), 400, "invalid_field", Some("shared")),
        (json!({"mode": "rw"}), 400, "unknown_field", Some("mode")),
    ] {
        let r = node.post_json("/v1/volumes", &body);
        assert_error(r.status, &r.json(), status, code, param);
    }
    let r = node.post("/v1/volumes", &[], b"[1]");
    assert_error(r.status, &r.json(), 400, "invalid_json", None);
    let c = node.client();
    create_volume(&c, &volume("one", false));
    let two = create_volume(&c, &volume("two", false)).id;
    let r = node.post_json("/v1/volumes", &json!({"name": "one"}));
    assert_error(r.status, &r.json(), 409, "name_taken", Some("name"));
    let (status, v) = get_json(&node, "/v1/volumes/nope");
    assert_error(status, &v, 404, "volume_not_found", None);
    let r = node.delete("/v1/volumes/nope", &[]);
    assert_error(r.status, &r.json(), 404, "volume_not_found", None);

    // volumes of a create and of a run, in the seed's order.
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (
            json!([{"path": "/", "volume": "one"}]),
            400,
            "invalid_path",
            "volumes[0].path",
        ),
        (
            json!([{"path": "data", "volume": "one"}]),
            400,
            "invalid_path",
            "volumes[0].path",
        ),
        (
            json!([{"path": "/a", "volume": "one"}, {"path": "/b", "volume": "one"}]),
            409,
            "duplicate_volume",
            "volumes[1].volume",
        ),
        // By name once and by id once: still one volume.
        (
            json!([{"path": "/a", "volume": "two"}, {"path": "/b", "volume": two}]),
            409,
            "duplicate_volume",
            "volumes[1].volume",
        ),
        (
            json!([{"path": "/a", "volume": "one"}, {"path": "/a", "volume": "two"}]),
            409,
            "mount_path_taken",
            "volumes[1].path",
        ),
        (
            json!([{"path": "/a", "volume": "missing"}]),
            404,
            "volume_not_found",
            "volumes[0].volume",
        ),
    ];
    for (vols, status, code, param) in &cases {
        let r = node.post_json("/v1/sandboxes", &json!({ "volumes": vols }));
        assert_error(r.status, &r.json(), *status, code, Some(param));
        let (s, v) = node.run(&json!({ "command": "true", "volumes": vols }));
        assert_error(s, &v, *status, code, Some(param));
    }
    // Nine that are not shared: too many.
    let mut nine = Vec::new();
    for i in 0..9 {
        let id = create_volume(&c, &VolumeCreate::default()).id;
        nine.push(json!({"path": format!("/v{i}"), "volume": id}));
    }
    let r = node.post_json("/v1/sandboxes", &json!({ "volumes": nine }));
    assert_error(
        r.status,
        &r.json(),
        409,
        "too_many_volumes",
        Some("volumes"),
    );
    // Eight are fine.
    let eight: Vec<Value> = nine[..8].to_vec();
    let v = node.run_ok(&json!({"command": "ls -d /v0 /v7", "volumes": eight}));
    assert_eq!(v["exit_code"], 0, "{v}");
    // A kept sandbox's volume is in use for the next.
    let a = node.create_sandbox(&json!({"volumes": [{"path": "/a", "volume": "one"}]}));
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({"volumes": [{"path": "/x", "volume": "one"}]}),
    );
    assert_error(
        r.status,
        &r.json(),
        409,
        "volume_in_use",
        Some("volumes[0].volume"),
    );
    // No snapshot or fork of it (a copy would mount its volumes again).
    let r = node.post_json(
        &format!("/v1/sandboxes/{}/snapshots", a["id"].as_str().unwrap()),
        &json!({}),
    );
    assert_error(r.status, &r.json(), 503, "not_served_here", Some("volumes"));
    node.delete_sandbox(a["id"].as_str().unwrap());
    node.assert_clean(CLEAN);
}

/// One PAX extended header entry (`SCHILY.xattr.NAME=value`) for the entry that follows.
fn pax_xattr(name: &str, value: &str) -> Vec<u8> {
    let body = format!(" SCHILY.xattr.{name}={value}\n");
    // The record's length counts its own digits.
    let mut n = body.len() + 1;
    while format!("{n}{body}").len() != n {
        n += 1;
    }
    format!("{n}{body}").into_bytes()
}

/// An image whose /srv/db has odd owners and modes, a file with an xattr, a hard link to it,
/// a symlink and a setgid directory (on the probe image's /bin/sh).
fn push_odd_image(reg: &sbx_testreg::Registry, repo: &str, nonce: &str) -> String {
    use sbx_testreg::{Compression, Layer, Tar};
    let mut t = Tar::new();
    t.add(tar::EntryType::Directory, "srv", 0o755, (0, 0), b"");
    t.add(tar::EntryType::Directory, "srv/db", 0o750, (999, 998), b"");
    t.add(
        tar::EntryType::XHeader,
        "srv/db/PaxHeaders/conf",
        0o644,
        (0, 0),
        &pax_xattr("user.sbx", "kept"),
    );
    t.add(
        tar::EntryType::Regular,
        "srv/db/conf",
        0o640,
        (1234, 5678),
        nonce.as_bytes(),
    );
    t.add(
        tar::EntryType::Directory,
        "srv/db/sub",
        0o2770,
        (999, 998),
        b"",
    );
    t.link(tar::EntryType::Link, "srv/db/sub/hard", "srv/db/conf");
    t.link(tar::EntryType::Symlink, "srv/db/link", "conf");
    t.add(
        tar::EntryType::Regular,
        "srv/db/sub/run.sh",
        0o4755,
        (0, 0),
        b"#!/bin/sh\n",
    );
    let layers = [
        Layer::new(crate::images::layer_one(), Compression::None),
        Layer::new(t.done(), Compression::Gzip),
    ];
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Env": ["PATH=/bin"], "Labels": { "nonce": nonce } },
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
        },
    });
    let config = serde_json::to_vec(&config).unwrap();
    reg.push_image(repo, Some("v1"), &layers, &config)
        .unwrap()
        .0
}

/// (relative path, uid, gid, mode, mtime, inode, links, symlink target, user.sbx xattr) of
/// every entry under `root`, sorted.
type Entry = (
    String,
    u32,
    u32,
    u32,
    i64,
    u64,
    u64,
    Option<String>,
    Option<Vec<u8>>,
);

fn entries(root: &std::path::Path) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        let target = m
            .file_type()
            .is_symlink()
            .then(|| fs::read_link(&p).unwrap().display().to_string());
        let xattr = if m.file_type().is_symlink() {
            None
        } else {
            xattr::get(&p, "user.sbx").unwrap()
        };
        out.push((
            rel,
            m.uid(),
            m.gid(),
            m.mode(),
            m.mtime(),
            m.ino(),
            m.nlink(),
            target,
            xattr,
        ));
    }
    out.sort();
    out
}

#[test]
fn copy_gives_a_new_volume_what_the_image_has_there() {
    let reg = sbx_testreg::Registry::start(None).unwrap();
    let nonce = common::unique("odd");
    let digest = push_odd_image(&reg, "sbx/odd", &nonce);
    let node = TestNode::start_with(&["--insecure-registry", &reg.host(), "--warm-pool", "0"]);
    let image = format!("{}/sbx/odd@{digest}", reg.host());
    let c = node.client();
    let vid = create_volume(&c, &volume("db", false)).id;
    let copied = || {
        vec![VolumeMount {
            copy: true,
            ..mount("/srv/db", "db")
        }]
    };
    let sid = sandbox_with(&c, Some(&image), copied());

    // What the image holds (the node's unpacked layer: owners shifted by the uid base) and
    // what the volume holds now are the same, entry by entry; the hard link is one file.
    let vol = entries(&volume_dir(&node, &vid));
    let shift = 100_000;
    let by = |p: &str| {
        vol.iter()
            .find(|e| e.0 == p)
            .unwrap_or_else(|| panic!("{p} not in the volume: {vol:?}"))
            .clone()
    };
    let root = by("");
    assert_eq!(
        (root.1, root.2, root.3 & 0o7777),
        (shift + 999, shift + 998, 0o750),
        "{root:?}"
    );
    let conf = by("conf");
    assert_eq!(
        (conf.1, conf.2, conf.3 & 0o7777, conf.4),
        (shift + 1234, shift + 5678, 0o640, 1_700_000_000),
        "{conf:?}"
    );
    assert_eq!(conf.8.as_deref(), Some(&b"kept"[..]), "{conf:?}");
    assert_eq!(
        fs::read(volume_dir(&node, &vid).join("conf")).unwrap(),
        nonce.as_bytes()
    );
    let hard = by("sub/hard");
    assert_eq!(
        (hard.5, hard.6),
        (conf.5, 2),
        "the hard link is the same file: {hard:?}"
    );
    let link = by("link");
    assert_eq!(link.7.as_deref(), Some("conf"), "{link:?}");
    let sub = by("sub");
    assert_eq!((sub.1, sub.3 & 0o7777), (shift + 999, 0o2770), "{sub:?}");
    let run = by("sub/run.sh");
    assert_eq!((run.1, run.3 & 0o7777), (shift, 0o4755), "{run:?}");
    assert_eq!(vol.len(), 6, "nothing else (no lost+found): {vol:?}");
    // Inside, the sandbox sees the image's owners.
    let v = sh(&c, &sid, "cd /srv/db && echo *; read l < conf; echo $l");
    assert_eq!(v.stdout, format!("conf link sub\n{nonce}\n"), "{v:?}");
    c.delete_sandbox(&sid).expect("delete");

    // A volume that holds something is mounted as it is: no copy over it.
    fs::write(volume_dir(&node, &vid).join("conf"), b"changed").unwrap();
    fs::remove_file(volume_dir(&node, &vid).join("link")).unwrap();
    let sid = sandbox_with(&c, Some(&image), copied());
    let v = sh(&c, &sid, "cd /srv/db && echo *; read l < conf; echo $l");
    assert_eq!(v.stdout, "conf sub\nchanged\n", "{v:?}");
    c.delete_sandbox(&sid).expect("delete");
    node.assert_clean(CLEAN);
}

#[test]
fn a_sandbox_with_volumes_sleeps_and_wakes_with_them() {
    let node = TestNode::start();
    let c = node.client();
    let info = c.node_info().expect("the node");
    if info.other["checkpoints"]["available"] != true {
        eprintln!(
            "skipped: the node takes no checkpoints: {}",
            info.other["checkpoints"]
        );
        return;
    }
    create_volume(&c, &volume("rw", false));
    create_volume(&c, &volume("ro", true));
    let id = sandbox_with(
        &c,
        None,
        vec![
            mount("/data", "rw"),
            VolumeMount {
                read_only: true,
                ..mount("/ref", "ro")
            },
        ],
    );
    // A process holds a file of the volume open across the sleep.
    sh(&c, &id, "echo before > /data/a");
    c.exec(&id, &exec_req("exec 3>>/data/a; sleep 3600"))
        .expect("exec");
    let v = c.sleep_sandbox(&id).expect("sleep");
    assert_eq!(v.status, SandboxStatus::Sleeping, "{v:?}");
    let v = c.wake_sandbox(&id).expect("wake");
    assert_eq!(v.status, SandboxStatus::Running, "{v:?}");
    let v = sh(
        &c,
        &id,
        "cat /data/a; echo after >> /data/a; touch /ref/x 2>/dev/null || echo ro; cat /data/a",
    );
    assert_eq!(v.stdout, "before\nro\nbefore\nafter\n", "{v:?}");
    // The writes landed in the volume itself.
    let vol = c.volume("rw").expect("the volume");
    assert_eq!(
        fs::read_to_string(volume_dir(&node, &vol.id).join("a")).unwrap(),
        "before\nafter\n"
    );
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}

//! The file API, `/v1/sandboxes/{id}/files…`, against real sandboxes: binary round trips with
//! checksums (also taken inside the sandbox), a tree by tar, every operation, every error code
//! from a real failing operation, escape attempts that must never touch a host file, and
//! `sbx cp` / `sbx fs`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{self, assert_error, unique, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(10);

fn http() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout_read(Duration::from_secs(120))
        .timeout_write(Duration::from_secs(120))
        .build()
}

/// Bytes that look random, made as they are read (the same seed, the same bytes).
struct Gen {
    state: u64,
    left: u64,
}

impl Gen {
    fn new(seed: u64, len: u64) -> Gen {
        Gen {
            state: seed | 1,
            left: len,
        }
    }
}

impl Read for Gen {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64).min(self.left) as usize;
        for chunk in buf[..n].chunks_mut(8) {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            let b = self.state.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// sha256 (hex) of what a reader gives, by the host's sha256sum.
fn sha256(mut r: impl Read) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    let mut stdin = child.stdin.take().unwrap();
    std::io::copy(&mut r, &mut stdin).expect("feed sha256sum");
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

struct Sb<'a> {
    node: &'a TestNode,
    id: String,
}

impl Sb<'_> {
    fn new(node: &TestNode) -> Sb<'_> {
        let v = node.create_sandbox(&json!({}));
        Sb {
            node,
            id: v["id"].as_str().unwrap().to_string(),
        }
    }

    fn url(&self, tail: &str) -> String {
        self.node
            .url(&format!("/v1/sandboxes/{}/files{tail}", self.id))
    }

    /// A shell line in the sandbox: (exit code, stdout).
    fn sh(&self, line: &str) -> (i64, String) {
        let r = self.node.post_json(
            &format!("/v1/sandboxes/{}/run", self.id),
            &json!({ "command": line }),
        );
        let v = r.json();
        assert_eq!(r.status, 200, "{line}: {v}");
        (
            v["exit_code"].as_i64().unwrap_or(-1),
            v["stdout"].as_str().unwrap_or("").to_string(),
        )
    }

    fn sh_ok(&self, line: &str) -> String {
        let (code, out) = self.sh(line);
        assert_eq!(code, 0, "{line} exited {code}: {out}");
        out
    }

    /// PUT of a body read from `r`, `len` bytes (a Content-Length).
    fn put(&self, query: &str, r: impl Read, len: u64) -> (u16, Value) {
        let res = http()
            .put(&self.url(&format!("?{query}")))
            .set("content-type", "application/octet-stream")
            .set("content-length", &len.to_string())
            .send(r);
        status_json(res)
    }

    /// A POST of the file API with a JSON body.
    fn post(&self, op: &str, query: &str, body: &Value) -> (u16, Value) {
        let r = self.node.post(
            &format!("/v1/sandboxes/{}/files/{op}?{query}", self.id),
            &[],
            &serde_json::to_vec(body).unwrap(),
        );
        (r.status, r.json())
    }

    fn get_json(&self, tail: &str) -> (u16, Value) {
        status_json(http().get(&self.url(tail)).call())
    }
}

fn status_json(res: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let resp = match res {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = resp.status();
    let text = resp.into_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn binary_files_round_trip_with_their_checksums() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    for (i, size) in [0u64, 1, 1 << 20, 100 << 20].into_iter().enumerate() {
        let path = format!("/work/bin/f{size}");
        let seed = 0x9e37_79b9 + i as u64;
        let (status, v) = sb.put(
            &format!("path={path}&parents=true&mode=0640"),
            Gen::new(seed, size),
            size,
        );
        assert_eq!(status, 201, "upload of {size} bytes: {v}");
        assert_eq!(v["bytes_written"], size, "{v}");
        assert_eq!(v["size"], size, "{v}");
        assert_eq!(v["mode"], "0640", "{v}");
        assert_eq!(v["created"], true, "{v}");
        let want = sha256(Gen::new(seed, size));
        // The sandbox sees the same bytes, owned by its user (root here), with the mode asked.
        let out = sb.sh_ok(&format!("sha256sum {path}; stat -c '%s %a %u' {path}"));
        assert!(
            out.starts_with(&want),
            "in the sandbox: {out} (want {want})"
        );
        assert!(out.contains(&format!("{size} 640 0")), "{out}");
        // And the download gives them back.
        let resp = http()
            .get(&sb.url(&format!("?path={path}")))
            .call()
            .expect("download");
        assert_eq!(resp.header("content-length"), Some(&*size.to_string()));
        assert_eq!(
            resp.header("content-type"),
            Some("application/octet-stream")
        );
        assert_eq!(sha256(resp.into_reader()), want, "download of {size} bytes");
    }
    // The node held none of it: its peak memory stays far below the 100 MiB that went through
    // it each way.
    let hwm = vm_hwm_kib(node.pid().unwrap());
    assert!(hwm < 80 << 10, "the node's VmHWM is {hwm} KiB");

    // Uploading again replaces the file (200), keeping its mode when none is given.
    let (status, v) = sb.put("path=/work/bin/f1", &b"xy"[..], 2);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["created"].clone(), v["mode"].clone()),
        (json!(false), json!("0640"))
    );

    // Ranges of the 1 MiB file.
    let whole: Vec<u8> = {
        let mut v = Vec::new();
        Gen::new(0x9e37_79b9 + 2, 1 << 20)
            .read_to_end(&mut v)
            .unwrap();
        v
    };
    for (range, from, to) in [
        ("bytes=10-19", 10usize, 20usize),
        ("bytes=-5", (1 << 20) - 5, 1 << 20),
        ("bytes=1048570-", (1 << 20) - 6, 1 << 20),
        ("bytes=1048000-2000000", 1_048_000, 1 << 20),
    ] {
        let resp = http()
            .get(&sb.url("?path=/work/bin/f1048576"))
            .set("range", range)
            .call()
            .expect("ranged download");
        assert_eq!(resp.status(), 206, "{range}");
        assert_eq!(
            resp.header("content-range").unwrap(),
            format!("bytes {from}-{}/{}", to - 1, 1 << 20),
            "{range}"
        );
        let mut got = Vec::new();
        resp.into_reader().read_to_end(&mut got).unwrap();
        assert_eq!(got, &whole[from..to], "{range}");
    }
    let (status, v) = status_json(
        http()
            .get(&sb.url("?path=/work/bin/f1048576"))
            .set("range", "bytes=2000000-")
            .call(),
    );
    assert_error(status, &v, 416, "invalid_range", Some("Range"));
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

/// A tar archive of `dir` made by the tar crate.
fn tar_of(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// (path, kind, mode, content or link target) of every entry of an archive, sorted.
fn tar_listing(bytes: &[u8]) -> Vec<(String, String, u32, Vec<u8>)> {
    let mut ar = tar::Archive::new(bytes);
    let mut out = Vec::new();
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = e
            .path()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_string();
        if name.is_empty() || name == "." {
            continue;
        }
        let t = e.header().entry_type();
        let mode = e.header().mode().unwrap() & 0o7777;
        let (kind, data) = if t.is_dir() {
            ("dir", Vec::new())
        } else if t.is_symlink() {
            let l = e.link_name().unwrap().unwrap();
            ("symlink", l.to_string_lossy().as_bytes().to_vec())
        } else {
            let mut d = Vec::new();
            e.read_to_end(&mut d).unwrap();
            ("file", d)
        };
        // A symlink's mode is not a thing that moves.
        let mode = if kind == "symlink" { 0 } else { mode };
        out.push((name, kind.to_string(), mode, data));
    }
    out.sort();
    out
}

#[test]
fn a_tree_round_trips_by_tar() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    let local = node.root.join(unique("tree"));
    std::fs::create_dir_all(local.join("src/deep")).unwrap();
    std::fs::create_dir_all(local.join("empty")).unwrap();
    std::fs::write(local.join("README.md"), b"# hi\n").unwrap();
    let mut big = Vec::new();
    Gen::new(7, 3 << 20).read_to_end(&mut big).unwrap();
    std::fs::write(local.join("src/blob.bin"), &big).unwrap();
    std::fs::write(local.join("src/deep/run.sh"), b"#!/bin/sh\necho ran\n").unwrap();
    std::fs::write(local.join("zero"), b"").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        local.join("src/deep/run.sh"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    std::os::unix::fs::symlink("README.md", local.join("link")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", local.join("abs")).unwrap();
    let archive = tar_of(&local);

    let (status, v) = status_json(
        http()
            .post(&sb.url("/tar?path=/work/proj"))
            .set("content-type", "application/x-tar")
            .send_bytes(&archive),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["bytes"], (3 << 20) + 5 + 19, "{v}");
    // In the sandbox: the files, their modes, the symlinks as symlinks, owned by its user.
    assert_eq!(sb.sh_ok("/work/proj/src/deep/run.sh"), "ran\n");
    let out = sb.sh_ok(
        "cd /work/proj && sha256sum src/blob.bin && readlink link abs && \
         stat -c '%a %u' src/deep/run.sh && test -d empty && test -f zero && echo ok",
    );
    assert!(out.starts_with(&sha256(&big[..])), "{out}");
    assert!(out.contains("README.md\n/etc/hostname\n755 0\nok"), "{out}");

    // Back as a tar stream: the same entries.
    let resp = http()
        .get(&sb.url("/tar?path=/work/proj"))
        .call()
        .expect("tar download");
    assert_eq!(resp.header("content-type"), Some("application/x-tar"));
    let mut back = Vec::new();
    resp.into_reader().read_to_end(&mut back).unwrap();
    assert_eq!(tar_listing(&back), tar_listing(&archive));
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

#[test]
fn operations_do_what_they_say() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    // mkdir: made (201), then made already (200 with parents), mode exact.
    let (s, v) = sb.post(
        "mkdir",
        "path=/work/app/src",
        &json!({"parents": true, "mode": "0750"}),
    );
    assert_eq!(
        (s, &v["created"], &v["type"], &v["mode"]),
        (201, &json!(true), &json!("dir"), &json!("0750")),
        "{v}"
    );
    let (s, v) = sb.post("mkdir", "path=/work/app/src&parents=true", &json!({}));
    assert_eq!((s, &v["created"]), (200, &json!(false)), "{v}");
    assert_eq!(sb.sh_ok("stat -c %a /work/app /work/app/src"), "755\n750\n");

    for (name, text) in [
        ("main.py", "print('hello')\nprint('world')\n"),
        ("util.py", "def hello():\n    return 'Hello'\n"),
        ("notes.txt", "hello from notes\n"),
    ] {
        let (s, v) = sb.put(
            &format!("path=/work/app/src/{name}"),
            text.as_bytes(),
            text.len() as u64,
        );
        assert_eq!(s, 201, "{v}");
    }
    // An owner: a user of the sandbox.
    let (s, v) = sb.put("path=/work/app/owned&owner=nobody", &b"n"[..], 1);
    assert_eq!(s, 201, "{v}");
    assert_eq!(sb.sh_ok("stat -c %U /work/app/owned"), "nobody\n");
    // Ids the sandbox does not have are refused (4294967295 was "no change" to chown: the
    // file was written, owned by root).
    for owner in ["4294967295", "65536", "0:70000"] {
        let (s, v) = sb.put(&format!("path=/work/app/stray&owner={owner}"), &b"n"[..], 1);
        assert_eq!(
            (s, v["error"]["code"].as_str(), v["error"]["param"].as_str()),
            (400, Some("fs_invalid"), Some("owner")),
            "{owner}: {v}"
        );
    }
    assert_eq!(sb.sh("test -e /work/app/stray").0, 1);

    // ls and stat.
    let (s, v) = sb.get_json("/list?path=/work/app/src");
    assert_eq!(s, 200, "{v}");
    let names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["main.py", "notes.txt", "util.py"], "{v}");
    assert_eq!(v["truncated"], false);
    sb.sh_ok("ln -s src/main.py /work/app/link");
    let (s, v) = sb.get_json("/stat?path=/work/app/link");
    assert_eq!(
        (s, &v["type"], &v["target"]),
        (200, &json!("symlink"), &json!("src/main.py")),
        "{v}"
    );
    // Downloading through the symlink gives the file.
    let body = http()
        .get(&sb.url("?path=/work/app/link"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert_eq!(body, "print('hello')\nprint('world')\n");

    // grep: regex, ignore case, include/exclude, max, line cut.
    let (s, v) = sb.post("grep", "path=/work/app", &json!({"pattern": "hel+o"}));
    assert_eq!(s, 200, "{v}");
    let hits: Vec<String> = v["matches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            format!(
                "{}:{}:{}",
                m["path"].as_str().unwrap(),
                m["line"],
                m["column"]
            )
        })
        .collect();
    assert_eq!(
        hits,
        [
            "/work/app/src/main.py:1:8",
            "/work/app/src/notes.txt:1:1",
            "/work/app/src/util.py:1:5"
        ],
        "{v}"
    );
    let (_, v) = sb.post(
        "grep",
        "path=/work/app",
        &json!({"pattern": "HELLO", "ignore_case": true, "include": ["*.py"], "exclude": ["util.*"]}),
    );
    assert_eq!(v["matches"].as_array().unwrap().len(), 1, "{v}");
    let (_, v) = sb.post(
        "grep",
        "path=/work/app",
        &json!({"pattern": "o", "max_matches": 2, "max_line_bytes": 3}),
    );
    assert_eq!(
        (v["matches"].as_array().unwrap().len(), &v["truncated"]),
        (2, &json!(true)),
        "{v}"
    );
    assert_eq!(v["matches"][0]["text"], "pri", "{v}");
    assert_eq!(v["matches"][0]["line_truncated"], true, "{v}");
    let (_, v) = sb.post(
        "grep",
        "path=/work/app",
        &json!({"pattern": "(", "literal": true}),
    );
    assert_eq!(v["matches"].as_array().unwrap().len(), 3, "{v}");

    // sed: regex with groups, first only, literal; per-file results; mode and owner kept.
    sb.sh_ok("chmod 0751 /work/app/src/main.py && chown nobody /work/app/src/main.py");
    let (s, v) = sb.post(
        "sed",
        "path=/work/app/src",
        &json!({"pattern": "print\\('(\\w+)'\\)", "replacement": "log('$1')"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["replacements"], 2, "{v}");
    assert_eq!(
        v["files"],
        json!([{"path": "/work/app/src/main.py", "replacements": 2}])
    );
    assert_eq!(
        sb.sh_ok("cat /work/app/src/main.py; stat -c '%a %U' /work/app/src/main.py"),
        "log('hello')\nlog('world')\n751 nobody\n"
    );
    let (_, v) = sb.post(
        "sed",
        "path=/work/app/src/main.py",
        &json!({"pattern": "log(", "replacement": "print(", "literal": true, "first_only": true}),
    );
    assert_eq!(v["replacements"], 1, "{v}");
    assert_eq!(
        sb.sh_ok("cat /work/app/src/main.py"),
        "print('hello')\nlog('world')\n"
    );

    // chmod: mode, owners, recursive.
    let (s, v) = sb.post(
        "chmod",
        "path=/work/app/src&mode=0700&uid=65534&recursive=true",
        &json!({}),
    );
    assert_eq!((s, &v["changed"]), (200, &json!(4)), "{v}");
    assert_eq!(
        sb.sh_ok("stat -c '%a %u' /work/app/src /work/app/src/util.py"),
        "700 65534\n700 65534\n"
    );

    // mv: refuses to replace unless asked.
    let (s, v) = sb.post(
        "mv",
        "path=/work/app/src/util.py",
        &json!({"dst": "/work/app/src/notes.txt"}),
    );
    assert_error(s, &v, 409, "path_exists", Some("dst"));
    let (s, v) = sb.post(
        "mv",
        "path=/work/app/src/util.py",
        &json!({"dst": "/work/app/src/notes.txt", "overwrite": true}),
    );
    assert_eq!(
        (s, &v["path"], &v["src"]),
        (
            200,
            &json!("/work/app/src/notes.txt"),
            &json!("/work/app/src/util.py")
        ),
        "{v}"
    );
    let (s, _) = sb.post("mv", "path=/work/app/src&dst=/work/moved", &json!({}));
    assert_eq!(s, 200);
    assert_eq!(sb.sh_ok("ls /work/moved"), "main.py\nnotes.txt\n");

    // rm: a file, a symlink (not what it points to), a tree.
    let (s, v) = sb.post("rm", "path=/work/app/link", &json!({}));
    assert_eq!(
        (s, &v["removed"], &v["type"]),
        (200, &json!(true), &json!("symlink")),
        "{v}"
    );
    let (s, _) = sb.post("rm", "path=/work/moved", &json!({"recursive": true}));
    assert_eq!(s, 200);
    assert_eq!(sb.sh("test -e /work/moved || test -e /work/app/link").0, 1);
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

/// A PUT whose body ends (the socket half closed) before its Content-Length: the answer.
fn cut_upload(node: &TestNode, sb: &str, path: &str) -> (u16, Value) {
    let mut s = TcpStream::connect(&node.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "PUT /v1/sandboxes/{sb}/files?path={path} HTTP/1.1\r\nHost: {}\r\n\
         Content-Length: 10000000\r\nConnection: close\r\n\r\n",
        node.addr
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(&vec![b'x'; 1 << 20]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut r = BufReader::new(s);
    let mut status = 0;
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some(rest) = line.strip_prefix("HTTP/1.1 ") {
            status = rest[..3].parse().unwrap();
        } else if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[test]
fn each_error_code_comes_from_a_real_failure() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    sb.sh_ok("mkdir -p /work/full && echo x > /work/full/f && echo keep > /work/kept");

    // S210 fs_invalid: a NUL byte in the path; an unknown parameter; a bad mode.
    let (s, v) = sb.get_json("?path=/work/a%00b");
    assert_error(s, &v, 400, "fs_invalid", Some("path"));
    let (s, v) = sb.get_json("/list?path=/work&color=red");
    assert_error(s, &v, 400, "fs_invalid", Some("color"));
    let (s, v) = sb.post("chmod", "path=/work/kept", &json!({"mode": "0999"}));
    assert_error(s, &v, 400, "fs_invalid", Some("mode"));
    let (s, v) = sb.post("rm", "path=/", &json!({"recursive": true}));
    assert_error(s, &v, 400, "fs_invalid", Some("path"));
    // S211 path_not_found.
    let (s, v) = sb.get_json("/stat?path=/work/nope");
    assert_error(s, &v, 404, "path_not_found", Some("path"));
    let (s, v) = sb.put("path=/work/no/such/dir/f", &b"x"[..], 1);
    assert_error(s, &v, 404, "path_not_found", Some("path"));
    // S212 wrong_type: a directory downloaded as a file; a file listed.
    let (s, v) = sb.get_json("?path=/work/full");
    assert_error(s, &v, 409, "wrong_type", Some("path"));
    let (s, v) = sb.get_json("/list?path=/work/kept");
    assert_error(s, &v, 409, "wrong_type", Some("path"));
    // S213 path_exists.
    let (s, v) = sb.post("mkdir", "path=/work/full", &json!({}));
    assert_error(s, &v, 409, "path_exists", Some("path"));
    // S214 not_empty.
    let (s, v) = sb.post("rm", "path=/work/full", &json!({}));
    assert_error(s, &v, 409, "not_empty", Some("path"));
    // S215 permission_denied: files of the host's root are not the sandbox's to change.
    let (s, v) = sb.post(
        "chmod",
        "path=/proc/sys/kernel/hostname&mode=0666",
        &json!({}),
    );
    assert_error(s, &v, 403, "permission_denied", Some("path"));
    let (s, v) = sb.post("mkdir", "path=/sys/x", &json!({}));
    assert_error(s, &v, 403, "permission_denied", Some("path"));
    // S216 io_error: /dev/shm holds 64 MiB; 70 MiB do not fit (the failure comes midway).
    let (s, v) = sb.put("path=/dev/shm/big", Gen::new(3, 70 << 20), 70 << 20);
    assert_error(s, &v, 500, "io_error", Some("path"));
    assert_eq!(
        sb.sh_ok("ls -A /dev/shm"),
        "",
        "the partial file is removed"
    );
    // S217 bad_pattern.
    let (s, v) = sb.post("grep", "path=/work", &json!({"pattern": "(unclosed"}));
    assert_error(s, &v, 400, "bad_pattern", Some("pattern"));
    let (s, v) = sb.post(
        "sed",
        "path=/work",
        &json!({"pattern": "a{2,1}", "replacement": ""}),
    );
    assert_error(s, &v, 400, "bad_pattern", Some("pattern"));
    // S218 stream_aborted: the body ends before its Content-Length; the old file stays.
    let (s, v) = cut_upload(&node, &sb.id, "/work/kept");
    assert_error(s, &v, 503, "stream_aborted", Some("body"));
    assert_eq!(v["error"]["retryable"], true);
    // The partial file goes as soon as the agent sees the connection end.
    let mut left = String::new();
    for _ in 0..50 {
        left = sb.sh_ok("cat /work/kept; ls -A /work");
        if left == "keep\nfull\nkept\n" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(left, "keep\nfull\nkept\n");
    // S219 unsupported: a character device is not a file to move.
    let (s, v) = sb.get_json("?path=/dev/null");
    assert_error(s, &v, 501, "unsupported", Some("path"));
    let (s, v) = sb.post("mv", "path=/work/kept&dst=/dev/shm/kept", &json!({}));
    assert_error(s, &v, 501, "unsupported", Some("dst"));

    // Not the file API's: no such sandbox.
    let (s, v) = status_json(
        http()
            .get(&node.url("/v1/sandboxes/sbx-0000000000000000/files/stat?path=/"))
            .call(),
    );
    assert_error(s, &v, 404, "sandbox_not_found", None);
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

/// A file on the host with known bytes; its sha256.
fn host_marker(dir: &Path, name: &str) -> (PathBuf, String) {
    let p = dir.join(name);
    std::fs::write(&p, b"host secret\n").unwrap();
    (p, sha256(&b"host secret\n"[..]))
}

fn host_sha(p: &Path) -> Option<String> {
    std::fs::File::open(p).ok().map(sha256)
}

/// A reader that gives `len` bytes slowly (a pause at each read) and runs `midway` once half of
/// them are out.
struct Slow<F: FnMut()> {
    len: u64,
    left: u64,
    midway: Option<F>,
}

impl<F: FnMut()> Read for Slow<F> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        if self.left <= self.len / 2 {
            if let Some(mut f) = self.midway.take() {
                f();
            }
        }
        std::thread::sleep(Duration::from_millis(5));
        let n = (buf.len() as u64).min(self.left).min(16 << 10) as usize;
        buf[..n].fill(b's');
        self.left -= n as u64;
        Ok(n)
    }
}

#[test]
fn escapes_never_touch_a_host_file() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    let host_dir = node.root.join(unique("host"));
    std::fs::create_dir_all(&host_dir).unwrap();
    let (marker, marker_sha) = host_marker(&host_dir, "marker");
    let shadow_sha = host_sha(Path::new("/etc/shadow"));
    let host = host_dir.to_string_lossy().into_owned();

    // .. is taken against the sandbox's root: this is the sandbox's /etc/shadow.
    let (s, v) = sb.put("path=../../../../etc/shadow", &b"sandbox shadow\n"[..], 15);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["path"], "/etc/shadow");
    assert_eq!(sb.sh_ok("cat /etc/shadow"), "sandbox shadow\n");
    let body = http()
        .get(&sb.url("?path=/work/../../etc/shadow"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert_eq!(body, "sandbox shadow\n");
    // The host's path, as a path of the sandbox, is nothing.
    let (s, v) = sb.get_json(&format!("?path={}", enc(&marker.to_string_lossy())));
    assert_error(s, &v, 404, "path_not_found", Some("path"));

    // Absolute symlinks that point out are read in the sandbox.
    sb.sh_ok(&format!(
        "ln -s {host} /tmp/out && ln -s {m} /tmp/marker && ln -s / /tmp/root",
        m = marker.display()
    ));
    let (s, v) = sb.put("path=/tmp/out/pwned", &b"x"[..], 1);
    assert_error(s, &v, 404, "path_not_found", Some("path"));
    let (s, v) = sb.get_json("?path=/tmp/marker");
    assert_error(s, &v, 404, "path_not_found", Some("path"));
    let (s, _) = sb.put("path=/tmp/root/tmp/through-root", &b"in\n"[..], 3);
    assert_eq!(s, 201);
    assert_eq!(sb.sh_ok("cat /tmp/through-root"), "in\n");
    // As mkdir -p does, parents are not made through a symlink that points nowhere.
    let (s, v) = sb.put("path=/tmp/out/made&parents=true", &b"y"[..], 1);
    assert_error(s, &v, 409, "path_exists", Some("path"));
    // A tar with .. and absolute entries lands inside its directory or nowhere.
    let mut b = tar::Builder::new(Vec::new());
    for name in ["../../escaped", "/abs-entry", "ok.txt"] {
        let mut h = tar::Header::new_gnu();
        let bytes = name.as_bytes();
        h.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, &b"bad"[..]).unwrap();
    }
    let archive = b.into_inner().unwrap();
    let (s, v) = status_json(
        http()
            .post(&sb.url("/tar?path=/work/t"))
            .set("content-type", "application/x-tar")
            .send_bytes(&archive),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["entries"].clone(), v["skipped"].clone()),
        (json!(2), json!(1)),
        "{v}"
    );
    assert_eq!(
        sb.sh_ok("find /work -name escaped | wc -l; ls /work/t"),
        "0\nabs-entry\nok.txt\n"
    );

    // A symlink swapped in for the directory while a file is written: the file lands in the
    // directory the path named when the upload began.
    sb.sh_ok("mkdir -p /work/swap");
    let swapped = std::cell::Cell::new(false);
    let slow = Slow {
        len: 2 << 20,
        left: 2 << 20,
        midway: Some(|| {
            sb.sh_ok(&format!(
                "mv /work/swap /work/swap.orig && ln -s {host} /work/swap"
            ));
            swapped.set(true);
        }),
    };
    let (s, v) = sb.put("path=/work/swap/file", slow, 2 << 20);
    assert!(swapped.get());
    assert_eq!(s, 201, "{v}");
    assert_eq!(sb.sh_ok("stat -c %s /work/swap.orig/file"), "2097152\n");
    assert!(!host_dir.join("file").exists());

    // Nothing of the host changed.
    assert_eq!(host_sha(&marker), Some(marker_sha));
    assert_eq!(host_sha(Path::new("/etc/shadow")), shadow_sha);
    for p in ["pwned", "made", "through-root", "escaped", "abs-entry"] {
        assert!(!host_dir.join(p).exists(), "{p} on the host");
    }
    assert!(!Path::new("/abs-entry").exists() && !Path::new("/tmp/through-root").exists());
    let entries: Vec<_> = std::fs::read_dir(&host_dir).unwrap().collect();
    assert_eq!(entries.len(), 1, "the host directory holds only its marker");
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

#[test]
fn sbx_cp_and_fs() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let sb = Sb::new(&node);
    let sbx = |args: &[&str]| common::sbx(&node, args);
    let dir = node.root.join(unique("cp"));
    std::fs::create_dir_all(dir.join("proj/sub")).unwrap();
    let mut blob = Vec::new();
    Gen::new(11, 5 << 20).read_to_end(&mut blob).unwrap();
    std::fs::write(dir.join("blob"), &blob).unwrap();
    std::fs::write(dir.join("proj/sub/a.txt"), b"alpha\n").unwrap();
    std::fs::write(dir.join("proj/b.txt"), b"beta\n").unwrap();
    let d = dir.to_string_lossy().into_owned();
    let id = sb.id.as_str();

    let (c, _, e) = sbx(&["cp", &format!("{d}/blob"), &format!("{id}:/work/blob")]);
    assert_eq!(c, 0, "{e}");
    let (c, _, e) = sbx(&["cp", &format!("{id}:/work/blob"), &format!("{d}/blob.back")]);
    assert_eq!(c, 0, "{e}");
    assert_eq!(std::fs::read(dir.join("blob.back")).unwrap(), blob);
    // A directory into an existing directory goes under its own name.
    sb.sh_ok("mkdir -p /work/in");
    let (c, _, e) = sbx(&["cp", "-q", &format!("{d}/proj"), &format!("{id}:/work/in")]);
    assert_eq!(c, 0, "{e}");
    assert_eq!(
        sb.sh_ok("cat /work/in/proj/sub/a.txt /work/in/proj/b.txt"),
        "alpha\nbeta\n"
    );
    let (c, _, e) = sbx(&[
        "cp",
        &format!("{id}:/work/in/proj"),
        &format!("{d}/proj.back"),
    ]);
    assert_eq!(c, 0, "{e}");
    assert_eq!(
        std::fs::read(dir.join("proj.back/sub/a.txt")).unwrap(),
        b"alpha\n"
    );

    let (c, out, e) = sbx(&["fs", "ls", id, "/work/in/proj"]);
    assert_eq!(c, 0, "{e}");
    assert!(out.contains(" b.txt\n") && out.contains(" sub\n"), "{out}");
    let (c, out, _) = sbx(&["fs", "grep", id, "alp", "/work/in"]);
    assert_eq!((c, out.as_str()), (0, "/work/in/proj/sub/a.txt:1:alpha\n"));
    let (c, _, _) = sbx(&["fs", "grep", id, "nothing-like-this", "/work/in"]);
    assert_eq!(c, 1, "grep exits 1 on no match");
    let (c, out, _) = sbx(&["fs", "sed", id, "beta", "gamma", "/work/in"]);
    assert_eq!((c, out.as_str()), (0, "/work/in/proj/b.txt: 1\n"));
    let (c, _, e) = sbx(&["fs", "mkdir", "-p", id, "/work/x/y"]);
    assert_eq!(c, 0, "{e}");
    let (c, _, e) = sbx(&["fs", "chmod", id, "0700", "/work/x/y"]);
    assert_eq!(c, 0, "{e}");
    let (c, _, e) = sbx(&["fs", "mv", id, "/work/x/y", "/work/x/z"]);
    assert_eq!(c, 0, "{e}");
    let (c, out, _) = sbx(&["fs", "stat", id, "/work/x/z"]);
    assert_eq!(c, 0);
    assert!(out.contains("\"mode\": \"0700\""), "{out}");
    let (c, _, e) = sbx(&["fs", "rm", id, "/work/x"]);
    assert!(c != 0 && e.contains("not_empty"), "{e}");
    let (c, _, e) = sbx(&["fs", "rm", "-r", id, "/work/x"]);
    assert_eq!(c, 0, "{e}");
    node.delete_sandbox(&sb.id);
    node.assert_clean(CLEAN);
}

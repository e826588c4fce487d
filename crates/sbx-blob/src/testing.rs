//! A SeaweedFS server on loopback for tests (feature `testing`): the object store's own tests
//! and the node's (crates/sandboxd/tests/it/store.rs) start one each, on ports of its own, in
//! a temp directory, and it is killed and removed when dropped. Test code: it panics on what
//! it cannot do.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `weed`: $SBX_WEED, else on PATH, else where scripts/seaweedfs.sh installs it.
pub fn find_weed() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SBX_WEED").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join("weed");
            if c.is_file() {
                return Some(c);
            }
        }
    }
    let c = PathBuf::from("/opt/sbx-seaweedfs/venv/bin/weed");
    c.is_file().then_some(c)
}

/// Why a server did not get ready: it ended (`exited`), or the time ran out.
struct NotReady {
    exited: bool,
    last: String,
}

/// A SeaweedFS server (master, volume, filer, S3) on loopback ports of its own, in a temp
/// directory; killed and removed on drop, a test that fails included.
pub struct Weed {
    child: Child,
    dir: tempfile::TempDir,
    ports: Vec<u16>,
    pub s3_port: u16,
}

impl Weed {
    /// Starts one and waits until it is ready. The ports are free when chosen and released
    /// for weed, so another process may take one before weed binds it (an outgoing
    /// connection's ephemeral port, another test's server): weed then exits, and is started
    /// again on other ports (three tries).
    pub fn start(bin: &Path) -> Weed {
        let mut tries = 0;
        loop {
            tries += 1;
            let mut weed = Weed::spawn(bin);
            match weed.wait_ready() {
                Ok(()) => return weed,
                Err(e) if e.exited && tries < 3 => {
                    eprintln!("SeaweedFS ended as it started, started again: {}", e.last)
                }
                Err(e) => panic!(
                    "SeaweedFS did not get ready in 60 s ({}); its log, last lines first:\n{}",
                    e.last,
                    weed.log_tail()
                ),
            }
        }
    }

    fn spawn(bin: &Path) -> Weed {
        let dir = tempfile::Builder::new()
            .prefix("sbx-weed-")
            .tempdir()
            .expect("a temp directory for weed");
        // Free ports: bound at once (so none repeats), then released for weed.
        let listeners: Vec<TcpListener> = (0..8)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free port"))
            .collect();
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().expect("a bound port").port())
            .collect();
        drop(listeners);
        let d = dir.path();
        let log = fs::File::create(d.join("weed.log")).expect("weed's log");
        let child = Command::new(bin)
            .arg("server")
            .arg("-s3")
            .arg("-ip=127.0.0.1")
            .arg(format!("-dir={}", d.display()))
            .arg(format!("-master.port={}", ports[0]))
            .arg(format!("-master.port.grpc={}", ports[1]))
            .arg(format!("-volume.port={}", ports[2]))
            .arg(format!("-volume.port.grpc={}", ports[3]))
            .arg(format!("-filer.port={}", ports[4]))
            .arg(format!("-filer.port.grpc={}", ports[5]))
            .arg(format!("-s3.port={}", ports[6]))
            .arg(format!("-s3.port.grpc={}", ports[7]))
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .arg(format!(
                "-filer.localSocket={}",
                d.join("filer.sock").display()
            ))
            .arg(format!("-s3.localSocket={}", d.join("s3.sock").display()))
            .arg("-master.volumeSizeLimitMB=256")
            .arg("-volume.max=0")
            .env("TMPDIR", d)
            .current_dir(d)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("weed's log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        Weed {
            child,
            dir,
            s3_port: ports[6],
            ports,
        }
    }

    /// Waits (60 s at most) until S3 answers and a small object can be written (the volume
    /// server registered), or weed ends.
    fn wait_ready(&mut self) -> Result<(), NotReady> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        // The bucket made once (a second PUT of it may answer 409), then a small object.
        let mut bucket = false;
        while Instant::now() < deadline {
            let made = if bucket {
                Ok(200)
            } else {
                self.http("PUT", "/sbx-ready", b"")
            };
            match made {
                Ok(200 | 409) => {
                    bucket = true;
                    match self.http("PUT", "/sbx-ready/probe", b"ok") {
                        Ok(200) => return Ok(()),
                        Ok(s) => last = format!("probe put: {s}"),
                        Err(e) => last = e,
                    }
                }
                Ok(s) => last = format!("bucket: {s}"),
                Err(e) => last = e,
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(NotReady {
                    exited: true,
                    last: format!("weed ended: {status}; {last}"),
                });
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(NotReady {
            exited: false,
            last,
        })
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default();
        log.lines().rev().take(30).collect::<Vec<_>>().join("\n")
    }

    /// One unsigned HTTP/1.0 request to the S3 port: its status.
    pub fn http(&self, method: &str, path: &str, body: &[u8]) -> Result<u16, String> {
        self.request(method, path, body).map(|(status, _)| status)
    }

    /// One unsigned request: its body, when the status is 200.
    pub fn http_text(&self, method: &str, path: &str) -> Result<String, String> {
        match self.request(method, path, b"")? {
            (200, body) => Ok(body),
            (status, body) => Err(format!("{status}: {body}")),
        }
    }

    fn request(&self, method: &str, path: &str, body: &[u8]) -> Result<(u16, String), String> {
        let mut s = TcpStream::connect(("127.0.0.1", self.s3_port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let head = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\n\r\n",
            self.s3_port,
            body.len()
        );
        s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
        s.write_all(body).map_err(|e| e.to_string())?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&resp);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| {
                format!(
                    "no HTTP answer: {:?}",
                    text.chars().take(100).collect::<String>()
                )
            })?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        Ok((status, body.to_string()))
    }

    /// Makes a bucket (SeaweedFS takes anonymous requests without an S3 config).
    pub fn make_bucket(&self, name: &str) {
        assert_eq!(self.http("PUT", &format!("/{name}"), b""), Ok(200));
    }

    /// The AWS_* settings for a store on this server (any keys do).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "AWS_ENDPOINT_URL".into(),
                format!("http://127.0.0.1:{}", self.s3_port),
            ),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
            ("AWS_ACCESS_KEY_ID".into(), "sbx-test".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "sbx-test-secret-key".into()),
        ]
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        // A test's server: killed outright (its data goes with its directory).
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The unix sockets weed puts in /tmp whatever its flags say.
        for p in &self.ports {
            for kind in [
                "master-grpc",
                "volume-grpc",
                "filer",
                "filer-grpc",
                "s3",
                "s3-grpc",
            ] {
                let _ = fs::remove_file(format!("/tmp/seaweedfs-{kind}-{p}.sock"));
            }
        }
    }
}

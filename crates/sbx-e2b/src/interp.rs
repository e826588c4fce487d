//! The code interpreter of `e2b-code-interpreter` (template `code-interpreter-v1`): the server
//! the SDK's `run_code` and `*_code_context` talk to on port 49999 of a sandbox, proxied there
//! like any other port (`E2b-Sandbox-Port: 49999`).
//!
//! It runs inside the sandbox, as the start command of the template's machine, on the node's
//! code interpreter image ([`IMAGE`]: the base image's Debian, python3 and node, with Debian's
//! numpy, pandas and matplotlib; nothing installed at run time): `interp/server.py` is
//! a Python standard-library HTTP server (`python3 -c SERVER_PY KERNEL_JS`, no file of it on
//! the sandbox's disk) with one child process a context: a Python kernel (its source is in
//! server.py), node running `interp/kernel.js` (given as the argument) for JavaScript, bash.
//! Both are sbx-guest's (crates/sbx-guest/src/interp/).
//! See server.py's docstring for the protocol; the template is saved once `GET /health`
//! answers, with the default Python context started.

use serde_json::{json, Value};

/// The E2B template the SDK asks for (`Sandbox.create()` of `e2b_code_interpreter`).
pub const TEMPLATE: &str = "code-interpreter-v1";

/// The node's image the template runs on: the base image's packages and the data stack
/// (numpy, pandas, matplotlib, ...), built by the node (`sandboxd build-base`).
pub const IMAGE: &str = sbx_node::image::INTERP_IMAGE;

/// The port the SDK sends its requests to (`JUPYTER_PORT`).
pub const PORT: u16 = 49999;

/// The path the node's ready check asks for.
pub const HEALTH_PATH: &str = "/health";

/// The server and its JavaScript kernel: guest programs, kept with the guest's side
/// (sbx-guest).
pub use sbx_guest::interp::{KERNEL_JS, SERVER_PY};

/// The arguments that start the server in a sandbox of the base image: nothing of it is on
/// the sandbox's disk. Together under the 64 KiB a start command may have.
pub fn start_command() -> Vec<String> {
    vec![
        "python3".to_owned(),
        "-c".to_owned(),
        SERVER_PY.to_owned(),
        KERNEL_JS.to_owned(),
    ]
}

/// The environment the start command needs besides the image's: none (the port is 49999 by
/// default, the contexts' directory /home/user, made if missing).
pub fn start_env() -> Vec<(String, String)> {
    Vec::new()
}

/// When the template's machine counts as up, as the node's create spells its `ready`:
/// `GET /health` on port 49999 answers (the server answers it once its default Python
/// context has started).
pub fn ready_check() -> Value {
    json!({"http": {"port": PORT, "path": HEALTH_PATH}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command as Process, Stdio};
    use std::time::{Duration, Instant};

    /// The server, killed when dropped with its whole process group (its kernels; and
    /// python3 may be a wrapper, pyenv's shim, whose child is the server).
    struct Server {
        child: Child,
        base: String,
        dir: std::path::PathBuf,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let group = format!("-{}", self.child.id());
            let _ = Process::new("kill").args(["-KILL", "--", &group]).status();
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn have(program: &str) -> bool {
        Process::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    /// Starts the server as a sandbox does (`start_command()`), with the host's python3.
    fn start() -> Server {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("sbx-interp-test-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let argv = start_command();
        let child = Process::new(&argv[0])
            .args(&argv[1..])
            .env("SBX_INTERP_PORT", port.to_string())
            .env("SBX_INTERP_CWD", &dir)
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        let t0 = Instant::now();
        loop {
            if let Ok(r) = ureq::get(&format!("{}{HEALTH_PATH}", server.base))
                .timeout(Duration::from_secs(5))
                .call()
            {
                assert_eq!(r.into_string().unwrap(), "\"OK\"");
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(15), "no /health");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// POST /execute: the NDJSON lines.
    fn execute(s: &Server, body: serde_json::Value) -> Vec<Value> {
        let text = ureq::post(&format!("{}/execute", s.base))
            .timeout(Duration::from_secs(30))
            .send_json(body)
            .unwrap()
            .into_string()
            .unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.last(), Some(&json!({"type": "end_of_execution"})));
        lines
    }

    #[test]
    fn start_command_fits_and_has_no_nul() {
        let argv = start_command();
        let total: usize = argv.iter().map(String::len).sum();
        assert!(total < 64 * 1024, "the start command is {total} bytes");
        assert!(argv.iter().all(|a| !a.contains('\0')));
        assert!(start_env().is_empty());
        // The node's create takes them as they are.
        let body = json!({"start_command": argv, "ready": ready_check()});
        let req = sbx_api::parse_sandbox_create(body.to_string().as_bytes()).unwrap();
        assert_eq!(
            req.spec.ready,
            Some(sbx_api::Ready::Http {
                port: PORT,
                path: HEALTH_PATH.to_owned()
            })
        );
        assert_eq!(TEMPLATE, "code-interpreter-v1");
    }

    #[test]
    fn python_cells_keep_state_and_stream_ndjson() {
        if !have("python3") {
            println!("skipped: no python3 on this host");
            return;
        }
        let s = start();
        let lines = execute(&s, json!({"code": "x = 1"}));
        assert_eq!(
            lines,
            vec![
                json!({"type": "number_of_executions", "execution_count": 1}),
                json!({"type": "end_of_execution"}),
            ]
        );
        let lines = execute(
            &s,
            json!({"code": "print('hi')\nx + 1", "context_id": null, "language": null}),
        );
        assert_eq!(lines[0]["execution_count"], 2);
        assert_eq!(lines[1]["type"], "stdout");
        assert_eq!(lines[1]["text"], "hi\n");
        assert!(lines[1]["timestamp"].is_string());
        assert_eq!(
            lines[2],
            json!({"type": "result", "text": "2", "extra": {}, "is_main_result": true})
        );
        let lines = execute(&s, json!({"code": "1/0"}));
        assert_eq!(lines[1]["type"], "error");
        assert_eq!(lines[1]["name"], "ZeroDivisionError");
        assert_eq!(lines[1]["value"], "division by zero");
        assert!(lines[1]["traceback"]
            .as_str()
            .unwrap()
            .contains("Cell In[3]"));
        let err = ureq::post(&format!("{}/execute", s.base))
            .send_json(json!({"code": "1", "context_id": "nope"}))
            .unwrap_err();
        match err {
            ureq::Error::Status(404, r) => {
                assert_eq!(r.into_string().unwrap(), "Context nope not found")
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn javascript_context_keeps_state() {
        if !have("python3") || !have("node") {
            println!("skipped: python3 or node missing on this host");
            return;
        }
        let s = start();
        let ctx: serde_json::Value = ureq::post(&format!("{}/contexts", s.base))
            .send_json(json!({"language": "js"}))
            .unwrap()
            .into_json()
            .unwrap();
        assert_eq!(ctx["language"], "javascript");
        let id = ctx["id"].as_str().unwrap();
        let lines = execute(
            &s,
            json!({"code": "let a = 40; console.log('js')", "context_id": id}),
        );
        assert_eq!(lines[1]["text"], "js\n");
        let lines = execute(&s, json!({"code": "a + 2", "context_id": id}));
        assert_eq!(lines[1]["text"], "42");
        assert_eq!(lines[1]["is_main_result"], true);
        // ESM imports become the cell's globals (names the kernel itself uses too).
        let lines = execute(
            &s,
            json!({"code": "import fs from 'fs'\nimport { join as j } from 'path'", "context_id": id}),
        );
        assert_eq!(lines.len(), 2, "{lines:?}");
        let lines = execute(
            &s,
            json!({"code": "j('a', 'b') + fs.existsSync('/')", "context_id": id}),
        );
        assert_eq!(lines[1]["text"], "a/btrue");
    }
}

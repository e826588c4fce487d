//! The functions interface of a fleet through one iii engine (issue #29): the control plane
//! and two nodes join one real engine (`III_BIN`; skipped with a note when it is not set). The
//! control plane serves `sandbox::*` in the engine's default namespace and routes each call by
//! its table; each node serves its own in `sbx-<node name>`. A node standing alone on the same
//! engine cannot take the default namespace's ids from the control plane (the engine refuses a
//! second owner of an id in one namespace).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{ControlPlane, FleetStore, Node, NodeMore, NodeOpts};
use crate::http::Http;

/// A real iii engine on a loopback port: a config of its own in a temporary directory; killed
/// and its directory removed when dropped.
struct Engine {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Engine {
    fn start(bin: &Path) -> Engine {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let dir =
            std::env::temp_dir().join(format!("sbx-fleet-iii-{}-{}", std::process::id(), port));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the engine's folder");
        std::fs::write(
            dir.join("config.yaml"),
            format!(
                "workers:\n  - name: iii-worker-manager\n    config:\n      host: 127.0.0.1\n      port: {port}\n"
            ),
        )
        .expect("the engine's config");
        let log = std::fs::File::create(dir.join("engine.log")).expect("the engine's log");
        let child = Command::new(bin)
            .args(["--config", "config.yaml", "--no-update-check"])
            .current_dir(&dir)
            .env("IIIWORKER_DISABLE_BUILTIN_DAEMONS", "1")
            .env("III_TELEMETRY_ENABLED", "false")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("start the iii engine");
        let e = Engine {
            bin: bin.to_path_buf(),
            dir,
            port,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the engine did not listen\n{}",
                e.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        e
    }

    fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("engine.log")).unwrap_or_default()
    }

    /// `iii trigger [-n NAMESPACE] FUNCTION --json PAYLOAD`: Ok(reply), or Err(the error the
    /// engine hands back, `{code, message}`, with `body`: the S-code body in its message).
    fn trigger(&self, ns: Option<&str>, function: &str, payload: &Value) -> Result<Value, Value> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["trigger", "--port", &self.port.to_string()]);
        if let Some(ns) = ns {
            cmd.args(["--namespace", ns]);
        }
        let out = cmd
            .args([
                "--timeout-ms",
                "60000",
                "--json",
                &payload.to_string(),
                function,
            ])
            .current_dir(&self.dir)
            .env("III_TELEMETRY_ENABLED", "false")
            .stdin(Stdio::null())
            .output()
            .expect("run iii trigger");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        if out.status.success() {
            return serde_json::from_str(stdout.trim())
                .map_err(|e| json!({"code": "", "message": format!("not JSON ({e}): {stdout}")}));
        }
        let all = format!("{stdout}\n{stderr}");
        let start = all.find("Error: {").map(|i| i + "Error: ".len());
        let mut e = start
            .and_then(|i| {
                serde_json::Deserializer::from_str(&all[i..])
                    .into_iter::<Value>()
                    .next()
                    .and_then(Result::ok)
            })
            .unwrap_or_else(|| json!({ "code": "", "message": all }));
        let body = e["message"]
            .as_str()
            .and_then(|m| serde_json::from_str::<Value>(m).ok())
            .unwrap_or(Value::Null);
        e["body"] = body;
        Err(e)
    }

    fn ok(
        &self,
        ns: Option<&str>,
        function: &str,
        payload: &Value,
        logs: &dyn Fn() -> String,
    ) -> Value {
        self.trigger(ns, function, payload).unwrap_or_else(|e| {
            panic!(
                "{function} {payload} (namespace {ns:?}) failed: {e}\n{}",
                logs()
            )
        })
    }

    /// The S-code of a call that must fail, and the interface's error body.
    fn s_error(&self, ns: Option<&str>, function: &str, payload: &Value) -> (String, Value) {
        let e = self
            .trigger(ns, function, payload)
            .expect_err(&format!("{function} {payload} should fail"));
        let code = e["code"].as_str().unwrap_or_default().to_string();
        (code, e["body"].clone())
    }

    /// Calls `function` until `good` likes its reply (the workers joined and registered).
    fn wait_for(
        &self,
        ns: Option<&str>,
        function: &str,
        payload: &Value,
        logs: &dyn Fn() -> String,
        good: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let r = self.trigger(ns, function, payload);
            match &r {
                Ok(v) if good(v) => return v.clone(),
                _ => assert!(
                    Instant::now() < deadline,
                    "{function} (namespace {ns:?}) not served as expected through the engine: \
                     {r:?}\n{}\nengine:\n{}",
                    logs(),
                    self.log()
                ),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ns_of(node: &Node) -> String {
    format!("sbx-{}", node.name)
}

/// Waits until every node named is `ready` in the control plane's table; their ids by name.
fn ready(
    http: &Http,
    ctl: &ControlPlane,
    names: &[&str],
) -> std::collections::HashMap<String, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = http.get(&ctl.url("/internal/nodes")).json();
        let ids: std::collections::HashMap<String, String> = v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["state"] == "ready")
            .map(|n| {
                (
                    n["name"].as_str().unwrap_or("").to_string(),
                    n["id"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        if names.iter().all(|n| ids.contains_key(*n)) {
            return ids;
        }
        assert!(
            Instant::now() < deadline,
            "nodes not ready: {v}\n{}",
            ctl.log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn functions_through_one_engine() {
    let Some(bin) = std::env::var_os("III_BIN").map(PathBuf::from) else {
        eprintln!("SKIPPED functions_through_one_engine: III_BIN is not set (no iii engine)");
        return;
    };
    assert!(bin.is_file(), "III_BIN={} is not a file", bin.display());
    let engine = Engine::start(&bin);
    let iii = vec!["--iii-url".to_string(), engine.url()];
    let store = FleetStore::dir();
    let ctl = ControlPlane::start_args(None, Some(&store), &iii);
    let node = |name: &str| {
        Node::start_more(
            name,
            &ctl,
            NodeOpts {
                store: Some(&store),
                other_build: false,
            },
            NodeMore {
                args: iii.clone(),
                standalone: false,
            },
        )
    };
    let (mut a, mut b) = (node("fn-a"), node("fn-b"));
    let http = Http::new();
    let ids = ready(&http, &ctl, &["fn-a", "fn-b"]);
    let logs = || {
        format!(
            "control plane:\n{}\nfn-a:\n{}\nfn-b:\n{}",
            ctl.log_tail(30),
            a.log_tail(30),
            b.log_tail(30)
        )
    };

    // The control plane answers in the default namespace (the fleet's info, both nodes in it);
    // each node in its own.
    let info = engine.wait_for(None, "sandbox::adapter::info", &json!({}), &logs, |v| {
        v["info"]["fleet"] == true && v["info"]["driver"].is_string()
    });
    assert_eq!(
        info["info"]["functions"].as_array().map(Vec::len),
        Some(17),
        "{info}"
    );
    assert_eq!(
        info["info"]["nodes"].as_array().map(Vec::len),
        Some(2),
        "{info}"
    );
    for n in [&a, &b] {
        let own = engine.wait_for(
            Some(&ns_of(n)),
            "sandbox::adapter::info",
            &json!({}),
            &logs,
            |v| v["info"]["name"] == "sbx",
        );
        assert!(own["info"].get("fleet").is_none(), "a node's own: {own}");
    }

    // A run through the control plane: placed on a node, its output back.
    let r = engine.ok(
        None,
        "sandbox::run",
        &json!({"image": "python", "lang": "python", "code": "print(2+2)"}),
        &logs,
    );
    assert_eq!(r["stdout"], "4\n", "{r}");
    assert_eq!(r["success"], true, "{r}");

    // create: placed on a node, recorded in the table.
    let c = engine.ok(
        None,
        "sandbox::create",
        &json!({"image": "python", "name": "fn-box"}),
        &logs,
    );
    let id = c["sandbox_id"].as_str().unwrap_or("").to_string();
    assert!(id.starts_with("sbx-"), "{c}");
    assert_eq!(c["image"], "python", "{c}");
    let on = c["node"]["name"].as_str().unwrap_or("").to_string();
    assert!(on == "fn-a" || on == "fn-b", "{c}");
    assert_eq!(c["node"]["id"], ids[&on].as_str(), "{c}");
    assert_eq!(c["epoch"], 1, "{c}");
    let row = http.get(&ctl.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(row.status, 200, "{}", row.text());
    assert_eq!(row.json()["node"]["name"], on.as_str());
    assert_eq!(row.json()["name"], "fn-box");
    let (home, away) = if on == "fn-a" { (&a, &b) } else { (&b, &a) };
    let r = http.get(&home.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(r.status, 200, "made on {on}: {}", r.text());

    // exec, fs::write, fs::read through the control plane (by id and by name).
    let x = engine.ok(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "argv": ["sh", "-c", "echo fleet-$((6*7)); exit 3"]}),
        &logs,
    );
    assert_eq!(x["stdout"], "fleet-42\n", "{x}");
    assert_eq!(x["exit_code"], 3, "{x}");
    let w = engine.ok(
        None,
        "sandbox::fs::write",
        &json!({"sandbox_id": "fn-box", "path": "/work/a.txt", "content": "hello fleet\n", "parents": true}),
        &logs,
    );
    assert_eq!(w["size"], 12, "{w}");
    let rd = engine.ok(
        None,
        "sandbox::fs::read",
        &json!({"sandbox_id": id, "path": "/work/a.txt"}),
        &logs,
    );
    assert_eq!(rd["body"], "hello fleet\n", "{rd}");

    // list: merged, the sandbox with its node and epoch.
    let l = engine.ok(None, "sandbox::list", &json!({}), &logs);
    let row = l["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["sandbox_id"] == id.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("{id} not listed: {l}"));
    assert_eq!(row["node"]["name"], on.as_str(), "{l}");
    assert_eq!(row["epoch"], 1, "{l}");

    // The node's own namespace: its function, reached with the namespace named; the other
    // node's does not have the sandbox.
    let x = engine.ok(
        Some(&ns_of(home)),
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "cat /work/a.txt"}),
        &logs,
    );
    assert_eq!(x["stdout"], "hello fleet\n", "{x}");
    let (code, body) = engine.s_error(
        Some(&ns_of(away)),
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "true"}),
    );
    assert_eq!(code, "S002", "{body}");

    // The default namespace's ids are the control plane's: a node standing alone on the same
    // engine is refused each one (the engine's FUNCTION_NAMESPACE_CONFLICT), and calls still
    // reach the control plane.
    let alone = Node::start_more(
        "fn-alone",
        &ctl,
        NodeOpts::default(),
        NodeMore {
            args: iii.clone(),
            standalone: true,
        },
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !alone
        .log_tail(400)
        .contains("another worker in this namespace already hosts")
    {
        assert!(
            Instant::now() < deadline,
            "the engine did not refuse the second owner of sandbox::* in the default \
             namespace\n{}\nengine:\n{}",
            alone.log_tail(40),
            engine.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let info = engine.ok(None, "sandbox::adapter::info", &json!({}), &logs);
    assert_eq!(
        info["info"]["fleet"], true,
        "still the control plane's: {info}"
    );
    let x = engine.ok(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "true"}),
        &logs,
    );
    assert_eq!(x["exit_code"], 0, "{x}");
    drop(alone);

    // A move: the sandbox goes to the other node; sandbox::exec through the control plane
    // reaches it there, its file with it.
    let r = http.post_json(
        &ctl.url("/internal/moves"),
        &json!({"sandbox_id": id, "to": away.name}),
    );
    assert_eq!(r.status, 202, "{}\n{}", r.text(), logs());
    let move_id = r.json()["id"].as_str().unwrap_or("").to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let m = http
            .get(&ctl.url(&format!("/internal/moves/{move_id}")))
            .json();
        if m["step"] == "done" {
            break;
        }
        assert!(
            m["step"] != "failed" && Instant::now() < deadline,
            "the move: {m}\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let x = engine.ok(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "cat /work/a.txt"}),
        &logs,
    );
    assert_eq!(x["stdout"], "hello fleet\n", "{x}");
    let l = engine.ok(None, "sandbox::list", &json!({}), &logs);
    let row = l["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|s| s["sandbox_id"] == id.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("{id} not listed after its move: {l}"));
    assert_eq!(row["node"]["name"], away.name.as_str(), "{l}");
    let x = engine.ok(
        Some(&ns_of(away)),
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "echo here"}),
        &logs,
    );
    assert_eq!(x["stdout"], "here\n", "{x}");

    // stop: gone from its node and from the table; a call naming it is S002.
    let s = engine.ok(None, "sandbox::stop", &json!({"sandbox_id": id}), &logs);
    assert_eq!(s["stopped"], true, "{s}");
    let r = http.get(&ctl.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(r.status, 404, "the table's row goes: {}", r.text());
    let (code, body) = engine.s_error(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "true"}),
    );
    assert_eq!(code, "S002", "{body}");
    assert_eq!(body["code"], "S002", "{body}");
    assert_eq!(body["retryable"], false, "{body}");
    let (code, body) = engine.s_error(None, "sandbox::list", &json!({"bogus": 1}));
    assert_eq!(code, "S001", "{body}");

    // A node away: its sandboxes' calls are S301 (transient, retryable).
    let c = engine.ok(None, "sandbox::create", &json!({"image": "python"}), &logs);
    let on2 = c["node"]["name"].as_str().unwrap_or("").to_string();
    let victim = if on2 == a.name { &mut a } else { &mut b };
    away_case(&engine, &http, &ctl, victim, &c);
}

/// Node `victim` (which holds the sandbox `c` made) killed: lost after its lease, and a call
/// of its sandbox through the control plane is S301, retryable.
fn away_case(engine: &Engine, http: &Http, ctl: &ControlPlane, victim: &mut Node, c: &Value) {
    let logs = || ctl.log_tail(30);
    let id = c["sandbox_id"].as_str().unwrap_or("").to_string();
    victim.kill();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let v = http.get(&ctl.url("/internal/nodes")).json();
        let lost = v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["name"] == victim.name.as_str() && n["state"] == "lost");
        if lost {
            break;
        }
        assert!(Instant::now() < deadline, "not lost: {v}\n{}", logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, body) = engine.s_error(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "cmd": "true"}),
    );
    assert_eq!(code, "S301", "{body}");
    assert_eq!(body["retryable"], true, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| m.contains("lost")),
        "{body}"
    );
    let l = engine.ok(None, "sandbox::list", &json!({}), &logs);
    assert_eq!(l["missing_nodes"][0]["name"], victim.name.as_str(), "{l}");
}

/// Two control planes on one PostgreSQL database and one engine: only the active copy serves
/// `sandbox::*` in the default namespace; once it is killed, the standby takes the lease and
/// the functions with it (a create and an exec through the engine reach the node).
#[test]
fn the_functions_follow_the_active_control_plane() {
    let Some(bin) = std::env::var_os("III_BIN").map(PathBuf::from) else {
        eprintln!("SKIPPED the_functions_follow_the_active_control_plane: III_BIN is not set");
        return;
    };
    let Ok(admin) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!(
            "SKIPPED the_functions_follow_the_active_control_plane: SBX_TEST_PG_URL is not set"
        );
        return;
    };
    let engine = Engine::start(&bin);
    let db = crate::harness::PgDatabase::create(&admin);
    let store = FleetStore::dir();
    let copy = |name: &str| {
        let args: Vec<String> = [
            "--iii-url",
            &engine.url(),
            "--name",
            name,
            "--control-lease-seconds",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        ControlPlane::start_args(Some(&db.url), Some(&store), &args)
    };
    let mut c1 = copy("cp-1");
    let c2 = copy("cp-2");
    let node = Node::start_joining(
        "fo-a",
        &[&c1, &c2],
        NodeOpts {
            store: Some(&store),
            other_build: false,
        },
    );
    let http = Http::new();
    let role = |c: &ControlPlane| http.get(&c.url("/healthz")).json()["role"].clone();
    // c1 started first: it is active (it took the lease before c2 started).
    assert_eq!(role(&c1), "active", "{}", c1.log_tail(20));
    assert_eq!(role(&c2), "standby", "{}", c2.log_tail(20));
    ready(&http, &c1, &["fo-a"]);
    let logs = || {
        format!(
            "cp-2:\n{}\nnode:\n{}\nengine:\n{}",
            c2.log_tail(20),
            node.log_tail(20),
            engine.log()
        )
    };
    let first = engine.wait_for(None, "sandbox::list", &json!({}), &logs, |v| {
        v["sandboxes"].is_array()
    });
    assert!(first["sandboxes"].is_array(), "{first}");

    // The active copy dies: the standby takes the lease, and the engine's default namespace.
    c1.kill();
    let deadline = Instant::now() + Duration::from_secs(15);
    while role(&c2) != "active" {
        assert!(
            Instant::now() < deadline,
            "cp-2 did not take over\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Served again in the default namespace (cp-1's worker is gone with it: this is cp-2's).
    engine.wait_for(None, "sandbox::list", &json!({}), &logs, |v| {
        v["sandboxes"].is_array()
    });
    // The node heartbeats to cp-2 (it may have been lost in the gap: its lease is short).
    ready(&http, &c2, &["fo-a"]);
    // The node may be fenced a moment (no control plane renewed its lease meanwhile): S301,
    // retryable, and nothing made; asked again until it renews.
    let deadline = Instant::now() + Duration::from_secs(20);
    let made = loop {
        match engine.trigger(
            None,
            "sandbox::create",
            &json!({"image": "python", "name": "after-failover"}),
        ) {
            Ok(v) => break v,
            Err(e) if e["code"] == "S301" && Instant::now() < deadline => {
                assert_eq!(e["body"]["retryable"], true, "{e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            // Or, on a loaded machine, its lease ran out in the gap: lost to cp-2 until its
            // next heartbeat (no other node to place on).
            Err(e)
                if e["code"] == "S400"
                    && e.to_string().contains("1 lost")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("sandbox::create after the failover: {e}\n{}", logs()),
        }
    };
    let id = made["sandbox_id"].as_str().unwrap_or_default().to_string();
    assert_eq!(made["node"]["name"], "fo-a", "{made}");
    let row = http.get(&c2.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(
        row.status,
        200,
        "the new active copy's table: {}",
        row.text()
    );
    let x = engine.ok(
        None,
        "sandbox::exec",
        &json!({"sandbox_id": id, "argv": ["sh", "-c", "echo after-$((40+2))"]}),
        &logs,
    );
    assert_eq!(x["stdout"], "after-42\n", "{x}");
    let del = http.delete(&c2.url(&format!("/v1/sandboxes/{id}")));
    assert!(del.status == 200 || del.status == 204, "{}", del.text());
}

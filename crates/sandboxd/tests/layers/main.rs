//! The layers of the workspace, as ARCHITECTURE.md draws them, checked on the crates'
//! manifests: a crate depends on the workspace's crates its layer allows and on no other, and
//! the core (sbx-node) and the wire types (sbx-api) on no HTTP or TLS crate. A dependency that
//! breaks a layer fails here, before any code of it is read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate of the workspace and the workspace's crates it may depend on (normal
/// dependencies; tests may use more). A crate missing here fails the test: say where it goes.
const ALLOWED: &[(&str, &[&str])] = &[
    ("sbx-api", &[]),
    ("sbx-proto", &[]),
    ("sbx-runtime", &[]),
    ("sbx-image", &[]),
    ("sbx-testreg", &[]),
    ("sbx-guest", &[]),
    ("sbx-agent", &["sbx-proto", "sbx-runtime"]),
    (
        "sbx-node",
        &["sbx-api", "sbx-proto", "sbx-runtime", "sbx-image"],
    ),
    ("sbx-net", &["sbx-api", "sbx-node", "sbx-runtime"]),
    // The accept loop and connection serving of every listener, the node's and the control
    // plane's.
    ("sbx-listen", &["sbx-api"]),
    (
        "sbx-front",
        &[
            "sbx-api",
            "sbx-listen",
            "sbx-node",
            "sbx-net",
            "sbx-runtime",
        ],
    ),
    // The front ends: each on the core and what they share, never on another front end.
    (
        "sbx-e2b",
        &[
            "sbx-api",
            "sbx-runtime",
            "sbx-node",
            "sbx-front",
            "sbx-guest",
        ],
    ),
    ("sbx-preview", &["sbx-api", "sbx-node", "sbx-front"]),
    ("sbx-functions", &["sbx-api", "sbx-node"]),
    // The HTTP API serves the functions interface's calls (POST /v1/functions/{id}).
    (
        "sbx-http",
        &[
            "sbx-api",
            "sbx-image",
            "sbx-node",
            "sbx-front",
            "sbx-functions",
        ],
    ),
    ("sbx-client", &["sbx-api"]),
    // The fleet: the object store of sleeps and snapshots, and the control plane (a client of
    // the nodes).
    ("sbx-blob", &[]),
    (
        "sbx-control",
        &["sbx-api", "sbx-client", "sbx-blob", "sbx-listen"],
    ),
    ("sbx-cli", &["sbx-api", "sbx-client"]),
    (
        "sandboxd",
        &[
            "sbx-runtime",
            "sbx-node",
            "sbx-net",
            "sbx-front",
            "sbx-e2b",
            "sbx-preview",
            "sbx-functions",
            "sbx-http",
            "sbx-blob",
            "sbx-control",
        ],
    ),
    (
        "sbx-bench",
        &["sbx-api", "sbx-client", "sbx-runtime", "sbx-testreg"],
    ),
];

/// The front ends and the binary that wires them: they reach sandboxes through the core's
/// typed verbs (sbx-api's types and the node's own), never the agent's protocol (sbx-proto) or
/// the node's agent client (`sbx_node::agent`, crate-private). Checked on their manifests (the
/// table above) and on their sources.
const FRONT_ENDS: &[&str] = &[
    "sbx-http",
    "sbx-e2b",
    "sbx-preview",
    "sbx-functions",
    "sbx-front",
    "sandboxd",
];
/// What a front end's source never names.
const AGENT_NAMES: &[&str] = &["sbx_proto", "sbx-proto", "node::agent"];

/// Crates that speak HTTP, TLS or serve a front end: never a dependency of these.
const NO_FRONT: &[&str] = &["sbx-api", "sbx-node", "sbx-proto", "sbx-runtime"];
const FRONT_CRATES: &[&str] = &[
    "axum",
    "hyper",
    "hyper-util",
    "tower",
    "tungstenite",
    "rustls",
    "tokio-rustls",
    "iii-sdk",
    "reqwest",
    "ureq",
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the workspace root")
        .to_path_buf()
}

/// Each member's name and its normal dependencies' names.
fn members() -> BTreeMap<String, BTreeSet<String>> {
    let root = workspace_root();
    let text = std::fs::read_to_string(root.join("Cargo.toml")).expect("the workspace manifest");
    let ws: toml::Value = text.parse().expect("the workspace manifest is TOML");
    let list = ws["workspace"]["members"]
        .as_array()
        .expect("workspace members");
    let mut out = BTreeMap::new();
    for m in list {
        let dir = root.join(m.as_str().expect("a member path"));
        let text = std::fs::read_to_string(dir.join("Cargo.toml")).expect("a member's manifest");
        let v: toml::Value = text.parse().expect("a member's manifest is TOML");
        let name = v["package"]["name"]
            .as_str()
            .expect("a package name")
            .to_string();
        let deps = v
            .get("dependencies")
            .and_then(|d| d.as_table())
            .map(|t| {
                t.iter()
                    .map(|(k, v)| {
                        // `foo = { package = "bar" }` depends on bar.
                        v.get("package")
                            .and_then(|p| p.as_str())
                            .unwrap_or(k)
                            .to_string()
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.insert(name, deps);
    }
    out
}

#[test]
fn each_crate_depends_only_on_what_its_layer_allows() {
    let members = members();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut broken = Vec::new();
    for (name, deps) in &members {
        let Some(ok) = allowed.get(name.as_str()) else {
            broken.push(format!("{name}: not in the layers' table (tests/layers)"));
            continue;
        };
        for d in deps.iter().filter(|d| members.contains_key(*d)) {
            if !ok.contains(&d.as_str()) {
                broken.push(format!("{name} -> {d}"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layers broken:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn the_core_and_the_wire_types_speak_no_http() {
    let members = members();
    let mut broken = Vec::new();
    for name in NO_FRONT {
        let deps = members.get(*name).expect("a member of the workspace");
        for d in deps.iter().filter(|d| FRONT_CRATES.contains(&d.as_str())) {
            broken.push(format!("{name} -> {d}"));
        }
    }
    assert!(
        broken.is_empty(),
        "front-end crates in the core:\n  {}",
        broken.join("\n  ")
    );
}

/// The table checks what it says: a rule it has is one a manifest could break.
#[test]
fn every_crate_of_the_table_is_a_member() {
    let members = members();
    let missing: Vec<_> = ALLOWED
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !members.contains_key(*n))
        .collect();
    assert!(missing.is_empty(), "not members: {missing:?}");
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("a source directory") {
        let path = e.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn front_ends_name_no_agent_protocol() {
    let members = members();
    let root = workspace_root();
    let mut broken = Vec::new();
    for name in FRONT_ENDS {
        let deps = members.get(*name).expect("a member of the workspace");
        if deps.contains("sbx-proto") {
            broken.push(format!("{name} -> sbx-proto"));
        }
        let src = root.join("crates").join(name).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        assert!(!files.is_empty(), "no sources under {}", src.display());
        for f in files {
            let text = std::fs::read_to_string(&f).expect("a source file");
            for (i, line) in text.lines().enumerate() {
                if let Some(n) = AGENT_NAMES.iter().find(|n| line.contains(*n)) {
                    let at = f.strip_prefix(&root).unwrap_or(&f).display();
                    broken.push(format!("{at}:{}: names {n}", i + 1));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "front ends naming the agent's protocol or client:\n  {}",
        broken.join("\n  ")
    );
}

//! `sandbox::create`, `stop`, `list`, `catalog::list`: the node's kept sandboxes, with the
//! interface's allowlist, catalog, sandbox cap and stopped ids.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_api::functions::FnError;
use sbx_api::SandboxStatus;
use serde_json::{json, Value};

use sbx_api::{Command, RunRequest, SandboxCreate};

use super::*;
use crate::node::sandbox::ListQuery;
use crate::node::Node;
use crate::sync::LockExt;

/// The sandbox's id (a name is taken too); S004 for one stopped, S002 for one never seen.
pub(super) fn resolve(node: &Node, f: &Fns, id: &str) -> Result<String, FnError> {
    let stopped = || {
        FnError::new(
            "S004",
            format!("the sandbox {id} is stopped; create a new one"),
        )
    };
    match node.sandbox(id) {
        // Stopped with wait: false, and not gone yet.
        Ok(o) if f.was_stopped(&o.id) => Err(stopped()),
        Ok(o) => Ok(o.id),
        Err(_) if f.was_stopped(id) => Err(stopped()),
        Err(e) => Err(e.into()),
    }
}

/// The local image an image name boots as: S100 when it is not allowed or not in the
/// catalog, S101 for a custom image with no local rootfs.
pub(super) fn local_image(f: &Fns, name: &str) -> Result<String, FnError> {
    if !f.cfg.allowed(name) {
        return Err(FnError::new(
            "S100",
            format!("image {name} is not in this node's image_allowlist"),
        ));
    }
    if PRESETS.contains(&name) {
        return Ok(name.to_string());
    }
    match f.cfg.custom_images.iter().find(|c| c.name == name) {
        Some(c) => match &c.image {
            Some(local) if PRESETS.contains(&local.as_str()) => Ok(local.clone()),
            _ => Err(FnError::new(
                "S101",
                format!(
                    "image {name} ({}) has no rootfs on this node, and it pulls no images",
                    c.oci_ref
                ),
            )),
        },
        None => Err(FnError::new(
            "S100",
            format!("image {name} is not in the catalog (sandbox::catalog::list)"),
        )),
    }
}

pub(super) fn sandboxes_now(node: &Node) -> usize {
    let q = ListQuery {
        limit: usize::MAX,
        ..ListQuery::default()
    };
    node.list_sandboxes(&q).0.len() + node.sandbox_count()
}

pub(super) fn capacity(node: &Node) -> Result<(), FnError> {
    let n = sandboxes_now(node);
    if n >= node.cfg.max_sandboxes {
        return Err(FnError::new(
            "S400",
            format!(
                "the node holds {n} sandboxes, its max_sandboxes ({})",
                node.cfg.max_sandboxes
            ),
        ));
    }
    Ok(())
}

/// What `sandbox::create` makes, read from its payload.
pub(super) struct CreateArgs {
    /// The image's name as the caller gave it.
    pub image: String,
    pub cpus: Option<u64>,
    pub memory_mb: Option<u64>,
    pub name: Option<String>,
    pub env: BTreeMap<String, String>,
    /// `None`: the node's `idle_timeout_secs`.
    pub idle_timeout_secs: Option<u64>,
    /// On the node's network (default false: `lo` only, the fastest).
    pub network: bool,
}

impl CreateArgs {
    pub(super) fn of(node: &Node, p: &Payload) -> Result<CreateArgs, FnError> {
        let network = p.bool("network")?.unwrap_or(false);
        if network && !node.has_net() {
            return Err(FnError::new(
                "S304",
                "this node gives sandboxes no network (it runs with --egress-default none)",
            ));
        }
        Ok(CreateArgs {
            network,
            image: p.req_str("image")?,
            cpus: p.u64("cpus")?,
            memory_mb: p.u64("memory_mb")?,
            name: p.str("name")?,
            env: p.env()?.unwrap_or_default(),
            idle_timeout_secs: p.u64("idle_timeout_secs")?,
        })
    }
}

/// Makes a sandbox and waits for it to run: its id and image name.
pub(super) async fn create(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    a: CreateArgs,
) -> Result<(String, String), FnError> {
    let image = a.image;
    let mut spec = RunRequest::new(Command::Argv(Vec::new()));
    spec.image = Some(local_image(f, &image)?);
    spec.limits.vcpus = a.cpus.map(|c| u32::try_from(c).unwrap_or(u32::MAX));
    spec.limits.memory_bytes = a.memory_mb.map(|m| m.saturating_mul(1 << 20));
    spec.name = a.name;
    spec.env = a.env;
    spec.check()?;
    let idle = a.idle_timeout_secs.unwrap_or(f.cfg.idle_timeout_secs);
    let req = SandboxCreate {
        spec,
        network: Some(a.network),
    };
    let _one = f.create_lock.lock().await;
    capacity(node)?;
    let obj = node.create_sandbox(req).await?;
    if obj.status != SandboxStatus::Running {
        let why = obj.failure.clone().unwrap_or_default();
        let _ = node.delete_sandbox(&obj.id).await;
        return Err(FnError::new(
            "S300",
            format!("the sandbox did not boot: {why}"),
        ));
    }
    {
        let mut a = f.activity.locked();
        a.insert(
            obj.id.clone(),
            Activity {
                last: Instant::now(),
                idle: (idle > 0).then(|| Duration::from_secs(idle)),
                image: image.clone(),
            },
        );
    }
    Ok((obj.id, image))
}

pub(super) async fn stop(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    id: &str,
    wait: bool,
) -> Result<(), FnError> {
    f.mark_stopped(id);
    if wait {
        node.delete_sandbox(id).await?;
    } else {
        let node = node.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            let _ = node.delete_sandbox(&id).await;
        });
    }
    Ok(())
}

pub(super) fn list(node: &Node, f: &Fns) -> Value {
    let q = ListQuery {
        limit: usize::MAX,
        ..ListQuery::default()
    };
    let now = crate::image::now_ns();
    let max = node.cfg.max_execs_per_sandbox;
    let images: HashMap<String, String> = f
        .activity
        .locked()
        .iter()
        .map(|(k, v)| (k.clone(), v.image.clone()))
        .collect();
    let rows: Vec<Value> = node
        .list_sandboxes(&q)
        .0
        .into_iter()
        .map(|o| {
            let in_flight = node.running_execs(&o.id);
            let created = sbx_api::parse_rfc3339(&o.created_at).unwrap_or(now);
            json!({
                "sandbox_id": o.id,
                "name": o.name,
                "image": images.get(&o.id).cloned().unwrap_or(o.image),
                "age_secs": ((now - created).max(0) / 1_000_000_000) as u64,
                "exec_in_progress": in_flight > 0,
                "exec_in_flight": in_flight,
                "exec_slots_free": max.saturating_sub(in_flight),
                "stopped": !matches!(
                    o.status,
                    SandboxStatus::Running | SandboxStatus::Starting | SandboxStatus::Sleeping
                ),
                "status": o.status.as_str(),
            })
        })
        .collect();
    json!({ "sandboxes": rows })
}

pub(super) fn catalog(node: &Node, f: &Fns) -> Value {
    let mut images = Vec::new();
    for name in PRESETS {
        if !f.cfg.allowed(name) {
            continue;
        }
        let oci_ref = node
            .images
            .resolve(Some(name))
            .map(|i| format!("local/{}", i.meta.name))
            .unwrap_or_default();
        images.push(json!({ "name": name, "oci_ref": oci_ref, "kind": "preset" }));
    }
    for c in &f.cfg.custom_images {
        if f.cfg.allowed(&c.name) {
            images.push(json!({ "name": c.name, "oci_ref": c.oci_ref, "kind": "custom" }));
        }
    }
    json!({ "images": images })
}

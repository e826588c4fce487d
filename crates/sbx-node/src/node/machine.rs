//! What a sandbox is made of (image, limits, expiry), checked against the node's limits, and
//! making one: the driver's create, then a connection to its agent.

use std::sync::Arc;
use std::time::Duration;

use sbx_api::{ApiError, ErrorCode, RunRequest};
use sbx_runtime::{Limits, Sandbox, SandboxSpec};

use super::*;
use crate::agent::AgentConn;
use crate::image::{Image, ImageError, ImageStore, Source};
use crate::sync::LockExt;

/// What a sandbox is made of, resolved.
pub struct Machine {
    /// The image, or the reference to pull (a create waits for it; a run pulls first).
    pub image: Source,
    /// The registry login of `image_pull_secret`, for the pull alone.
    pub creds: Option<sbx_image::Credentials>,
    pub limits: Limits,
    /// Milliseconds until `expires_at`.
    pub expires_in_ms: Option<u64>,
    /// Its volumes, checked (attached by the caller, under the admission lock).
    pub volumes: Vec<crate::node::volume::StoredVolume>,
}

impl Node {
    /// Checks what a run or a create asks of the machine against what this node serves, and
    /// resolves its image and shape. Every refusal happens here, before anything is made.
    pub(crate) fn check_machine(
        &self,
        req: &RunRequest,
        long_lived: bool,
    ) -> Result<Machine, ApiError> {
        if let Some(allowed) = &self.cfg.image_allowlist {
            let name = req.image.as_deref().unwrap_or("base");
            if !allowed.iter().any(|a| a == name) {
                return Err(ApiError::new(
                    ErrorCode::ImageNotAllowed,
                    format!("image {name} is not in this node's image_allowlist"),
                )
                .with_param("image"));
            }
        }
        self.check_capacity()?;
        let volumes = self.check_volumes(&req.volumes)?;
        // A kept sandbox made from a snapshot takes another path (`create_from_snapshot`); a
        // run is not made from one.
        if let Some(snap) = &req.snapshot {
            self.get_snapshot(snap)
                .map_err(|e| e.with_param("snapshot"))?;
            return Err(not_served("snapshot", "runs made from snapshots"));
        }
        // A kept sandbox's template is looked up when its settings are taken
        // (`Node::apply_template`); a run is made from the base template alone.
        if let Some(t) = req.template.as_ref().filter(|_| !long_lived) {
            if t != crate::node::templates::BASE {
                return Err(ApiError::new(
                    ErrorCode::TemplateNotFound,
                    format!("no template {t} on this node"),
                )
                .with_param("template"));
            }
        }
        if req.project_network {
            return Err(not_served("project_network", "project networks"));
        }
        if req.init.is_some() {
            return Err(ApiError::new(
                ErrorCode::InvalidStart,
                "this node has no image of a whole system (--systemd-image)",
            )
            .with_param("init"));
        }
        let rt = crate::node::runtime_settings::of_request(req.runtime.as_ref())?;
        crate::node::runtime_settings::check_on_node(rt.as_ref())?;
        if !long_lived && (req.ready.is_some() || req.start_command.is_some()) {
            let param = if req.ready.is_some() {
                "ready"
            } else {
                "start_command"
            };
            return Err(not_served(param, "start commands in a run"));
        }
        if req.on_expiry != sbx_api::OnExpiry::Delete
            && (!long_lived || self.checkpointer().is_err())
        {
            return Err(not_served("on_expiry", "sleep"));
        }
        if req.guest_mitigations == Some(true) {
            return Err(not_served(
                "guest_mitigations",
                "guest kernels (its sandboxes share the host's kernel)",
            ));
        }
        // A kept sandbox's ports are reached through the preview listener; a run's are not.
        if !long_lived && (!req.public_ports.is_empty() || req.public_ports_except.is_some()) {
            let p = if req.public_ports.is_empty() {
                "public_ports_except"
            } else {
                "public_ports"
            };
            return Err(not_served(p, "preview URLs of runs"));
        }
        if req
            .inbound
            .as_ref()
            .and_then(|v| v.as_array())
            .is_some_and(|a| !a.is_empty())
        {
            return Err(ApiError::new(
                ErrorCode::NoIpv6,
                "this node has no pool of IPv6 addresses",
            )
            .with_param("inbound"));
        }
        if req.checkpoint.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::new(
                ErrorCode::CheckpointsUnavailable,
                "this node takes no checkpoints",
            )
            .with_param("checkpoint"));
        }
        let expires_in_ms = req.expires_at.as_deref().map(expires_in_ms).transpose()?;
        let memory = req
            .limits
            .memory_bytes
            .unwrap_or(self.cfg.default_memory_bytes);
        if memory > self.cfg.max_memory_bytes {
            return Err(ApiError::invalid_field(
                "limits.memory_bytes",
                format!("at most {} bytes on this node", self.cfg.max_memory_bytes),
            ));
        }
        let vcpus = req.limits.vcpus.unwrap_or(self.cfg.default_vcpus);
        if vcpus > self.cfg.max_vcpus {
            return Err(ApiError::invalid_field(
                "limits.vcpus",
                format!("at most {} on this node", self.cfg.max_vcpus),
            ));
        }
        let mut image = match self.images.lookup(req.image.as_deref()) {
            Ok(i) => i,
            Err(ImageError::InvalidReference(why)) => {
                return Err(ApiError::new(ErrorCode::InvalidImage, why).with_param("image"))
            }
            Err(e) => {
                tracing::error!(error = %e, "no image");
                return Err(ApiError::new(ErrorCode::Unavailable, e.to_string()));
            }
        };
        let creds = match &req.image_pull_secret {
            Some(secret) => {
                let (login, source) = self.image_login(req.image.as_deref(), secret)?;
                image = source;
                Some(login)
            }
            None => None,
        };
        if !long_lived && req.start == Some(true) && !image.is_base() {
            // A run starts no start command; the base image has none to start.
            return Err(not_served("start", "start commands in a run"));
        }
        let limits = Limits {
            memory_bytes: memory,
            vcpus,
            pids: self.cfg.pids_max,
        };
        Ok(Machine {
            image,
            creds,
            limits,
            expires_in_ms,
            volumes,
        })
    }

    /// The registry login of `image_pull_secret` for `image` (a reference: with a login it is
    /// always asked of its registry), and the image to pull. The secret's refusals: 404
    /// secret_not_found, 403 secret_host_not_allowed, 400 invalid_field.
    pub fn image_login(
        &self,
        image: Option<&str>,
        secret: &str,
    ) -> Result<(sbx_image::Credentials, Source), ApiError> {
        let reference = match image {
            Some(i) if !ImageStore::is_catalog(Some(i)) => {
                sbx_image::parse_reference(i).map_err(|e| {
                    ApiError::new(ErrorCode::InvalidImage, e.to_string()).with_param("image")
                })?
            }
            _ => {
                return Err(ApiError::invalid_field(
                    "image_pull_secret",
                    "image_pull_secret goes with an image of a registry, not a catalog name",
                ))
            }
        };
        let (username, password) = self.pull_credentials(secret, reference.registry())?;
        Ok((
            sbx_image::Credentials { username, password },
            Source::Remote(reference.to_string()),
        ))
    }

    /// The resolv.conf of `runtime.dns` (`None`: not given: the node's, or the image's):
    /// its servers, else the node's DNS for a sandbox on the network.
    pub(crate) fn resolv_for(
        &self,
        runtime: Option<&sbx_api::run::Runtime>,
        network: bool,
    ) -> Option<String> {
        let dns = runtime.and_then(|r| r.dns.as_ref())?;
        let fallback: Vec<std::net::IpAddr> = match self.net.as_ref() {
            Some(n) if network => vec![n.gateway().into()],
            _ => Vec::new(),
        };
        Some(dns.resolv_conf(&fallback))
    }

    /// Makes a sandbox (in the node's table of live ones) and connects to its agent.
    pub async fn create(
        self: &Arc<Self>,
        mut spec: SandboxSpec,
        network: bool,
    ) -> Result<(Arc<Sandbox>, AgentConn), ApiError> {
        let id = spec.id.clone();
        let driver = self.driver.clone();
        let net = self.net.as_ref().filter(|_| network).cloned();
        // On a blocking thread: a lease is one netlink message, but an empty pool makes a
        // namespace then and there (milliseconds).
        let made = tokio::task::spawn_blocking(move || {
            if let Some(net) = net {
                let id = spec.id.clone();
                net.take(&id, &mut spec).map_err(|e| {
                    tracing::error!(sandbox = %spec.id, error = %e, "no network namespace");
                    ApiError::new(
                        ErrorCode::Unavailable,
                        format!("no network for the sandbox: {e}"),
                    )
                })?;
            }
            Ok(driver.create(&spec))
        })
        .await
        .map_err(crate::node::internal("making a sandbox"))
        .and_then(|r| r);
        let made = match made {
            Ok(m) => m,
            Err(e) => {
                self.release_net(&id);
                return Err(e);
            }
        };
        let sandbox = match made {
            Ok(sb) => Arc::new(sb),
            Err(e) => {
                self.release_net(&id);
                tracing::error!(sandbox = %id, error = %e, "sandbox did not start");
                return Err(ApiError::new(
                    ErrorCode::SandboxFailed,
                    format!("the sandbox could not be started: {e}"),
                ));
            }
        };
        self.live_insert(&sandbox);
        match AgentConn::connect(&sandbox.socket, Duration::from_secs(10)).await {
            Ok(conn) => Ok((sandbox, conn)),
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "agent did not answer");
                Err(ApiError::new(
                    ErrorCode::SandboxFailed,
                    format!("the sandbox's agent did not answer: {e}"),
                ))
            }
        }
    }

    pub async fn make(
        self: &Arc<Self>,
        plan: &RunPlan,
        image: &Image,
    ) -> Result<(Arc<Sandbox>, AgentConn), ApiError> {
        let dir = self.sandboxes_dir().join(&plan.sandbox_id);
        let made = self
            .create(
                SandboxSpec {
                    id: plan.sandbox_id.clone(),
                    lowers: image.lowers.clone(),
                    dir: self.sandboxes_dir().join(&plan.sandbox_id),
                    hostname: plan.hostname.clone(),
                    limits: plan.limits,
                    tmp_memory: plan.tmp_memory,
                    // A run's sandbox ends with its command: nothing of it is kept.
                    scratch: true,
                    image_env: image.meta.env.clone(),
                    image_user: image.meta.user.clone(),
                    image_workdir: image.meta.workdir.clone(),
                    netns: None,
                    resolv_conf: plan.resolv_conf.clone(),
                    ca_bundle: None,
                    runtime: plan.runtime.clone(),
                    volumes: plan.volumes.clone(),
                },
                plan.network,
            )
            .await;
        // A run's sandbox that did not start (its init refused, e.g. a sysctl the sandbox does
        // not have) is in no table: its directory goes here. One that started is torn down
        // by the run.
        if made.is_err() && !self.live.locked().contains_key(&plan.sandbox_id) {
            remove_unstarted_dir(dir).await;
        }
        made
    }
}

/// Removes the directory of a sandbox the driver did not start (the driver leaves it to the
/// caller; in no table, nothing else removes it).
pub(crate) async fn remove_unstarted_dir(dir: std::path::PathBuf) {
    let _ = tokio::task::spawn_blocking(move || sbx_runtime::driver::remove_dir(&dir)).await;
}

/// How many ms until `expires_at` (RFC 3339, in the future; rounded up): 400 invalid_field
/// for another text, 400 expires_in_the_past for a time that has passed.
pub(crate) fn expires_in_ms(at: &str) -> Result<u64, ApiError> {
    let at_ns = sbx_api::parse_rfc3339(at).ok_or_else(|| {
        ApiError::invalid_field("expires_at", "expires_at is not an RFC 3339 time")
    })?;
    let left_ns = at_ns - crate::image::now_ns();
    if left_ns <= 0 {
        return Err(ApiError::new(
            ErrorCode::ExpiresInThePast,
            "expires_at is not in the future",
        )
        .with_param("expires_at"));
    }
    Ok((left_ns / 1_000_000) as u64 + 1)
}

impl Node {
    /// 503 no_capacity when the node holds its most sandboxes (runs' and kept ones), 503
    /// drive_full when its disk cannot promise one more; the caller holds the admission lock
    /// until its sandbox is counted.
    pub(crate) fn check_capacity(&self) -> Result<(), ApiError> {
        let held = self.sandbox_count() + self.kept_count();
        if held >= self.cfg.max_sandboxes {
            return Err(ApiError::new(
                ErrorCode::NoCapacity,
                format!(
                    "the node holds {held} sandboxes, its most (max_sandboxes {})",
                    self.cfg.max_sandboxes
                ),
            ));
        }
        // 503 drive_full past what the node's disk may promise (volume.rs).
        self.check_sandbox_disk()
    }
}

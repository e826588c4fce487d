//! A sandbox's `runtime` (issue #16) on the node: the create's or run's settings, kept in
//! sbx-api's canonical form ([`sbx_api::Runtime::to_value`]) in the sandbox's spec, turned
//! into what init applies ([`sbx_runtime::rtset::RuntimeSettings`]) and shown in the sandbox
//! object. What they change of the machine (limits, sysctls, tmpfs, /dev/shm) keeps such a
//! sandbox off the warm pool, and makes its template a template of its own: the runtime is
//! part of the template's settings, so its key.

use serde_json::Value;

use sbx_api::run::Runtime;
use sbx_runtime::rtset::{Resource, Rlimit, RuntimeSettings, Tmpfs};

/// The runtime of a spec's value (`None`: none given, or nothing in it). The value was
/// checked when the request was parsed; one that no longer parses counts as none.
pub fn parse(v: Option<&Value>) -> Option<Runtime> {
    let v = v.filter(|v| !v.is_null())?;
    match Runtime::parse(v) {
        Ok(rt) if !rt.is_empty() => Some(rt),
        Ok(_) => None,
        Err(e) => {
            tracing::error!(error = %e.message, "a stored runtime that does not parse");
            None
        }
    }
}

/// As the sandbox object shows it; null: none.
pub fn shown(v: Option<&Value>) -> Option<Value> {
    parse(v).map(|rt| rt.shown())
}

/// The part of a template's settings (so of its key): the canonical runtime; `None`: none.
pub fn template_part(v: Option<&Value>) -> Option<Value> {
    parse(v).map(|rt| rt.to_value())
}

/// Whether sysctls of the network namespace are written.
pub fn sets_net_sysctls(v: Option<&Value>) -> bool {
    settings(v).sets_net_sysctls()
}

/// The ulimits against what this node can give: a hard limit above its ceiling
/// ([`Resource::ceiling`]: a node without CAP_SYS_RESOURCE gives at most its own) is 400
/// invalid_field naming the limit.
pub fn check_on_node(v: Option<&Value>) -> Result<(), sbx_api::ApiError> {
    for l in settings(v).rlimits {
        if let Some(max) = l.resource.ceiling() {
            if l.hard.is_none_or(|h| h > max) {
                let name = l.resource.name();
                return Err(sbx_api::ApiError::invalid_field(
                    format!("runtime.ulimits.{name}"),
                    format!("runtime.ulimits.{name}: a hard limit of at most {max} on this node"),
                ));
            }
        }
    }
    Ok(())
}

/// What init applies: the commands' limits (-1: none), the sysctls, the tmpfs mounts and
/// /dev/shm's size.
pub fn settings(v: Option<&Value>) -> RuntimeSettings {
    let Some(rt) = parse(v) else {
        return RuntimeSettings::default();
    };
    let limit = |n: i64| u64::try_from(n).ok();
    RuntimeSettings {
        rlimits: rt
            .ulimits
            .iter()
            .filter_map(|(name, l)| {
                Some(Rlimit {
                    resource: Resource::from_name(name)?,
                    soft: limit(l.soft),
                    hard: limit(l.hard),
                })
            })
            .collect(),
        sysctls: rt.sysctls.into_iter().collect(),
        tmpfs: rt
            .tmpfs
            .into_iter()
            .map(|t| Tmpfs {
                path: t.path,
                size_bytes: t.size_bytes,
                mode: t.mode,
            })
            .collect(),
        shm_size_bytes: rt.shm_size_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_init_is_told() {
        let v = Runtime::parse(&json!({
            "ulimits": {"nofile": {"soft": 100, "hard": 200}, "core": -1},
            "sysctls": {"net.ipv4.ip_unprivileged_port_start": 80, "kernel.shmmni": "100"},
            "tmpfs": ["/run", {"path": "/cache", "size_bytes": 1048576, "mode": 448}],
            "shm_size_bytes": 2097152
        }))
        .unwrap()
        .to_value();
        let s = settings(Some(&v));
        assert_eq!(
            s.rlimits,
            vec![
                Rlimit {
                    resource: Resource::Core,
                    soft: None,
                    hard: None
                },
                Rlimit {
                    resource: Resource::Nofile,
                    soft: Some(100),
                    hard: Some(200)
                },
            ]
        );
        assert_eq!(
            s.sysctls,
            vec![
                ("kernel.shmmni".to_string(), "100".to_string()),
                ("net.ipv4.ip_unprivileged_port_start".into(), "80".into()),
            ]
        );
        assert!(s.sets_net_sysctls());
        assert_eq!(s.tmpfs[1].mode, 0o700);
        assert_eq!(s.shm_size_bytes, Some(2 << 20));
        assert!(parse(Some(&v)).unwrap().changes_machine());
        assert_eq!(shown(Some(&v)).unwrap()["dns"]["servers"], json!([]));
    }

    #[test]
    fn none_empty_and_dns_alone() {
        assert_eq!(settings(None), RuntimeSettings::default());
        assert_eq!(shown(Some(&Value::Null)), None);
        let empty = Runtime::parse(&json!({})).unwrap().to_value();
        assert_eq!(shown(Some(&empty)), None);
        assert_eq!(template_part(Some(&empty)), None);
        let dns = Runtime::parse(&json!({"dns": {"search": ["example.com"]}}))
            .unwrap()
            .to_value();
        assert!(!parse(Some(&dns)).unwrap().changes_machine());
        assert!(settings(Some(&dns)).is_empty());
        assert!(template_part(Some(&dns)).is_some());
    }
}

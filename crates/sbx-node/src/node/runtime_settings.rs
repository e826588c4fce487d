//! A sandbox's `runtime` (issue #16) on the node: the create's or run's settings, kept as
//! sbx-api's [`Runtime`] (written in its canonical form) in the sandbox's spec, turned
//! into what init applies ([`sbx_runtime::rtset::RuntimeSettings`]) and shown in the sandbox
//! object. What they change of the machine (limits, sysctls, tmpfs, /dev/shm) keeps such a
//! sandbox off the warm pool, and makes its template a template of its own: the runtime is
//! part of the template's settings, so its key.

use serde_json::Value;

use sbx_api::run::Runtime;
use sbx_runtime::rtset::{Resource, Rlimit, RuntimeSettings, Tmpfs};

/// The runtime of a request (`runtime` of a run or a create, checked and in its canonical
/// form when it was parsed); `None`: not given.
pub(crate) fn of_request(v: Option<&Value>) -> Result<Option<Runtime>, sbx_api::ApiError> {
    v.filter(|v| !v.is_null()).map(Runtime::parse).transpose()
}

/// The runtime that says something (`None`: none given, or nothing in it).
fn given(rt: Option<&Runtime>) -> Option<&Runtime> {
    rt.filter(|rt| !rt.is_empty())
}

/// As the sandbox object shows it; null: none.
pub(crate) fn shown(rt: Option<&Runtime>) -> Option<Value> {
    given(rt).map(Runtime::shown)
}

/// The part of a template's settings (so of its key); `None`: none.
pub(crate) fn template_part(rt: Option<&Runtime>) -> Option<Runtime> {
    given(rt).cloned()
}

/// Whether sysctls of the network namespace are written.
pub(crate) fn sets_net_sysctls(rt: Option<&Runtime>) -> bool {
    settings(rt).sets_net_sysctls()
}

/// The ulimits against what this node can give: a hard limit above its ceiling
/// ([`Resource::ceiling`]: a node without CAP_SYS_RESOURCE gives at most its own) is 400
/// invalid_field naming the limit.
pub(crate) fn check_on_node(rt: Option<&Runtime>) -> Result<(), sbx_api::ApiError> {
    for l in settings(rt).rlimits {
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

/// A kept runtime (of a sandbox's spec, a template's settings) as it is read back: one that no
/// longer parses counts as none, not as a row that cannot be read.
pub(crate) fn read_kept<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Runtime>, D::Error> {
    let v: Option<Value> = serde::Deserialize::deserialize(d)?;
    Ok(
        match v.filter(|v| !v.is_null()).map(|v| Runtime::parse(&v)) {
            None => None,
            Some(Ok(rt)) => Some(rt),
            Some(Err(e)) => {
                tracing::error!(error = %e.message, "a stored runtime that does not parse");
                None
            }
        },
    )
}

/// What init applies: the commands' limits (-1: none), the sysctls, the tmpfs mounts and
/// /dev/shm's size.
pub(crate) fn settings(rt: Option<&Runtime>) -> RuntimeSettings {
    let Some(rt) = given(rt).cloned() else {
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
        let v = json!({
            "ulimits": {"nofile": {"soft": 100, "hard": 200}, "core": -1},
            "sysctls": {"net.ipv4.ip_unprivileged_port_start": 80, "kernel.shmmni": "100"},
            "tmpfs": ["/run", {"path": "/cache", "size_bytes": 1048576, "mode": 448}],
            "shm_size_bytes": 2097152
        });
        let rt = of_request(Some(&v)).unwrap();
        let s = settings(rt.as_ref());
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
        assert!(sets_net_sysctls(rt.as_ref()));
        assert_eq!(s.tmpfs[1].mode, 0o700);
        assert_eq!(s.shm_size_bytes, Some(2 << 20));
        assert!(template_part(rt.as_ref()).unwrap().changes_machine());
        assert_eq!(shown(rt.as_ref()).unwrap()["dns"]["servers"], json!([]));
    }

    #[test]
    fn none_empty_and_dns_alone() {
        assert_eq!(settings(None), RuntimeSettings::default());
        assert_eq!(of_request(Some(&Value::Null)).unwrap(), None);
        let empty = of_request(Some(&json!({}))).unwrap();
        assert!(empty.is_some());
        assert_eq!(shown(empty.as_ref()), None);
        assert_eq!(template_part(empty.as_ref()), None);
        let dns = of_request(Some(&json!({"dns": {"search": ["example.com"]}}))).unwrap();
        assert!(!template_part(dns.as_ref()).unwrap().changes_machine());
        assert!(settings(dns.as_ref()).is_empty());
        assert!(!sets_net_sysctls(dns.as_ref()));
        assert!(of_request(Some(&json!({"ulimits": {"nope": 1}}))).is_err());
    }

    #[derive(serde::Deserialize)]
    struct Kept {
        #[serde(default, deserialize_with = "read_kept")]
        runtime: Option<Runtime>,
    }

    #[test]
    fn a_kept_runtime_that_no_longer_parses_is_none() {
        let rt = of_request(Some(&json!({"ulimits": {"nofile": 64}}))).unwrap();
        let text = serde_json::json!({ "runtime": rt }).to_string();
        let k: Kept = serde_json::from_str(&text).unwrap();
        assert_eq!(k.runtime, rt);
        let k: Kept = serde_json::from_str(r#"{"runtime": {"ulimits": {"nope": 1}}}"#).unwrap();
        assert_eq!(k.runtime, None);
        let k: Kept = serde_json::from_str(r#"{"runtime": null}"#).unwrap();
        assert_eq!(k.runtime, None);
        let k: Kept = serde_json::from_str("{}").unwrap();
        assert_eq!(k.runtime, None);
    }
}

//! The tests of the other fields, one by one.

use super::*;
use crate::ids::RESERVED_NAME_PREFIXES;

#[test]
fn egress_shapes() {
    let bad = |e: Value| field_err(json!({ "egress": e }));
    assert_eq!(bad(json!([])), is(InvalidEgress, "egress"));
    assert_eq!(
        bad(json!({"default": "maybe"})),
        is(InvalidEgress, "egress.default")
    );
    assert_eq!(
        bad(json!({"allow": "x"})),
        is(InvalidEgress, "egress.allow")
    );
    assert_eq!(
        bad(json!({"inject": {}})),
        is(InvalidEgress, "egress.inject")
    );
    assert_eq!(bad(json!({"rules": []})), is(InvalidEgress, "egress.rules"));
    assert_eq!(
        bad(json!({"deny_ports": [22, 0]})),
        is(InvalidEgress, "egress.deny_ports[1]")
    );
    let many: Vec<u16> = (1..=65).collect();
    assert_eq!(
        bad(json!({ "deny_ports": many })),
        is(InvalidEgress, "egress.deny_ports")
    );
    let r = ok(with(
        json!({"egress": {"default": null, "deny_ports": null}}),
    ));
    assert!(r.egress.is_some());
    assert_eq!(ok(with(json!({"egress": null}))).egress, None);
}

#[test]
fn simple_enums_and_flags() {
    assert_eq!(field_err(json!({"tmp": "ram"})), is(InvalidField, "tmp"));
    assert_eq!(field_err(json!({"tmp": 1})), is(InvalidField, "tmp"));
    assert_eq!(
        field_err(json!({"init": "openrc"})),
        is(InvalidField, "init")
    );
    assert_eq!(
        ok(with(json!({"init": "systemd"}))).init,
        Some(Init::Systemd)
    );
    assert_eq!(
        field_err(json!({"guest_mitigations": 1})),
        is(InvalidField, "guest_mitigations")
    );
    assert_eq!(
        field_err(json!({"project_network": "true"})),
        is(InvalidField, "project_network")
    );
    assert_eq!(
        field_err(json!({"runtime": 1})),
        is(InvalidField, "runtime")
    );
    assert_eq!(
        field_err(json!({"runtime": {"ulimits": []}})),
        is(InvalidField, "runtime.ulimits")
    );
    assert_eq!(
        field_err(json!({"runtime": {"tmpfs": {}}})),
        is(InvalidField, "runtime.tmpfs")
    );
    assert_eq!(
        field_err(json!({"runtime": {"shm_size_bytes": 1}})),
        is(InvalidField, "runtime.shm_size_bytes")
    );
    assert_eq!(
        field_err(json!({"on_expiry": "pause"})),
        is(InvalidField, "on_expiry")
    );
    assert_eq!(
        ok(with(json!({"on_expiry": "sleep"}))).on_expiry,
        OnExpiry::Sleep
    );
    assert_eq!(
        field_err(json!({"held_asleep": 0})),
        is(InvalidField, "held_asleep")
    );
    assert_eq!(
        field_err(json!({"stream": "yes"})),
        is(InvalidField, "stream")
    );
    assert_eq!(
        field_err(json!({"wait_for_reader": 1})),
        is(InvalidField, "wait_for_reader")
    );
    assert_eq!(ok(with(json!({"stream": true}))).stream, Some(true));
}

#[test]
fn images_and_sources() {
    assert_eq!(field_err(json!({"image": ""})), is(InvalidImage, "image"));
    assert_eq!(
        field_err(json!({"image": "a b"})),
        is(InvalidImage, "image")
    );
    assert_eq!(
        field_err(json!({"image": "a\tb"})),
        is(InvalidImage, "image")
    );
    assert_eq!(
        field_err(json!({"image": "x".repeat(513)})),
        is(InvalidImage, "image")
    );
    assert_eq!(field_err(json!({"image": 5})), is(InvalidField, "image"));
    ok(with(json!({"image": "x".repeat(512)})));
    ok(with(json!({"image": "ghcr.io/org/app@sha256:abc"})));
    assert_eq!(
        field_err(json!({"image": "a", "image_pull_secret": ""})),
        is(InvalidField, "image_pull_secret")
    );
    assert_eq!(
        field_err(json!({"image": "a", "image_pull_secret": "x".repeat(129)})),
        is(InvalidField, "image_pull_secret")
    );
    assert_eq!(
        field_err(json!({"snapshot": ""})),
        is(InvalidField, "snapshot")
    );
    assert_eq!(
        field_err(json!({"template": 1})),
        is(InvalidField, "template")
    );
    let r = ok(with(json!({"snapshot": "snap-0123456789abcdef"})));
    assert_eq!(r.snapshot.as_deref(), Some("snap-0123456789abcdef"));
    let r = ok(with(json!({"template": "base"})));
    assert_eq!(r.template.as_deref(), Some("base"));
}

#[test]
fn limits() {
    let lim = |l: Value| field_err(json!({ "limits": l }));
    assert_eq!(lim(json!(2)), is(InvalidField, "limits"));
    assert_eq!(
        lim(json!({"disk_bytes": 1073741824u64})),
        is(InvalidField, "limits.disk_bytes")
    );
    assert_eq!(lim(json!({"vcpus": 0})), is(InvalidField, "limits.vcpus"));
    assert_eq!(lim(json!({"vcpus": 33})), is(InvalidField, "limits.vcpus"));
    assert_eq!(lim(json!({"vcpus": 1.5})), is(InvalidField, "limits.vcpus"));
    assert_eq!(lim(json!({"vcpus": "2"})), is(InvalidField, "limits.vcpus"));
    assert_eq!(
        lim(json!({"memory_bytes": 134217728u64 - 2097152})),
        is(InvalidField, "limits.memory_bytes")
    );
    assert_eq!(
        lim(json!({"memory_bytes": 285u64 << 20})),
        is(InvalidField, "limits.memory_bytes")
    );
    assert_eq!(
        lim(json!({"memory_bytes": (256u64 << 20) + 1})),
        is(InvalidField, "limits.memory_bytes")
    );
    assert_eq!(
        lim(json!({"memory_bytes": -1})),
        is(InvalidField, "limits.memory_bytes")
    );
    let r = ok(with(
        json!({"limits": {"vcpus": 32, "memory_bytes": 134217728u64}}),
    ));
    assert_eq!(
        r.limits,
        Limits {
            vcpus: Some(32),
            memory_bytes: Some(128 << 20)
        }
    );
    let r = ok(with(
        json!({"limits": {"vcpus": null, "memory_bytes": 286u64 << 20}}),
    ));
    assert_eq!(r.limits.vcpus, None);
    assert_eq!(r.limits.memory_bytes, Some(286 << 20));
}

#[test]
fn names() {
    assert_eq!(field_err(json!({"name": "Web"})), is(InvalidName, "name"));
    assert_eq!(field_err(json!({"name": ""})), is(InvalidName, "name"));
    assert_eq!(field_err(json!({"name": "-a"})), is(InvalidName, "name"));
    assert_eq!(field_err(json!({"name": "a-"})), is(InvalidName, "name"));
    assert_eq!(
        field_err(json!({"name": "a".repeat(64)})),
        is(InvalidName, "name")
    );
    for p in RESERVED_NAME_PREFIXES {
        assert_eq!(
            field_err(json!({"name": format!("{p}web")})),
            is(InvalidName, "name")
        );
    }
    assert_eq!(field_err(json!({"name": 1})), is(InvalidField, "name"));
    assert_eq!(
        ok(with(json!({"name": "snapshot-1"}))).name.as_deref(),
        Some("snapshot-1")
    );
}

#[test]
fn env_rules() {
    let env = |e: Value| field_err(json!({ "env": e }));
    assert_eq!(env(json!({"": "x"})), is(InvalidEnv, "env."));
    assert_eq!(env(json!({"A=B": "x"})), is(InvalidEnv, "env.A=B"));
    assert_eq!(env(json!({"A\u{0}": "x"})), is(InvalidEnv, "env.A\u{0}"));
    assert_eq!(env(json!({"FOO": "a\u{0}b"})), is(InvalidEnv, "env.FOO"));
    assert_eq!(env(json!({"FOO": 1})), is(InvalidEnv, "env.FOO"));
    assert_eq!(env(json!({"FOO": null})), is(InvalidEnv, "env.FOO"));
    assert_eq!(env(json!(["FOO=1"])), is(InvalidField, "env"));
    let r = ok(with(json!({"env": {"B": "2", "A": "1"}})));
    let keys: Vec<&str> = r.env.keys().map(String::as_str).collect();
    assert_eq!(keys, ["A", "B"]);
}

#[test]
fn secret_env_rules() {
    assert_eq!(
        field_err(json!({"env": {"TOKEN": "a"}, "secret_env": {"TOKEN": "b"}})),
        is(InvalidField, "secret_env.TOKEN")
    );
    assert_eq!(
        field_err(json!({"secret_env": {"A=B": "x"}})),
        is(InvalidEnv, "secret_env.A=B")
    );
    assert_eq!(
        field_err(json!({"secret_env": {"A": 1}})),
        is(InvalidEnv, "secret_env.A")
    );
    assert_eq!(
        field_err(json!({"secret_env": "x"})),
        is(InvalidField, "secret_env")
    );
    let e = parse_run_request(
        with(json!({"env": {"K": "a"}, "secret_env": {"K": "topsecret"}}))
            .to_string()
            .as_bytes(),
    )
    .unwrap_err();
    assert!(!e.message.contains("topsecret"));
    let r = ok(with(json!({"env": {"A": "1"}, "secret_env": {"B": "2"}})));
    assert_eq!(r.secret_env.0.get("B").map(String::as_str), Some("2"));
}

#[test]
fn metadata_rules() {
    let md = |m: Value| field_err(json!({ "metadata": m }));
    let mut many = serde_json::Map::new();
    for i in 0..65 {
        many.insert(format!("k{i}"), json!("v"));
    }
    assert_eq!(
        md(Value::Object(many.clone())),
        is(InvalidMetadata, "metadata")
    );
    many.remove("k0");
    assert_eq!(ok(with(json!({ "metadata": many }))).metadata.len(), 64);
    assert_eq!(md(json!({"": "v"})), is(InvalidMetadata, "metadata."));
    let long_key = "k".repeat(65);
    assert_eq!(
        md(json!({ long_key.clone(): "v" })),
        is(InvalidMetadata, &format!("metadata.{long_key}"))
    );
    ok(with(
        json!({"metadata": { "k".repeat(64): "v".repeat(1024) }}),
    ));
    ok(with(
        json!({"metadata": { "é".repeat(64): "é".repeat(1024) }}),
    ));
    assert_eq!(
        md(json!({"k": "v".repeat(1025)})),
        is(InvalidMetadata, "metadata.k")
    );
    assert_eq!(md(json!({"k": 1})), is(InvalidMetadata, "metadata.k"));
    assert_eq!(md(json!({"k": null})), is(InvalidMetadata, "metadata.k"));
    assert_eq!(md(json!("k=v")), is(InvalidField, "metadata"));
}

#[test]
fn volumes() {
    let vols = |v: Value| field_err(json!({ "volumes": v }));
    assert_eq!(vols(json!({})), is(InvalidField, "volumes"));
    assert_eq!(vols(json!(["v"])), is(InvalidField, "volumes[0]"));
    for bad in ["data", "/", "//", "/./", "/a/../b", "", "/a\u{0}"] {
        assert_eq!(
            vols(json!([{"path": bad, "volume": "v"}])),
            is(InvalidPath, "volumes[0].path"),
            "{bad:?}"
        );
    }
    assert_eq!(
        vols(json!([{"path": "/a", "volume": "v"}, {"path": "rel", "volume": "w"}])),
        is(InvalidPath, "volumes[1].path")
    );
    assert_eq!(
        vols(json!([{"volume": "v"}])),
        is(InvalidField, "volumes[0].path")
    );
    assert_eq!(
        vols(json!([{"path": 1, "volume": "v"}])),
        is(InvalidField, "volumes[0].path")
    );
    assert_eq!(
        vols(json!([{"path": "/a"}])),
        is(InvalidField, "volumes[0].volume")
    );
    assert_eq!(
        vols(json!([{"path": "/a", "volume": ""}])),
        is(InvalidField, "volumes[0].volume")
    );
    assert_eq!(
        vols(json!([{"path": "/a", "volume": "v", "read_only": "yes"}])),
        is(InvalidField, "volumes[0].read_only")
    );
    assert_eq!(
        vols(json!([{"path": "/a", "volume": "v", "copy": 1}])),
        is(InvalidField, "volumes[0].copy")
    );
    assert_eq!(
        vols(json!([{"path": "/a", "volume": "v", "version": "x"}])),
        is(InvalidField, "volumes[0].version")
    );
    let r = ok(with(json!({"volumes": [
        {"path": "/data/", "volume": "db", "copy": true, "version": {"name": "x"}}
    ]})));
    assert_eq!(
        r.volumes,
        vec![VolumeMount {
            path: "/data/".into(),
            volume: "db".into(),
            read_only: false,
            copy: true,
            version: Some(json!({"name": "x"})),
        }]
    );
}

#[test]
fn ports() {
    assert_eq!(
        field_err(json!({"public_ports": [80, 0]})),
        is(InvalidField, "public_ports[1]")
    );
    assert_eq!(
        field_err(json!({"public_ports": [65536]})),
        is(InvalidField, "public_ports[0]")
    );
    assert_eq!(
        field_err(json!({"public_ports": 80})),
        is(InvalidField, "public_ports")
    );
    assert_eq!(
        field_err(json!({"public_ports_except": ["80"]})),
        is(InvalidField, "public_ports_except[0]")
    );
    assert_eq!(
        ok(with(json!({"public_ports_except": [49983, 49983]}))).public_ports_except,
        Some(vec![49983])
    );
    assert_eq!(
        field_err(json!({"inbound": {}})),
        is(InvalidField, "inbound")
    );
}

#[test]
fn sleep_and_expiry_fields() {
    let f = |k: &str, v: Value| {
        let mut m = serde_json::Map::new();
        m.insert(k.to_owned(), v);
        field_err(Value::Object(m))
    };
    assert_eq!(
        f("sleep_after_seconds", json!(0.5)),
        is(InvalidField, "sleep_after_seconds")
    );
    assert_eq!(
        f("sleep_after_seconds", json!(1e9 + 1.0)),
        is(InvalidField, "sleep_after_seconds")
    );
    assert_eq!(
        f("sleep_after_seconds", json!("30")),
        is(InvalidField, "sleep_after_seconds")
    );
    assert_eq!(
        ok(with(json!({"sleep_after_seconds": 1.5}))).sleep_after_seconds,
        Some(Some(1.5))
    );
    for bad in [json!("tomorrow"), json!("2030-01-01"), json!(1_900_000_000)] {
        assert_eq!(f("expires_at", bad), is(InvalidField, "expires_at"));
    }
    // A time in the past is the node's to refuse (expires_in_the_past).
    assert_eq!(
        ok(with(json!({"expires_at": "2000-01-01T00:00:00.5+01:00"})))
            .expires_at
            .as_deref(),
        Some("2000-01-01T00:00:00.5+01:00")
    );
    assert_eq!(
        f("sleep_notice_ms", json!(60_001)),
        is(InvalidField, "sleep_notice_ms")
    );
    assert_eq!(
        f("sleep_notice_ms", json!(-1)),
        is(InvalidField, "sleep_notice_ms")
    );
    assert_eq!(
        f("sleep_hold_max_ms", json!(900_001)),
        is(InvalidField, "sleep_hold_max_ms")
    );
    assert_eq!(
        f("suspend_after_ms", json!(999)),
        is(InvalidField, "suspend_after_ms")
    );
    assert_eq!(
        f("suspend_after_ms", json!(86_400_001)),
        is(InvalidField, "suspend_after_ms")
    );
    assert_eq!(
        f("delete_after_idle_ms", json!(999)),
        is(InvalidField, "delete_after_idle_ms")
    );
    for bad in ["24:00", "9:00", "12:60", "12:5", "12-00", "1200"] {
        assert_eq!(
            f("wake_daily_at", json!(bad)),
            is(InvalidField, "wake_daily_at"),
            "{bad}"
        );
    }
    for good in ["00:00", "19:59", "23:59", "20:30"] {
        ok(with(json!({ "wake_daily_at": good })));
    }
    assert_eq!(f("checkpoint", json!(true)), is(InvalidField, "checkpoint"));
}

#[test]
fn hostnames() {
    for bad in ["", "-a", "a-", "A", "a..b", ".a", "a.", "a_b"] {
        assert_eq!(
            field_err(json!({ "hostname": bad })),
            is(InvalidField, "hostname"),
            "{bad:?}"
        );
    }
    assert_eq!(
        field_err(json!({"hostname": "a".repeat(64)})),
        is(InvalidField, "hostname")
    );
    for good in ["a", "web-1", "a.b-c.d", &"a".repeat(63)] {
        ok(with(json!({ "hostname": good })));
    }
}

#[test]
fn cwd_and_user() {
    assert_eq!(field_err(json!({"cwd": "srv"})), is(InvalidField, "cwd"));
    assert_eq!(field_err(json!({"cwd": ""})), is(InvalidField, "cwd"));
    assert_eq!(field_err(json!({"cwd": 1})), is(InvalidField, "cwd"));
    assert_eq!(ok(with(json!({"cwd": "/"}))).cwd.as_deref(), Some("/"));
    assert_eq!(field_err(json!({"user": ""})), is(InvalidField, "user"));
    assert_eq!(
        field_err(json!({"user": "u".repeat(65)})),
        is(InvalidField, "user")
    );
    assert_eq!(field_err(json!({"user": 0})), is(InvalidField, "user"));
    ok(with(json!({"user": "u".repeat(64)})));
    ok(with(json!({"user": "root"})));
}

#[test]
fn timeouts() {
    for bad in [
        json!(0),
        json!(-1),
        json!(1e9 + 1.0),
        json!("300"),
        json!(true),
    ] {
        assert_eq!(
            field_err(json!({ "timeout_seconds": bad })),
            is(InvalidField, "timeout_seconds")
        );
    }
    assert_eq!(
        ok(with(json!({"timeout_seconds": 1e9}))).timeout,
        std::time::Duration::from_secs(1_000_000_000)
    );
    assert_eq!(
        ok(with(json!({"timeout_seconds": 5}))).timeout,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(
        ok(with(json!({"timeout_seconds": 0.001}))).timeout,
        std::time::Duration::from_millis(1)
    );
    // Rounded up to whole milliseconds: never shorter than asked.
    assert_eq!(
        ok(with(json!({"timeout_seconds": 0.0015}))).timeout,
        std::time::Duration::from_millis(2)
    );
}

#[test]
fn stdin_and_encoding() {
    let r = ok(with(json!({"stdin": "héllo\n"})));
    assert_eq!(r.stdin, Some("héllo\n".as_bytes().to_vec()));
    assert_eq!(r.encoding, Encoding::Utf8);
    let r = ok(with(json!({"stdin": "AAEC/w==", "encoding": "base64"})));
    assert_eq!(r.stdin, Some(vec![0, 1, 2, 255]));
    let r = ok(with(json!({"stdin": "AAEC/w", "encoding": "base64"})));
    assert_eq!(r.stdin, Some(vec![0, 1, 2, 255]));
    let r = ok(with(json!({"stdin": "", "encoding": "base64"})));
    assert_eq!(r.stdin, Some(vec![]));
    for bad in ["!!!", "AAEC/w=", "a", "aGk= ", "aGk=\n"] {
        assert_eq!(
            field_err(json!({"stdin": bad, "encoding": "base64"})),
            is(InvalidField, "stdin"),
            "{bad:?}"
        );
    }
    assert_eq!(field_err(json!({"stdin": 1})), is(InvalidField, "stdin"));
    assert_eq!(
        field_err(json!({"encoding": "hex"})),
        is(InvalidField, "encoding")
    );
    assert_eq!(
        field_err(json!({"encoding": "UTF8"})),
        is(InvalidField, "encoding")
    );
    assert_eq!(ok(with(json!({"encoding": "base64"}))).stdin, None);
}

#[test]
fn encoding_helpers() {
    assert_eq!(Encoding::Base64.encode(&[0, 1, 2, 255]), "AAEC/w==");
    assert_eq!(Encoding::Utf8.encode(b"a\xffb"), "a\u{fffd}b");
    assert_eq!(Encoding::Utf8.decode("x"), Some(b"x".to_vec()));
    assert_eq!(Encoding::Base64.decode("x"), None);
    assert_eq!(Encoding::Base64.as_str(), "base64");
    assert_eq!(Encoding::Utf8.as_str(), "utf8");
    assert_eq!(serde_json::to_value(Encoding::Utf8).unwrap(), json!("utf8"));
    assert_eq!(
        serde_json::from_value::<Encoding>(json!("base64")).unwrap(),
        Encoding::Base64
    );
}

#[test]
fn regions() {
    assert_eq!(ok(with(json!({"region": "na"}))).region, Some(Region::Na));
    assert_eq!(ok(with(json!({"region": "ap"}))).region, Some(Region::Ap));
    assert_eq!(ok(with(json!({"region": null}))).region, None);
    assert_eq!(
        field_err(json!({"region": "us"})),
        is(UnknownRegion, "region")
    );
    assert_eq!(field_err(json!({"region": 1})), is(InvalidField, "region"));
}

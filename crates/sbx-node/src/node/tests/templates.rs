//! Templates: creates of the same settings wait on one build; a failed build fails its
//! waiters; a build whose sandbox is deleted is built again; builds ahead keep no sandbox.

use super::*;
use crate::node::templates;

/// A create whose template is built once its ready check passes: when the world's gate
/// `built` opens.
const GATED: &str = r#"{"start":true,"ready":{"command":"gate built"}}"#;

fn template_status(node: &Node, key: &str) -> Option<(String, Option<String>)> {
    templates::get(&node.store, key)
        .expect("templates")
        .map(|t| (t.status, t.failure_code))
}

fn machine_of(node: &Node, id: &str) -> bool {
    node.managed(id).expect("a sandbox").machine().is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_of_one_template_wait_on_one_build() {
    let dir = TempDir::new("tplwait");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, GATED).await.expect("the first");
    let b = create(&node, GATED).await.expect("the second");
    assert_eq!(
        (a.status, b.status),
        (SandboxStatus::Starting, SandboxStatus::Starting)
    );
    let key = a.template.clone().expect("a template");
    assert_eq!(
        b.template.as_deref(),
        Some(key.as_str()),
        "the same settings"
    );
    assert_ne!(key, templates::BASE);
    assert_eq!(
        template_status(&node, &key),
        Some(("building".into(), None))
    );
    until("the builder's machine runs", || machine_of(&node, &a.id)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        world.creates(),
        1,
        "the second waits for the build, making nothing"
    );
    assert!(!machine_of(&node, &b.id));

    world.open_gate("built");
    until("both run", || {
        state(&node, &a.id).0 == SandboxStatus::Running
            && state(&node, &b.id).0 == SandboxStatus::Running
    })
    .await;
    until("the template is ready", || {
        template_status(&node, &key) == Some(("ready".into(), None))
    })
    .await;
    assert_eq!(
        world.creates(),
        2,
        "the waiter's own machine, from the template"
    );
    // A create of a built template is answered once it runs.
    let c = create(&node, GATED).await.expect("the third");
    assert_eq!(c.status, SandboxStatus::Running);
    assert_eq!(world.creates(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_build_fails_every_sandbox_that_waits_on_it() {
    let dir = TempDir::new("tplfail");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    // The start command ends with 3 once `go` opens, before the check ever passes.
    let body = r#"{"start_command":"await go 3","ready":{"command":"gate never"}}"#;
    let a = create(&node, body).await.expect("the first");
    let b = create(&node, body).await.expect("the second");
    let key = a.template.clone().expect("a template");
    until("the builder's machine runs", || machine_of(&node, &a.id)).await;
    world.open_gate("go");
    until("both fail", || {
        state(&node, &a.id).0 == SandboxStatus::Failed
            && state(&node, &b.id).0 == SandboxStatus::Failed
    })
    .await;
    assert_eq!(state(&node, &a.id).1.as_deref(), Some("boot_failed"));
    assert_eq!(state(&node, &b.id).1.as_deref(), Some("boot_failed"));
    let m = node.managed(&b.id).expect("b");
    let why = node.sandbox_object(&m).failure.unwrap_or_default();
    assert!(why.contains("its template did not build"), "{why}");
    let m = node.managed(&a.id).expect("a");
    let why = node.sandbox_object(&m).failure.unwrap_or_default();
    assert!(why.contains("exit code 3"), "{why}");
    assert_eq!(
        template_status(&node, &key),
        Some(("failed".into(), Some("boot_failed".into())))
    );
    assert_eq!(world.creates(), 1, "the waiter made nothing");
    until("the builder's machine is ended", || world.destroys() == 1).await;
    assert!(world.alive().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_deleted_while_it_starts_stops_waiting_at_once() {
    let dir = TempDir::new("tplcancel");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, GATED).await.expect("create");
    assert_eq!(a.status, SandboxStatus::Starting);
    let key = a.template.clone().expect("a template");
    until("its machine runs", || machine_of(&node, &a.id)).await;
    let t0 = Instant::now();
    let d = node.delete_sandbox(&a.id).await.expect("delete");
    assert_eq!(d.status, SandboxStatus::Deleted);
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "the ready check stops at once: {:?}",
        t0.elapsed()
    );
    assert!(node.managed(&a.id).is_err());
    assert!(world.alive().is_empty() && dir_gone(dir.path(), &a.id));
    assert_eq!(
        template_status(&node, &key).map(|t| t.1),
        Some(Some(templates::CANCELLED.into())),
        "its build is cancelled"
    );
    // The next create of the settings builds the template again.
    let b = create(&node, GATED).await.expect("again");
    assert_eq!(b.status, SandboxStatus::Starting);
    assert_eq!(
        template_status(&node, &key).map(|t| t.0),
        Some("building".into())
    );
    world.open_gate("built");
    until("it runs", || {
        state(&node, &b.id).0 == SandboxStatus::Running
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_builder_is_deleted_builds_the_template_itself() {
    let dir = TempDir::new("tplrebuild");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, GATED).await.expect("the builder");
    let b = create(&node, GATED).await.expect("a waiter");
    until("the builder's machine runs", || machine_of(&node, &a.id)).await;
    node.delete_sandbox(&a.id)
        .await
        .expect("delete the builder");
    until("the waiter builds", || machine_of(&node, &b.id)).await;
    assert_eq!(state(&node, &b.id).0, SandboxStatus::Starting);
    assert_eq!(world.creates(), 2);
    let key = b.template.clone().expect("a template");
    let built_by = templates::get(&node.store, &key)
        .expect("templates")
        .and_then(|t| t.built_by);
    assert_eq!(built_by.as_deref(), Some(b.id.as_str()));
    world.open_gate("built");
    until("it runs", || {
        state(&node, &b.id).0 == SandboxStatus::Running
    })
    .await;
    // The template's row is marked ready as its build ends, just after the sandbox runs.
    until("the template is ready", || {
        template_status(&node, &key).is_some_and(|t| t.0 == "ready")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_built_ahead_keeps_no_sandbox_and_serves_creates_that_name_it() {
    let dir = TempDir::new("tplahead");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let c = sbx_api::parse_sandbox_create(GATED.as_bytes()).expect("create");
    let (done, obj) = node.build_template(c).await.expect("build");
    assert!(!done, "building: {obj:?}");
    assert_eq!(obj.status, "building");
    assert_eq!(obj.built_by.get().map(String::is_empty), Some(false));
    let key = obj.key.clone();
    let builder = node.list_sandboxes(&super::kept::list_all()).0;
    assert_eq!(
        builder.len(),
        1,
        "the build's sandbox is listed while it builds"
    );
    assert_eq!(
        builder[0].metadata.get("sbx.template_build"),
        Some(&key),
        "as what it is"
    );
    world.open_gate("built");
    until("the build's sandbox is deleted once built", || {
        node.list_sandboxes(&super::kept::list_all()).0.is_empty()
    })
    .await;
    // The template's row is marked ready as its build ends, just after the sandbox runs.
    until("the template is ready", || {
        template_status(&node, &key).is_some_and(|t| t.0 == "ready")
    })
    .await;
    until("its machine is ended", || world.alive().is_empty()).await;

    let again = sbx_api::parse_sandbox_create(GATED.as_bytes()).expect("create");
    let (done, _) = node.build_template(again).await.expect("built");
    assert!(done, "built already: nothing made");
    assert_eq!(world.creates(), 1);
    let s = create(&node, &format!(r#"{{"template":"{key}"}}"#))
        .await
        .expect("a create of the template");
    assert_eq!(
        (s.status, s.template.as_deref()),
        (SandboxStatus::Running, Some(key.as_str()))
    );
    assert_eq!(world.creates(), 2);
    let e = create(&node, r#"{"template":"img-nosuchtemplate00"}"#)
        .await
        .expect_err("an unknown template");
    assert_eq!(e.code, sbx_api::ErrorCode::TemplateNotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_deleted_while_it_waits_goes_at_once_and_the_build_goes_on() {
    let dir = TempDir::new("tplwaitdel");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, GATED).await.expect("the builder");
    let b = create(&node, GATED).await.expect("a waiter");
    until("the builder's machine runs", || machine_of(&node, &a.id)).await;
    let t0 = Instant::now();
    node.delete_sandbox(&b.id).await.expect("delete the waiter");
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    assert!(node.managed(&b.id).is_err());
    assert_eq!(world.creates(), 1, "the waiter never made a machine");
    world.open_gate("built");
    until("the builder runs", || {
        state(&node, &a.id).0 == SandboxStatus::Running
    })
    .await;
    let key = a.template.clone().expect("a template");
    // The template's row is marked ready as its build ends, just after the sandbox runs.
    until("the template is ready", || {
        template_status(&node, &key).is_some_and(|t| t.0 == "ready")
    })
    .await;
}

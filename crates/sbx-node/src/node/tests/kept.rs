//! Kept sandboxes: names, capacity, the exec cap, command ids, agents that die, restarts,
//! deletes, machines that do not start.

use super::*;
use sbx_api::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_name_is_unique_until_its_sandbox_is_deleted() {
    let dir = TempDir::new("names");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, r#"{"name":"web"}"#).await.expect("the first");
    assert_eq!(a.status, SandboxStatus::Running);
    assert_eq!(node.managed("web").expect("by its name").id, a.id);

    let e = create(&node, r#"{"name":"web"}"#)
        .await
        .expect_err("a second sandbox of the name");
    assert_eq!(
        (e.code, e.param.as_deref()),
        (ErrorCode::NameTaken, Some("name"))
    );
    let e = node
        .plan_run(run_request(r#"{"command":"true","name":"web"}"#))
        .err()
        .expect("a run of a kept sandbox's name");
    assert_eq!(e.code, ErrorCode::NameTaken);
    assert_eq!(world.creates(), 1, "a refused create makes nothing");

    node.delete_sandbox("web")
        .await
        .expect("deleted by its name");
    let b = create(&node, r#"{"name":"web"}"#)
        .await
        .expect("the name is free once its sandbox is deleted");
    assert_ne!(a.id, b.id);

    // Creates of one name at once: one has it.
    let creates: Vec<_> = (0..6)
        .map(|_| {
            let node = node.clone();
            tokio::spawn(async move { create(&node, r#"{"name":"race"}"#).await })
        })
        .collect();
    let mut named = 0;
    for c in creates {
        match c.await.expect("a create") {
            Ok(_) => named += 1,
            Err(e) => assert_eq!(e.code, ErrorCode::NameTaken),
        }
    }
    assert_eq!(named, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_sandboxes_counts_runs_and_kept_sandboxes() {
    let dir = TempDir::new("cap");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.max_sandboxes = 2);
    let kept = create(&node, "{}").await.expect("the first");
    let plan = node
        .plan_run(run_request(r#"{"command":"echo hi"}"#))
        .expect("the second: a run");
    // A run holds its place from its plan on.
    let e = create(&node, "{}").await.expect_err("a third");
    assert_eq!(e.code, ErrorCode::NoCapacity);
    let e = node
        .plan_run(run_request(r#"{"command":"true"}"#))
        .err()
        .expect("a third, as a run");
    assert_eq!(e.code, ErrorCode::NoCapacity);

    let (exit, out, _) = ended(&run_plan(&node, plan).await);
    assert_eq!((exit.exit_code, out.as_str()), (0, "hi\n"));
    assert_eq!(node.sandbox_count(), 0, "a run's place is free at its end");
    let second = create(&node, "{}").await.expect("in the run's place");
    let e = create(&node, "{}").await.expect_err("two kept");
    assert_eq!(e.code, ErrorCode::NoCapacity);
    // A failed sandbox holds its place until it is deleted.
    assert!(world.kill_agent(&second.id));
    until("the lost agent fails its sandbox", || {
        state(&node, &second.id).0 == SandboxStatus::Failed
    })
    .await;
    let e = create(&node, "{}").await.expect_err("a failed one counts");
    assert_eq!(e.code, ErrorCode::NoCapacity);
    node.delete_sandbox(&kept.id).await.expect("delete");
    create(&node, "{}")
        .await
        .expect("in the deleted one's place");
    assert_eq!(world.creates(), 4, "refusals make nothing");
}

/// Creates and runs that come at once cannot both take the last place: the check and the
/// entry are one step.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_sandboxes_holds_for_creates_and_runs_that_come_at_once() {
    for _ in 0..3 {
        let dir = TempDir::new("capkept");
        let world = World::new();
        let node = node_in(dir.path(), &world, |c| c.max_sandboxes = 2);
        let creates: Vec<_> = (0..8)
            .map(|_| {
                let node = node.clone();
                tokio::spawn(async move { create(&node, "{}").await })
            })
            .collect();
        let mut made = 0;
        for c in creates {
            match c.await.expect("a create") {
                Ok(_) => made += 1,
                Err(e) => assert_eq!(e.code, ErrorCode::NoCapacity),
            }
        }
        assert_eq!(made, 2, "kept sandboxes made at once");
        assert_eq!(world.creates(), 2);
    }
    let dir = TempDir::new("capruns");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.max_sandboxes = 2);
    for _ in 0..10 {
        let start = Arc::new(std::sync::Barrier::new(8));
        let plans: Vec<_> = (0..8)
            .map(|_| {
                let (node, start) = (node.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    node.plan_run(run_request(r#"{"command":"true"}"#))
                        .map(|p| p.sandbox_id.clone())
                })
            })
            .collect();
        let mut planned = Vec::new();
        for p in plans {
            match p.join().expect("a plan") {
                Ok(id) => planned.push(id),
                Err(e) => assert_eq!(e.code, ErrorCode::NoCapacity),
            }
        }
        assert_eq!(planned.len(), 2, "runs planned at once");
        for id in planned {
            node.release(&id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exec_cap_refuses_the_next_command_and_a_command_that_ends_frees_its_slot() {
    let dir = TempDir::new("execcap");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.max_execs_per_sandbox = 2);
    let s = create(&node, "{}").await.expect("create");
    let one = exec(&node, &s.id, r#"{"command":"await one"}"#)
        .await
        .expect("the first command");
    assert_exec(&one, ExecStatus::Running, None);
    exec(&node, &s.id, r#"{"command":"await two"}"#)
        .await
        .expect("the second");
    let e = exec(&node, &s.id, r#"{"command":"true"}"#)
        .await
        .expect_err("a third at once");
    assert_eq!(e.code, ErrorCode::TooManyCommands);
    assert_eq!(
        node.running_execs(&s.id),
        2,
        "a refused command takes no slot"
    );

    world.open_gate("one");
    let o = node
        .exec_get(&s.id, &one.id, 2.0, Encoding::Utf8)
        .await
        .expect("the first command's end");
    assert_exec(&o, ExecStatus::Exited, Some(0));
    // At once: its end may not be recorded yet (its watcher frees its slot), the agent knows it.
    let three = exec(&node, &s.id, r#"{"command":"echo ok","wait_seconds":2}"#)
        .await
        .expect("the first one's slot is free");
    assert_exec(&three, ExecStatus::Exited, Some(0));
    assert_eq!(three.stdout, "ok\n");
    assert_exec(
        &exec_get(&node, &s.id, &one.id).await,
        ExecStatus::Exited,
        Some(0),
    );
    exec(&node, &s.id, r#"{"command":"await three"}"#)
        .await
        .expect("the waited command gave its slot back");
    let e = exec(&node, &s.id, r#"{"command":"true"}"#)
        .await
        .expect_err("full again");
    assert_eq!(e.code, ErrorCode::TooManyCommands);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_id_given_twice_is_refused_and_the_first_keeps_its_slot() {
    let dir = TempDir::new("execid");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, "{}").await.expect("create");
    let id = "exe-0123456789abcdef".to_string();
    let req = |c: &str| sbx_api::parse_exec_request(c.as_bytes()).expect("exec");
    let first = node
        .exec(&s.id, req(r#"{"command":"await go"}"#), Some(id.clone()))
        .await
        .expect("the first");
    assert_eq!(first.id, id);
    let e = node
        .exec(&s.id, req(r#"{"command":"true"}"#), Some(id.clone()))
        .await
        .expect_err("the same id again");
    assert_eq!(e.code, ErrorCode::IdempotencyKeyReused);
    assert_eq!(
        node.running_execs(&s.id),
        1,
        "the first command keeps its slot"
    );
    assert_exec(
        &exec_get(&node, &s.id, &id).await,
        ExecStatus::Running,
        None,
    );
    world.open_gate("go");
    until("the command's end frees its slot", || {
        node.running_execs(&s.id) == 0
    })
    .await;
    let e = node
        .exec(&s.id, req(r#"{"command":"true"}"#), Some(id.clone()))
        .await
        .expect_err("an ended command's id");
    assert_eq!(e.code, ErrorCode::IdempotencyKeyReused);
    assert_eq!(
        node.running_execs(&s.id),
        0,
        "a refused command takes no slot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_dies_fails_its_sandbox_at_once() {
    let dir = TempDir::new("agentlost");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, "{}").await.expect("create");
    let cmd = exec(&node, &s.id, r#"{"command":"await never"}"#)
        .await
        .expect("a command");
    assert!(world.kill_agent(&s.id));
    until("the sandbox fails", || {
        state(&node, &s.id).0 == SandboxStatus::Failed
    })
    .await;
    assert_eq!(state(&node, &s.id).1.as_deref(), Some("agent_lost"));
    until("its machine is ended", || {
        world.destroys() == 1 && dir_gone(dir.path(), &s.id)
    })
    .await;
    // Its command ended with it, recorded as killed.
    let o = exec_get(&node, &s.id, &cmd.id).await;
    assert_eq!(o.status, ExecStatus::Killed, "{o:?}");
    assert_eq!(node.running_execs(&s.id), 0);
    let e = exec(&node, &s.id, r#"{"command":"true"}"#)
        .await
        .expect_err("a command in a failed sandbox");
    assert_eq!(e.code, ErrorCode::SandboxNotRunning);
    // A failed sandbox can be restarted: a new machine.
    let r = node.restart_sandbox(&s.id).await.expect("restart");
    assert_eq!((r.status, r.restarts), (SandboxStatus::Running, 1));
    assert_eq!(world.creates(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_makes_a_new_machine_and_records_the_old_ones_commands() {
    let dir = TempDir::new("restart");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, r#"{"name":"r"}"#).await.expect("create");
    let cmd = exec(&node, &s.id, r#"{"command":"await never"}"#)
        .await
        .expect("a command");
    let r = node.restart_sandbox("r").await.expect("restart");
    assert_eq!((r.status, r.restarts), (SandboxStatus::Running, 1));
    assert_eq!((world.creates(), world.destroys()), (2, 1));
    assert_eq!(world.alive().len(), 1, "the old machine is ended");
    let o = exec_get(&node, &s.id, &cmd.id).await;
    assert_eq!(
        o.status,
        ExecStatus::Killed,
        "ended with its machine: {o:?}"
    );
    assert_eq!(node.running_execs(&s.id), 0);
    let o = exec(&node, &s.id, r#"{"command":"echo again","wait_seconds":2}"#)
        .await
        .expect("a command of the new boot");
    assert_eq!(o.stdout, "again\n");
    // The agent of the new machine is the one watched.
    assert!(world.kill_agent(&s.id));
    until("the new agent's end fails it", || {
        state(&node, &s.id).1.as_deref() == Some("agent_lost")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_ends_the_machine_and_frees_everything() {
    let dir = TempDir::new("delete");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, r#"{"name":"d","start_command":"sleep 30"}"#)
        .await
        .expect("create");
    assert_eq!(s.status, SandboxStatus::Running);
    let t0 = Instant::now();
    let d = node.delete_sandbox(&s.id).await.expect("delete");
    assert_eq!(d.status, SandboxStatus::Deleted);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "the start command ends at its stop signal, not its grace"
    );
    assert!(world.alive().is_empty() && dir_gone(dir.path(), &s.id));
    let e = node.delete_sandbox(&s.id).await.expect_err("deleted");
    assert_eq!(e.code, ErrorCode::SandboxNotFound);
    assert!(node.list_sandboxes(&list_all()).0.is_empty());
    assert!(node.store.sandboxes().expect("rows").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_that_does_not_start_fails_its_sandbox() {
    let dir = TempDir::new("nostart");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    world.fail_next_creates(1);
    let s = create(&node, r#"{"name":"f"}"#).await.expect("answered");
    assert_eq!(
        (s.status, s.failure_code.as_deref()),
        (SandboxStatus::Failed, Some("boot_failed"))
    );
    let e = create(&node, r#"{"name":"f"}"#).await.expect_err("named");
    assert_eq!(
        e.code,
        ErrorCode::NameTaken,
        "a failed sandbox keeps its name"
    );
    let r = node.restart_sandbox("f").await.expect("restart");
    assert_eq!(r.status, SandboxStatus::Running, "boots again");
    node.delete_sandbox("f").await.expect("delete");
    create(&node, r#"{"name":"f"}"#).await.expect("free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_filter_by_status_and_metadata() {
    let dir = TempDir::new("list");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let a = create(&node, r#"{"metadata":{"team":"a"}}"#)
        .await
        .expect("a");
    let b = create(&node, r#"{"metadata":{"team":"b"}}"#)
        .await
        .expect("b");
    assert!(world.kill_agent(&b.id));
    until("b fails", || state(&node, &b.id).0 == SandboxStatus::Failed).await;
    let ids = |q: &crate::node::sandbox::ListQuery| -> Vec<String> {
        node.list_sandboxes(q).0.into_iter().map(|o| o.id).collect()
    };
    assert_eq!(
        ids(&list_all()),
        [a.id.clone(), b.id.clone()],
        "oldest first"
    );
    let mut q = list_all();
    q.status = Some(SandboxStatus::Running);
    assert_eq!(ids(&q), [a.id.as_str()]);
    let mut q = list_all();
    q.metadata = vec![("team".into(), "b".into())];
    assert_eq!(ids(&q), [b.id.as_str()]);
    let mut q = list_all();
    q.limit = 1;
    let (page, next) = node.list_sandboxes(&q);
    assert_eq!(page[0].id, a.id);
    q.cursor = next;
    assert_eq!(ids(&q), [b.id.as_str()], "the next page");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_is_deleted_when_it_expires() {
    let dir = TempDir::new("expiry");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let at = expires_in(60);
    let s = create(&node, &format!(r#"{{"name":"brief","expires_at":"{at}"}}"#))
        .await
        .expect("create");
    assert_eq!(
        (s.status, s.expires_at.as_deref()),
        (SandboxStatus::Running, Some(at.as_str()))
    );
    until("it is deleted", || node.managed(&s.id).is_err()).await;
    assert!(world.alive().is_empty() && dir_gone(dir.path(), &s.id));
    create(&node, r#"{"name":"brief"}"#)
        .await
        .expect("its name is free");
    let e = create(
        &node,
        &format!(r#"{{"expires_at":"{}"}}"#, expires_in(-1000)),
    )
    .await
    .expect_err("in the past");
    assert_eq!(e.code, ErrorCode::ExpiresInThePast);
}

pub(super) fn list_all() -> crate::node::sandbox::ListQuery {
    crate::node::sandbox::ListQuery {
        limit: 100,
        ..Default::default()
    }
}

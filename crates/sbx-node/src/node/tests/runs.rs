//! One-shot runs, the warm pool, a stopping node.

use super::*;
use crate::node::output::ExitStatus;
use sbx_api::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_answers_its_command_and_ends_its_sandbox() {
    let dir = TempDir::new("run");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let plan = node
        .plan_run(run_request(r#"{"command":"echo hi","name":"job"}"#))
        .expect("plan");
    let id = plan.sandbox_id.clone();
    let events = run_plan(&node, plan).await;
    assert!(
        matches!(events.first(), Some(RunEvent::Started { .. })),
        "{events:?}"
    );
    let (exit, out, _) = ended(&events);
    assert_eq!(
        (exit.status, exit.exit_code, out.as_str()),
        (ExitStatus::Exited, 0, "hi\n")
    );
    assert_eq!(node.sandbox_count(), 0);
    let again = node
        .plan_run(run_request(r#"{"command":"true","name":"job"}"#))
        .expect("the name is free once the run has ended");
    node.release(&again.sandbox_id);

    let (exit, _, err) = ended(&run(&node, r#"{"command":"nosuch"}"#).await);
    assert_eq!(exit.exit_code, 127);
    assert!(err.contains("nosuch: command not found"), "{err}");
    let (exit, _, _) = ended(&run(&node, r#"{"command":["exit","3"]}"#).await);
    assert_eq!(exit.exit_code, 3);
    let (exit, _, _) = ended(&run(&node, r#"{"command":"sleep 30","timeout_seconds":0.02}"#).await);
    assert_eq!(exit.status, ExitStatus::TimedOut);
    until("every run's machine is ended", || {
        world.alive().is_empty() && node.pending_teardowns() == 0
    })
    .await;
    assert_eq!((world.creates(), world.destroys()), (4, 4));
    assert!(dir_gone(dir.path(), &id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_caller_hangs_up_ends_its_sandbox() {
    let dir = TempDir::new("hangup");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let plan = node
        .plan_run(run_request(r#"{"command":"await never","name":"gone"}"#))
        .expect("plan");
    let (tx, mut rx) = mpsc::channel(8);
    let task = tokio::spawn(node.clone().run(plan, tx));
    assert!(matches!(rx.recv().await, Some(RunEvent::Started { .. })));
    drop(rx);
    task.await.expect("the run ends");
    until("its machine is ended", || world.destroys() == 1).await;
    assert!(world.alive().is_empty());
    assert_eq!(node.sandbox_count(), 0);
    node.plan_run(run_request(r#"{"command":"true","name":"gone"}"#))
        .expect("its name is free");
}

async fn run(node: &Arc<Node>, body: &str) -> Vec<RunEvent> {
    let plan = node.plan_run(run_request(body)).expect("plan");
    run_plan(node, plan).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_pool_fills_to_its_target_and_no_further() {
    let dir = TempDir::new("warmfill");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.warm_pool = 2);
    node.refill();
    until("the pool is full", || node.warm_ids().len() == 2).await;
    node.refill();
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(node.warm_ids().len(), 2);
    assert_eq!(world.creates(), 2, "no more than its target");
    assert_eq!(node.sandbox_count(), 0, "warm sandboxes are no runs");
    assert!(node.list_sandboxes(&super::kept::list_all()).0.is_empty());
    stop(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_base_run_takes_a_warm_sandbox_that_never_goes_back_and_the_pool_refills() {
    let dir = TempDir::new("warmrun");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.warm_pool = 1);
    node.refill();
    until("the pool is full", || node.warm_ids().len() == 1).await;
    let warm = node.warm_ids()[0].clone();

    let plan = node
        .plan_run(run_request(r#"{"command":"echo warm"}"#))
        .expect("plan");
    assert_eq!(plan.sandbox_id, warm, "the run takes the warm sandbox");
    let (exit, out, _) = ended(&run_plan(&node, plan).await);
    assert_eq!((exit.exit_code, out.as_str()), (0, "warm\n"));
    until("the pool refills with another", || {
        node.warm_ids().len() == 1 && node.warm_ids()[0] != warm
    })
    .await;
    until("the used one is ended", || world.destroys() == 1).await;
    assert!(
        !world.alive().contains(&warm),
        "a used sandbox never goes back"
    );
    assert_eq!(world.creates(), 2, "the run made no machine of its own");

    // A run the warm sandbox cannot serve (another hostname) makes its own.
    let warm2 = node.warm_ids()[0].clone();
    let plan = node
        .plan_run(run_request(r#"{"command":"true","hostname":"other"}"#))
        .expect("plan");
    assert_ne!(plan.sandbox_id, warm2);
    ended(&run_plan(&node, plan).await);
    assert_eq!(world.creates(), 3);
    assert_eq!(node.warm_ids(), [warm2.as_str()]);

    // A kept sandbox of the base image in the default shape takes it too; another shape not.
    let kept = create(&node, "{}").await.expect("create");
    assert_eq!(kept.id, warm2);
    until("the pool refills", || node.warm_ids().len() == 1).await;
    assert_eq!(world.creates(), 4);
    let big = create(&node, r#"{"limits":{"vcpus":2}}"#)
        .await
        .expect("create");
    assert!(!node.warm_ids().contains(&big.id));
    assert_eq!(world.creates(), 5);
    // The kept one that was warm is watched as any other.
    assert!(world.kill_agent(&kept.id));
    until("it fails", || {
        state(&node, &kept.id).1.as_deref() == Some("agent_lost")
    })
    .await;
    stop(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_take_the_warm_sandboxes_made_for_runs_and_creates_the_others() {
    let dir = TempDir::new("warmkinds");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| {
        c.warm_pool = 1;
        c.warm_runs = 1;
    });
    node.refill();
    until("both pools are full", || node.warm_ids().len() == 2).await;
    let kinds = |ids: &[String]| -> (Vec<String>, Vec<String>) {
        ids.iter().cloned().partition(|id| world.made_scratch(id))
    };
    let (runs, kept) = kinds(&node.warm_ids());
    assert_eq!((runs.len(), kept.len()), (1, 1), "one of each kind");

    // A run takes the one made as a run's own.
    let plan = node
        .plan_run(run_request(r#"{"command":"echo warm"}"#))
        .expect("plan");
    assert_eq!(plan.sandbox_id, runs[0]);
    let (exit, out, _) = ended(&run_plan(&node, plan).await);
    assert_eq!((exit.exit_code, out.as_str()), (0, "warm\n"));
    until("the runs' pool refills", || {
        let (r, k) = kinds(&node.warm_ids());
        r.len() == 1 && r[0] != runs[0] && k == kept
    })
    .await;

    // A kept sandbox never takes one made for runs (it could not be checkpointed).
    let (runs, _) = kinds(&node.warm_ids());
    let made = create(&node, "{}").await.expect("create");
    assert_eq!(made.id, kept[0], "the create takes the kept kind");
    assert!(!world.made_scratch(&made.id));
    until("the kept pool refills", || node.warm_ids().len() == 2).await;
    assert!(node.warm_ids().contains(&runs[0]), "the runs' one stays");

    // With none made for runs left, a run makes its own: the kept kind is the creates'.
    let (runs, kept) = kinds(&node.warm_ids());
    let first = node
        .plan_run(run_request(r#"{"command":"true"}"#))
        .expect("plan");
    let second = node
        .plan_run(run_request(r#"{"command":"true"}"#))
        .expect("plan");
    assert_eq!(first.sandbox_id, runs[0]);
    assert_ne!(second.sandbox_id, kept[0]);
    assert_eq!(kinds(&node.warm_ids()), (vec![], kept.clone()));
    for plan in [first, second] {
        let (exit, _, _) = ended(&run_plan(&node, plan).await);
        assert_eq!(exit.exit_code, 0);
    }
    until("both pools refill", || {
        let (r, k) = kinds(&node.warm_ids());
        (r.len(), k.len()) == (1, 1)
    })
    .await;
    stop(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_that_does_not_start_leaves_no_directory() {
    let dir = TempDir::new("warmfail");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.warm_runs = 1);
    world.fail_next_creates(1);
    node.refill();
    // The refiller tries again a second later.
    until("the pool is full", || node.warm_ids().len() == 1).await;
    assert_eq!(world.creates(), 2);
    let dirs: Vec<String> = std::fs::read_dir(node.sandboxes_dir())
        .expect("the sandboxes' directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        dirs,
        node.warm_ids(),
        "the one that did not start left nothing"
    );
    stop(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_sandbox_found_dead_is_ended_and_the_next_one_serves() {
    let dir = TempDir::new("warmdead");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.warm_pool = 2);
    node.refill();
    until("the pool is full", || node.warm_ids().len() == 2).await;
    let ids = node.warm_ids();
    // The pool is taken from its end.
    assert!(world.kill_agent(&ids[1]));
    let plan = node
        .plan_run(run_request(r#"{"command":"echo ok"}"#))
        .expect("plan");
    assert_eq!(plan.sandbox_id, ids[0], "the live one");
    let (exit, _, _) = ended(&run_plan(&node, plan).await);
    assert_eq!(exit.exit_code, 0);
    assert!(dir_gone(dir.path(), &ids[1]), "the dead one is ended");
    stop(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_ends_warm_and_run_sandboxes_but_kept_ones_run_on() {
    let dir = TempDir::new("shutdown");
    let world = World::new();
    let node = node_in(dir.path(), &world, |c| c.warm_pool = 1);
    let kept = create(&node, "{}").await.expect("create");
    node.refill();
    until("the pool is full", || node.warm_ids().len() == 1).await;
    let plan = node
        .plan_run(run_request(r#"{"command":"await never"}"#))
        .expect("plan");
    let (tx, mut rx) = mpsc::channel(8);
    let task = tokio::spawn(node.clone().run(plan, tx));
    assert!(matches!(rx.recv().await, Some(RunEvent::Started { .. })));
    // The run took the warm sandbox; the pool refills.
    until("kept, run and warm sandboxes run", || {
        world.alive().len() == 3 && node.warm_ids().len() == 1
    })
    .await;

    node.shutdown().await;
    let last = rx.recv().await;
    assert!(
        matches!(&last, Some(RunEvent::Failed(e)) if e.code == ErrorCode::Unavailable),
        "the run is told the node stops: {last:?}"
    );
    task.await.expect("the run ends");
    assert_eq!(
        world.alive(),
        [kept.id.clone()].into_iter().collect(),
        "only the kept sandbox runs on, for the next node to adopt"
    );
    let e = create(&node, "{}").await.expect_err("stopping");
    assert_eq!(e.code, ErrorCode::Unavailable);
    let e = node
        .plan_run(run_request(r#"{"command":"true"}"#))
        .err()
        .expect("stopping");
    assert_eq!(e.code, ErrorCode::Unavailable);
}

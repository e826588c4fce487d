//! A node that starts again over its data directory: what runs is adopted (with its commands),
//! what was lost meanwhile is failed, what nobody keeps is removed.
//!
//! The first node runs on a runtime of its own, dropped without a shutdown: its tasks, its
//! connections and the node with them end as the process of a node killed would.

use std::collections::HashSet;

use super::*;
use sbx_api::ErrorCode;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Ends the first node as its process's end would (no shutdown).
fn kill_node(rt: tokio::runtime::Runtime, dir: &Path) {
    drop(rt);
    crate::agent::forget_idle_under(dir);
}

struct FirstRun {
    kept: String,
    lost: String,
    kept_cmd: String,
    lost_cmd: String,
    done_cmd: String,
    warm: String,
}

#[test]
fn a_restarted_node_adopts_running_sandboxes_and_fails_lost_ones() {
    let dir = TempDir::new("adopt");
    let world = World::new();
    let first = runtime();
    let r = first.block_on(async {
        let node = node_in(dir.path(), &world, |c| c.warm_pool = 1);
        let kept = create(&node, r#"{"name":"keep"}"#).await.expect("kept");
        let lost = create(&node, r#"{"name":"lose"}"#).await.expect("lost");
        let kept_cmd = exec(&node, &kept.id, r#"{"command":"await go"}"#)
            .await
            .expect("a command");
        let done_cmd = exec(
            &node,
            &kept.id,
            r#"{"command":"echo done","wait_seconds":2}"#,
        )
        .await
        .expect("an ended command");
        let lost_cmd = exec(&node, &lost.id, r#"{"command":"await go"}"#)
            .await
            .expect("a command");
        node.refill();
        until("the pool is full", || node.warm_ids().len() == 1).await;
        FirstRun {
            kept: kept.id,
            lost: lost.id,
            kept_cmd: kept_cmd.id,
            lost_cmd: lost_cmd.id,
            done_cmd: done_cmd.id,
            warm: node.warm_ids()[0].clone(),
        }
    });
    kill_node(first, dir.path());
    // While no node runs, one agent dies.
    assert!(world.kill_agent(&r.lost));

    let second = runtime();
    second.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        assert_eq!(node.recover(), (1, 1), "(adopted, lost)");
        assert_eq!(world.creates(), 3, "adopting makes nothing");
        assert_eq!(state(&node, &r.kept), (SandboxStatus::Running, None));
        assert_eq!(
            state(&node, &r.lost),
            (SandboxStatus::Failed, Some("agent_lost".into()))
        );
        // Names stay theirs.
        let e = create(&node, r#"{"name":"keep"}"#)
            .await
            .expect_err("named");
        assert_eq!(e.code, ErrorCode::NameTaken);
        let e = create(&node, r#"{"name":"lose"}"#)
            .await
            .expect_err("named");
        assert_eq!(e.code, ErrorCode::NameTaken);
        // The adopted sandbox's commands: the running one runs on, the ended one is recorded.
        assert_eq!(node.running_execs(&r.kept), 1);
        assert_exec(
            &exec_get(&node, &r.kept, &r.kept_cmd).await,
            ExecStatus::Running,
            None,
        );
        let done = exec_get(&node, &r.kept, &r.done_cmd).await;
        assert_exec(&done, ExecStatus::Exited, Some(0));
        assert_eq!(done.stdout, "done\n");
        // The lost one's command ended with its agent.
        let o = exec_get(&node, &r.lost, &r.lost_cmd).await;
        assert_eq!(o.status, ExecStatus::Killed, "{o:?}");
        assert!(dir_gone(dir.path(), &r.lost));

        // What the first node left that no one keeps (its warm sandbox) is removed.
        assert!(world.alive().contains(&r.warm));
        assert!(node.reconcile() >= 1);
        assert_eq!(world.alive(), HashSet::from([r.kept.clone()]));
        assert!(dir_gone(dir.path(), &r.warm));
        assert!(
            !dir_gone(dir.path(), &r.kept),
            "an adopted sandbox keeps its disk"
        );

        // The adopted command is watched: its end is recorded and its slot freed.
        world.open_gate("go");
        until("the adopted command's end", || {
            node.running_execs(&r.kept) == 0
        })
        .await;
        assert_exec(
            &exec_get(&node, &r.kept, &r.kept_cmd).await,
            ExecStatus::Exited,
            Some(0),
        );
        let o = exec(
            &node,
            &r.kept,
            r#"{"command":"echo more","wait_seconds":2}"#,
        )
        .await
        .expect("commands go on");
        assert_eq!(o.stdout, "more\n");
        // The adopted agent is watched too.
        assert!(world.kill_agent(&r.kept));
        until("its end fails it", || {
            state(&node, &r.kept).1.as_deref() == Some("agent_lost")
        })
        .await;
    });
}

#[test]
fn a_sandbox_of_a_stopped_node_is_adopted_by_the_next() {
    let dir = TempDir::new("adoptstop");
    let world = World::new();
    let first = runtime();
    let (id, cmd) = first.block_on(async {
        let node = node_in(dir.path(), &world, |c| c.warm_pool = 1);
        let s = create(&node, "{}").await.expect("create");
        let cmd = exec(&node, &s.id, r#"{"command":"await go"}"#)
            .await
            .expect("a command");
        node.refill();
        until("the pool is full", || node.warm_ids().len() == 1).await;
        node.shutdown().await;
        (s.id, cmd.id)
    });
    kill_node(first, dir.path());
    assert_eq!(
        world.alive(),
        HashSet::from([id.clone()]),
        "the warm one is ended"
    );

    let second = runtime();
    second.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        assert_eq!(node.recover(), (1, 0));
        assert_eq!(node.reconcile(), 0, "nothing left behind");
        assert_eq!(state(&node, &id).0, SandboxStatus::Running);
        world.open_gate("go");
        let o = node
            .exec_get(&id, &cmd, 2.0, Encoding::Utf8)
            .await
            .expect("the command");
        assert_exec(&o, ExecStatus::Exited, Some(0));
        node.delete_sandbox(&id).await.expect("delete");
        assert!(world.alive().is_empty());
    });
    assert_eq!(world.adopts(), 1);
}

#[test]
fn a_sandbox_deleted_meanwhile_by_hand_is_failed_and_its_leftovers_removed() {
    let dir = TempDir::new("adoptgone");
    let world = World::new();
    let first = runtime();
    let id = first.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        create(&node, "{}").await.expect("create").id
    });
    kill_node(first, dir.path());
    assert!(world.kill_agent(&id));
    let second = runtime();
    second.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        assert_eq!(node.recover(), (0, 1));
        assert_eq!(world.leftovers(), 1, "its leftovers are removed");
        // Starting again changes nothing: a failed sandbox is not lost twice.
        drop(node);
    });
    kill_node(second, dir.path());
    let third = runtime();
    third.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        assert_eq!(node.recover(), (0, 0));
        assert_eq!(state(&node, &id).1.as_deref(), Some("agent_lost"));
        let r = node
            .restart_sandbox(&id)
            .await
            .expect("a lost sandbox restarts");
        assert_eq!(r.status, SandboxStatus::Running);
    });
}

#[test]
fn an_expiry_is_armed_again_by_the_next_node() {
    let dir = TempDir::new("adoptexpiry");
    let world = World::new();
    let first = runtime();
    let id = first.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        let body = format!(r#"{{"expires_at":"{}"}}"#, expires_in(150));
        create(&node, &body).await.expect("create").id
    });
    kill_node(first, dir.path());
    let second = runtime();
    second.block_on(async {
        let node = node_in(dir.path(), &world, |_| {});
        assert_eq!(node.recover(), (1, 0));
        until("it expires under the next node", || {
            node.managed(&id).is_err()
        })
        .await;
        assert!(world.alive().is_empty());
    });
}

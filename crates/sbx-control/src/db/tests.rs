//! Tests of the store: every case runs on SQLite (a file in a fresh folder) and, where
//! `SBX_TEST_PG_URL` names a PostgreSQL server (scripts/postgres.sh), on PostgreSQL too, in a
//! database of its own made for the case and dropped after it.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use anyhow::{bail, ensure, Context};

use super::*;

pub(crate) type Case = fn(String) -> Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// Runs `case` with the URL of a fresh SQLite file, then with that of a fresh PostgreSQL
/// database (if `SBX_TEST_PG_URL` is set); each is removed after, whatever the case did.
pub(crate) async fn run_both(name: &str, case: Case) {
    let dir = std::env::temp_dir().join(format!("sbx-control-{}", sbx_api::ids::new_id("t")));
    let made = std::fs::create_dir_all(&dir);
    let result = match made {
        Ok(()) => case(format!("sqlite:{}", dir.join("control.db").display())).await,
        Err(e) => Err(anyhow::anyhow!("making {}: {e}", dir.display())),
    };
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        panic!("{name} on SQLite: {e:#}");
    }

    let Ok(admin_url) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!("{name}: SBX_TEST_PG_URL is not set: the PostgreSQL case was skipped");
        return;
    };
    if let Err(e) = on_postgres(&admin_url, case).await {
        panic!("{name} on PostgreSQL: {e:#}");
    }
}

async fn on_postgres(admin_url: &str, case: Case) -> anyhow::Result<()> {
    let dbname = format!("sbx_t_{}", &sbx_api::ids::new_id("x")[2..]);
    let admin = admin(admin_url).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {dbname}"))
        .await
        .context("CREATE DATABASE (the role needs CREATEDB)")?;
    let result = case(with_dbname(admin_url, &dbname)?).await;
    let dropped = admin
        .batch_execute(&format!("DROP DATABASE {dbname} WITH (FORCE)"))
        .await;
    result?;
    dropped.context("DROP DATABASE")?;
    Ok(())
}

async fn admin(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| "connecting to SBX_TEST_PG_URL")?;
    tokio::spawn(conn);
    Ok(client)
}

/// `url` with its database replaced by `dbname`.
fn with_dbname(url: &str, dbname: &str) -> anyhow::Result<String> {
    let Some(scheme_end) = url.find("://") else {
        bail!("SBX_TEST_PG_URL is not a URL");
    };
    let rest = &url[scheme_end + 3..];
    let (authority, query) = match rest.find(['/', '?']) {
        Some(i) => {
            let tail = &rest[i..];
            let query = tail.find('?').map_or("", |q| &tail[q..]);
            (&rest[..i], query)
        }
        None => (rest, ""),
    };
    Ok(format!(
        "{}://{authority}/{dbname}{query}",
        &url[..scheme_end]
    ))
}

macro_rules! both {
    ($test:ident, $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $test() {
            run_both(stringify!($test), |url| Box::pin($case(url))).await;
        }
    };
}

pub(crate) fn reg(name: &str) -> NodeReg {
    NodeReg {
        name: name.into(),
        url: format!("http://{name}.test:7700"),
        build: "b1".into(),
        capacity: Capacity {
            max_sandboxes: 10,
            sandboxes: 0,
            images: vec!["debian:12".into()],
        },
        e2b_url: None,
        preview_url: None,
        held: Vec::new(),
    }
}

pub(crate) fn sandbox(name: Option<&str>, node_id: &str) -> SandboxRow {
    SandboxRow {
        id: sbx_api::ids::new_id("sbx"),
        name: name.map(str::to_owned),
        node_id: node_id.into(),
        epoch: 1,
        status: "running".into(),
        build: "b1".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

pub(crate) fn a_move(sandbox_id: &str, from: &str, to: &str) -> MoveRow {
    MoveRow {
        id: new_move_id(),
        sandbox_id: sandbox_id.into(),
        from_node: from.into(),
        to_node: to.into(),
        epoch: 1,
        step: "releasing".into(),
        why: "operator".into(),
        wake: true,
        from_store: false,
        release: None,
        takeover: None,
        error: None,
        attempts: 0,
        next_attempt_at_ms: None,
        cancel: false,
        refusal: None,
        created_at_ms: 0,
        updated_at_ms: 0,
        ended_at_ms: None,
        batch: None,
    }
}

// ---- the cases ----

both!(register_twice_gives_the_same_id, case_register);
async fn case_register(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let before = db.now_ms().await?;
    let a1 = db.register_node(&reg("alpha"), 10_000).await?;
    let after = db.now_ms().await?;
    ensure!(sbx_api::ids::is_id(NODE_PREFIX, &a1.id), "id {}", a1.id);
    ensure!(a1.state == NodeState::Ready, "{:?}", a1.state);
    ensure!(a1.name == "alpha" && a1.url == "http://alpha.test:7700" && a1.build == "b1");
    ensure!(a1.capacity == reg("alpha").capacity, "{:?}", a1.capacity);
    ensure!(
        (before + 10_000..=after + 10_000).contains(&a1.lease_until_ms),
        "lease_until {} not in {}..={}",
        a1.lease_until_ms,
        before + 10_000,
        after + 10_000
    );
    ensure!((before..=after).contains(&a1.registered_at_ms));
    ensure!((before..=after).contains(&a1.heartbeat_at_ms));
    // One statement, one now.
    ensure!(a1.lease_until_ms - a1.heartbeat_at_ms == 10_000, "{a1:?}");
    ensure!(a1.registered_at_ms == a1.heartbeat_at_ms, "{a1:?}");

    let mut again = reg("alpha");
    again.url = "http://alpha.test:7800".into();
    again.build = "b2".into();
    again.capacity.sandboxes = 3;
    again.capacity.images.push("python:3".into());
    let a2 = db.register_node(&again, 10_000).await?;
    ensure!(a2.id == a1.id, "{} then {}", a1.id, a2.id);
    ensure!(a2.url == again.url && a2.build == "b2" && a2.capacity == again.capacity);

    let b = db.register_node(&reg("beta"), 10_000).await?;
    ensure!(b.id != a1.id);
    let nodes = db.nodes().await?;
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    ensure!(names == ["alpha", "beta"], "{names:?}");
    ensure!(nodes[0] == a2, "{:?} vs {:?}", nodes[0], a2);

    ensure!(db.node(&a1.id).await?.map(|n| n.name) == Some("alpha".into()));
    ensure!(db.node("beta").await?.map(|n| n.id) == Some(b.id.clone()));
    ensure!(db.node("gamma").await?.is_none());
    Ok(())
}

both!(heartbeat_of_an_unknown_node_is_not_found, case_heartbeat);
async fn case_heartbeat(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    match db.heartbeat(&new_node_id(), &reg("alpha"), 1000).await {
        Err(DbError::NotFound) => {}
        other => bail!("heartbeat of an unknown node: {other:?}"),
    }
    let a = db.register_node(&reg("alpha"), 1000).await?;
    let mut hb = reg("renamed");
    hb.url = "http://alpha.test:9".into();
    hb.capacity.sandboxes = 7;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let h = db.heartbeat(&a.id, &hb, 60_000).await?;
    ensure!(h.id == a.id && h.name == "alpha", "the name stays: {h:?}");
    ensure!(h.url == hb.url && h.capacity.sandboxes == 7);
    ensure!(h.lease_until_ms >= a.lease_until_ms + 59_000, "{h:?}");
    ensure!(h.heartbeat_at_ms > a.heartbeat_at_ms && h.registered_at_ms == a.registered_at_ms);
    ensure!(db.node("renamed").await?.is_none());
    Ok(())
}

both!(a_lease_runs_out_by_the_database_clock, case_lease);
async fn case_lease(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 200).await?;
    let b = db.register_node(&reg("beta"), 60_000).await?;
    ensure!(a.state == NodeState::Ready);
    // Until the database's clock passes the lease, the node is ready; after, lost.
    let mut saw_ready = false;
    loop {
        let now_before = db.now_ms().await?;
        let n = db.node(&a.id).await?.context("alpha is gone")?;
        let now_after = db.now_ms().await?;
        if now_after < n.lease_until_ms {
            ensure!(n.state == NodeState::Ready, "lost before its lease: {n:?}");
            saw_ready = true;
        } else if now_before > n.lease_until_ms {
            ensure!(
                n.state == NodeState::Lost,
                "not lost after its lease: {n:?}"
            );
            break;
        }
        ensure!(
            now_before < a.lease_until_ms + 5_000,
            "the lease never ran out"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(saw_ready, "never saw it ready");
    let states: Vec<(String, NodeState)> = db
        .nodes()
        .await?
        .into_iter()
        .map(|n| (n.name, n.state))
        .collect();
    ensure!(
        states
            == [
                ("alpha".to_owned(), NodeState::Lost),
                ("beta".to_owned(), NodeState::Ready)
            ],
        "{states:?}"
    );
    ensure!(b.lease_until_ms > a.lease_until_ms);
    // A heartbeat brings it back.
    let h = db.heartbeat(&a.id, &reg("alpha"), 60_000).await?;
    ensure!(h.state == NodeState::Ready, "{h:?}");
    Ok(())
}

both!(draining_is_set_and_cleared, case_draining);
async fn case_draining(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 60_000).await?;
    ensure!(db.set_draining(&a.id, true).await?);
    ensure!(db.node(&a.id).await?.map(|n| n.state) == Some(NodeState::Draining));
    // Registering again or a heartbeat does not clear it.
    let r = db.register_node(&reg("alpha"), 60_000).await?;
    ensure!(r.state == NodeState::Draining, "{r:?}");
    let h = db.heartbeat(&a.id, &reg("alpha"), 60_000).await?;
    ensure!(h.state == NodeState::Draining, "{h:?}");
    // Draining wins over lost.
    db.heartbeat(&a.id, &reg("alpha"), 0).await?;
    tokio::time::sleep(Duration::from_millis(5)).await;
    ensure!(db.node(&a.id).await?.map(|n| n.state) == Some(NodeState::Draining));
    ensure!(db.set_draining(&a.id, false).await?);
    ensure!(db.node(&a.id).await?.map(|n| n.state) == Some(NodeState::Lost));
    db.heartbeat(&a.id, &reg("alpha"), 60_000).await?;
    ensure!(db.node(&a.id).await?.map(|n| n.state) == Some(NodeState::Ready));
    ensure!(!db.set_draining(&new_node_id(), true).await?);
    Ok(())
}

both!(sandbox_names_are_unique_across_the_fleet, case_sandboxes);
async fn case_sandboxes(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 60_000).await?;
    let b = db.register_node(&reg("beta"), 60_000).await?;

    let before = db.now_ms().await?;
    let web = sandbox(Some("web"), &a.id);
    db.insert_sandbox(&web).await?;
    let after = db.now_ms().await?;
    let got = db.sandbox(&web.id).await?.context("web is not there")?;
    ensure!((before..=after).contains(&got.created_at_ms), "{got:?}");
    ensure!(got.updated_at_ms == got.created_at_ms);
    ensure!(
        SandboxRow {
            created_at_ms: 0,
            updated_at_ms: 0,
            ..got.clone()
        } == web
    );
    ensure!(db.sandbox_by_name("web").await? == Some(got.clone()));

    // Another node's sandbox may not take the name; the same id may not come twice.
    let other = sandbox(Some("web"), &b.id);
    match db.insert_sandbox(&other).await {
        Err(DbError::NameTaken { name }) if name == "web" => {}
        r => bail!("a second web: {r:?}"),
    }
    match db
        .insert_sandbox(&SandboxRow {
            name: Some("web2".into()),
            ..web.clone()
        })
        .await
    {
        Err(DbError::IdTaken { id }) if id == web.id => {}
        r => bail!("the same id twice: {r:?}"),
    }
    // No name, many times.
    let mut unnamed = Vec::new();
    for i in 0..5 {
        let s = sandbox(None, if i % 2 == 0 { &a.id } else { &b.id });
        db.insert_sandbox(&s).await?;
        unnamed.push(s.id);
    }
    // An unknown node.
    match db
        .insert_sandbox(&sandbox(Some("orphan"), &new_node_id()))
        .await
    {
        Err(DbError::UnknownReference(_)) => {}
        r => bail!("a sandbox on an unknown node: {r:?}"),
    }

    let all = db.sandboxes(None).await?;
    ensure!(all.len() == 6, "{}", all.len());
    let on_a = db.sandboxes(Some(&a.id)).await?;
    ensure!(on_a.len() == 4 && on_a.iter().all(|s| s.node_id == a.id));
    let order: Vec<&str> = on_a.iter().map(|s| s.id.as_str()).collect();
    let made: Vec<&str> = std::iter::once(web.id.as_str())
        .chain(unnamed.iter().step_by(2).map(String::as_str))
        .collect();
    ensure!(
        order == made,
        "in the order they were made: {order:?} vs {made:?}"
    );
    ensure!(db.sandboxes(Some(&new_node_id())).await?.is_empty());

    // Renames: taken, then freed.
    let second = &unnamed[1];
    match db.update_sandbox(second, None, Some(Some("web"))).await {
        Err(DbError::NameTaken { name }) if name == "web" => {}
        r => bail!("renamed onto web: {r:?}"),
    }
    ensure!(
        db.update_sandbox(&web.id, Some("sleeping"), Some(Some("api")))
            .await?
    );
    ensure!(db.update_sandbox(second, None, Some(Some("web"))).await?);
    let s2 = db.sandbox(second).await?.context("second is gone")?;
    ensure!(
        s2.name.as_deref() == Some("web") && s2.status == "running",
        "{s2:?}"
    );
    let w = db.sandbox(&web.id).await?.context("web is gone")?;
    ensure!(
        w.name.as_deref() == Some("api") && w.status == "sleeping",
        "{w:?}"
    );
    ensure!(w.updated_at_ms >= w.created_at_ms);
    // Status alone leaves the name; Some(None) clears it.
    ensure!(db.update_sandbox(&web.id, Some("running"), None).await?);
    ensure!(db.sandbox_by_name("api").await?.map(|s| s.status) == Some("running".into()));
    ensure!(db.update_sandbox(&web.id, None, Some(None)).await?);
    ensure!(db.sandbox(&web.id).await?.and_then(|s| s.name).is_none());
    ensure!(db.sandbox_by_name("api").await?.is_none());
    ensure!(
        !db.update_sandbox("sbx-0000000000000000", Some("x"), None)
            .await?
    );

    ensure!(db.delete_sandbox(second).await?);
    ensure!(!db.delete_sandbox(second).await?);
    ensure!(db.sandbox(second).await?.is_none());
    ensure!(db.sandbox_by_name("web").await?.is_none());
    db.insert_sandbox(&sandbox(Some("web"), &b.id)).await?;
    Ok(())
}

both!(the_owner_changes_only_by_compare_and_set, case_epoch_cas);
async fn case_epoch_cas(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 60_000).await?;
    let b = db.register_node(&reg("beta"), 60_000).await?;
    let c = db.register_node(&reg("gamma"), 60_000).await?;
    let s = sandbox(Some("counter"), &a.id);
    db.insert_sandbox(&s).await?;

    // 8 writers race from epoch 1 to 2, to two nodes: exactly one wins.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let db = db.clone();
        let id = s.id.clone();
        let to = if i % 2 == 0 {
            b.id.clone()
        } else {
            c.id.clone()
        };
        tasks.push(tokio::spawn(async move {
            let won = db.move_owner(&id, 1, &to, 2).await?;
            Ok::<_, DbError>((won, to))
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        let (won, to) = t.await??;
        if won {
            winners.push(to);
        }
    }
    ensure!(winners.len() == 1, "{} winners", winners.len());
    let row = db.sandbox(&s.id).await?.context("gone")?;
    ensure!(row.epoch == 2 && row.node_id == winners[0], "{row:?}");

    // A stale epoch loses; an epoch that does not go forward is refused.
    ensure!(!db.move_owner(&s.id, 1, &a.id, 3).await?);
    match db.move_owner(&s.id, 2, &a.id, 2).await {
        Err(DbError::Invalid(_)) => {}
        r => bail!("epoch 2 to 2: {r:?}"),
    }
    ensure!(db.move_owner(&s.id, 2, &a.id, 4).await?);
    let row = db.sandbox(&s.id).await?.context("gone")?;
    ensure!(row.epoch == 4 && row.node_id == a.id && row.name.as_deref() == Some("counter"));
    ensure!(!db.move_owner("sbx-0000000000000000", 1, &a.id, 2).await?);
    match db.move_owner(&s.id, 4, &new_node_id(), 5).await {
        Err(DbError::UnknownReference(_)) => {}
        r => bail!("to an unknown node: {r:?}"),
    }
    ensure!(db.sandbox(&s.id).await?.map(|r| r.epoch) == Some(4));
    Ok(())
}

both!(one_unfinished_move_per_sandbox, case_moves);
async fn case_moves(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 60_000).await?;
    let b = db.register_node(&reg("beta"), 60_000).await?;
    let s = sandbox(Some("mover"), &a.id);
    db.insert_sandbox(&s).await?;

    let before = db.now_ms().await?;
    let m1 = a_move(&s.id, &a.id, &b.id);
    db.insert_move(&m1).await?;
    let got = db.get_move(&m1.id).await?.context("m1 is not there")?;
    ensure!((before..).contains(&got.created_at_ms) && got.updated_at_ms == got.created_at_ms);
    ensure!(
        MoveRow {
            created_at_ms: 0,
            updated_at_ms: 0,
            ..got.clone()
        } == m1,
        "{got:?}"
    );
    ensure!(db.get_move(&new_move_id()).await?.is_none());

    let m2 = a_move(&s.id, &a.id, &b.id);
    match db.insert_move(&m2).await {
        Err(DbError::AlreadyMoving { move_id }) if move_id == m1.id => {}
        r => bail!("a second move: {r:?}"),
    }
    match db
        .insert_move(&MoveRow {
            step: "flying".into(),
            ..a_move(&s.id, &a.id, &b.id)
        })
        .await
    {
        Err(DbError::Invalid(_)) => {}
        r => bail!("a step of no move: {r:?}"),
    }
    match db
        .insert_move(&a_move("sbx-0000000000000000", &a.id, &b.id))
        .await
    {
        Err(DbError::UnknownReference(_)) => {}
        r => bail!("a move of no sandbox: {r:?}"),
    }
    ensure!(db
        .unfinished_moves()
        .await?
        .iter()
        .map(|m| &m.id)
        .eq([&m1.id]));

    // The step changes by compare-and-set.
    let mut next = MoveRow {
        step: "taking_over".into(),
        release: Some(r#"{"epoch":1}"#.into()),
        attempts: 2,
        next_attempt_at_ms: Some(before + 1000),
        error: Some(r#"{"code":"unavailable"}"#.into()),
        ..m1.clone()
    };
    ensure!(db.update_move(&next, "releasing").await?);
    ensure!(
        !db.update_move(&next, "releasing").await?,
        "a stale step won"
    );
    let got = db.get_move(&m1.id).await?.context("m1 is gone")?;
    ensure!(got.step == "taking_over" && got.release == next.release && got.attempts == 2);
    ensure!(got.next_attempt_at_ms == Some(before + 1000) && got.error == next.error);
    ensure!(got.updated_at_ms >= got.created_at_ms);
    ensure!(
        !db.update_move(
            &MoveRow {
                id: new_move_id(),
                ..next.clone()
            },
            "taking_over"
        )
        .await?
    );

    // 8 writers race the step from taking_over to done: exactly one wins.
    next.step = "done".into();
    next.error = None;
    next.next_attempt_at_ms = None;
    next.takeover = Some(r#"{"source":"disk"}"#.into());
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let db = db.clone();
        let m = next.clone();
        tasks.push(tokio::spawn(async move {
            db.update_move(&m, "taking_over").await
        }));
    }
    let mut wins = 0;
    for t in tasks {
        if t.await?? {
            wins += 1;
        }
    }
    ensure!(wins == 1, "{wins} winners");
    ensure!(db.unfinished_moves().await?.is_empty());
    let done = db.get_move(&m1.id).await?.context("m1 is gone")?;
    ensure!(
        done.ended_at_ms.is_some_and(|t| t >= before) && !done.cancel,
        "{done:?}"
    );

    // The sandbox may move again; the finished move may not start again beside it.
    db.insert_move(&m2).await?;
    match db
        .update_move(
            &MoveRow {
                step: "releasing".into(),
                ..next.clone()
            },
            "done",
        )
        .await
    {
        Err(DbError::AlreadyMoving { move_id }) if move_id == m2.id => {}
        r => bail!("a done move going again beside another: {r:?}"),
    }
    match db
        .insert_move(&MoveRow {
            step: "failed".into(),
            ..m1.clone()
        })
        .await
    {
        Err(DbError::IdTaken { id }) if id == m1.id => {}
        r => bail!("the same move id twice: {r:?}"),
    }
    // A finished move is not in the way of another finished one.
    db.insert_move(&MoveRow {
        step: "failed".into(),
        ..a_move(&s.id, &a.id, &b.id)
    })
    .await?;
    let of = db.moves_of(&s.id).await?;
    ensure!(
        of.len() == 3 && of[0].id == m1.id && of[1].id == m2.id,
        "{of:?}"
    );
    ensure!(db
        .unfinished_moves()
        .await?
        .iter()
        .map(|m| &m.id)
        .eq([&m2.id]));
    ensure!(db.unfinished_move_of(&s.id).await?.map(|m| m.id) == Some(m2.id.clone()));
    ensure!(db.all_moves().await?.len() == 3);

    // A cancel marks a releasing move; a writer that read it before does not clear the mark.
    ensure!(db.cancel_move(&m2.id, "releasing", "{}").await?);
    let stale = MoveRow {
        attempts: 1,
        ..m2.clone()
    };
    ensure!(db.update_move(&stale, "releasing").await?);
    let got = db.get_move(&m2.id).await?.context("m2")?;
    ensure!(
        got.cancel && got.attempts == 1 && got.ended_at_ms.is_none(),
        "{got:?}"
    );
    // At taking_over it goes reclaiming, unless the takeover answered.
    ensure!(!db.cancel_move(&m2.id, "taking_over", "{}").await?);
    let taking = MoveRow {
        step: "taking_over".into(),
        takeover: Some("{}".into()),
        ..got.clone()
    };
    ensure!(db.update_move(&taking, "releasing").await?);
    ensure!(!db.cancel_move(&m2.id, "taking_over", "{}").await?);
    let not_answered = MoveRow {
        takeover: None,
        ..taking.clone()
    };
    ensure!(db.update_move(&not_answered, "taking_over").await?);
    ensure!(
        db.cancel_move(&m2.id, "taking_over", r#"{"code":"cancelled"}"#)
            .await?
    );
    let got = db.get_move(&m2.id).await?.context("m2")?;
    ensure!(
        got.step == "reclaiming"
            && got.refusal.as_deref() == Some(r#"{"code":"cancelled"}"#)
            && got.error.is_none(),
        "{got:?}"
    );
    ensure!(matches!(
        db.cancel_move(&m2.id, "reclaiming", "{}").await,
        Err(DbError::Invalid(_))
    ));

    // 8 racing new moves of another sandbox: one is recorded, the others name it.
    let t = sandbox(None, &a.id);
    db.insert_sandbox(&t).await?;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let db = db.clone();
        let m = a_move(&t.id, &a.id, &b.id);
        tasks.push(tokio::spawn(
            async move { (db.insert_move(&m).await, m.id) },
        ));
    }
    let mut inserted = Vec::new();
    let mut named = Vec::new();
    for task in tasks {
        match task.await? {
            (Ok(()), id) => inserted.push(id),
            (Err(DbError::AlreadyMoving { move_id }), _) => named.push(move_id),
            (Err(e), _) => return Err(e.into()),
        }
    }
    ensure!(inserted.len() == 1, "{} inserted", inserted.len());
    ensure!(
        named.len() == 7 && named.iter().all(|id| *id == inserted[0]),
        "{named:?}"
    );
    ensure!(db.unfinished_moves().await?.len() == 2);

    // A sandbox's moves go with it.
    ensure!(db.delete_sandbox(&s.id).await?);
    ensure!(db.moves_of(&s.id).await?.is_empty());
    ensure!(db.get_move(&m1.id).await?.is_none());
    Ok(())
}

both!(rows_are_there_after_reopening, case_reopen);
async fn case_reopen(url: String) -> anyhow::Result<()> {
    let (node, sbx, mv) = {
        let db = Db::open(&url).await?;
        let a = db.register_node(&reg("alpha"), 60_000).await?;
        let b = db.register_node(&reg("beta"), 60_000).await?;
        db.set_draining(&b.id, true).await?;
        let s = sandbox(Some("kept"), &a.id);
        db.insert_sandbox(&s).await?;
        let m = a_move(&s.id, &a.id, &b.id);
        db.insert_move(&m).await?;
        (
            db.node(&a.id).await?.context("alpha")?,
            db.sandbox(&s.id).await?.context("kept")?,
            db.get_move(&m.id).await?.context("move")?,
        )
    };
    let db = Db::open(&url).await?;
    ensure!(db.node(&node.id).await? == Some(node.clone()));
    ensure!(db.node("beta").await?.map(|n| n.state) == Some(NodeState::Draining));
    ensure!(db.sandbox_by_name("kept").await? == Some(sbx));
    ensure!(db.get_move(&mv.id).await? == Some(mv.clone()));
    ensure!(db.unfinished_moves().await? == [mv]);
    ensure!(db.register_node(&reg("alpha"), 1).await?.id == node.id);
    Ok(())
}

const SQL_VERSIONS: &str = "SELECT version FROM schema_version ORDER BY version";

both!(migrating_twice_changes_nothing, case_migrate);
async fn case_migrate(url: String) -> anyhow::Result<()> {
    // Two control planes opening a new database at once, then one more.
    let (one, two) = tokio::join!(Db::open(&url), Db::open(&url));
    let one = one?;
    two?;
    one.register_node(&reg("alpha"), 60_000).await?;
    let db = Db::open(&url).await?;
    let versions = db
        .backend
        .query(SQL_VERSIONS, vec![])
        .await
        .map_err(DbError::from)?;
    let want = match db.kind() {
        "sqlite" => sqlite::MIGRATIONS
            .iter()
            .map(|m| vec![Val::I64(m.0)])
            .collect::<Vec<_>>(),
        _ => postgres::MIGRATIONS
            .iter()
            .map(|m| vec![Val::I64(m.0)])
            .collect(),
    };
    ensure!(versions == want, "{versions:?}");
    ensure!(db.nodes().await?.len() == 1);
    Ok(())
}

both!(now_is_the_database_clock_in_ms, case_now);
async fn case_now(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let mut last = db.now_ms().await?;
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as i64;
    ensure!((last - wall).abs() < 2_000, "db {last} vs host {wall}");
    let mut distinct = 0;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let now = db.now_ms().await?;
        ensure!(now >= last, "{now} after {last}");
        // 3 ms apart: milliseconds, not seconds.
        if now > last && now - last < 1_000 {
            distinct += 1;
        }
        last = now;
    }
    ensure!(distinct >= 9, "{distinct} of 10 readings moved by ms");
    Ok(())
}

#[tokio::test]
async fn urls_name_a_backend() {
    for bad in ["mysql://x/y", "sqlite:", "sqlite::memory:", "/tmp/x.db", ""] {
        match Db::open(bad).await {
            Err(DbError::Url(_)) => {}
            r => panic!("{bad:?}: {r:?}"),
        }
    }
}

#[tokio::test]
async fn postgres_reconnects_after_its_connection_broke() {
    let Ok(admin_url) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!("SBX_TEST_PG_URL is not set: the PostgreSQL reconnect test was skipped");
        return;
    };
    let case: Case = |url| Box::pin(case_reconnect(url));
    if let Err(e) = on_postgres(&admin_url, case).await {
        panic!("{e:#}");
    }
}

async fn case_reconnect(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a = db.register_node(&reg("alpha"), 60_000).await?;
    let Kind::Postgres(pg) = &db.backend.kind else {
        bail!("not PostgreSQL");
    };
    let pid = pg.backend_pid().await?;
    let admin = admin(&url).await?;
    let killed: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await?
        .try_get(0)?;
    ensure!(killed, "the backend was not terminated");
    // The call that finds the connection broken may fail; the next ones connect again.
    let mut failures = 0;
    let mut ok = false;
    for _ in 0..5 {
        match db.node(&a.id).await {
            Ok(Some(n)) if n.id == a.id => {
                ok = true;
                break;
            }
            Ok(other) => bail!("alpha read as {other:?}"),
            Err(_) => failures += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(ok && failures <= 1, "ok {ok}, {failures} failures");
    ensure!(pg.backend_pid().await? != pid);
    Ok(())
}

#[test]
fn postgres_dialect_numbers_parameters_outside_quotes() {
    assert_eq!(
        postgres::dialect("a = ? AND b = '?' AND c = ?"),
        "a = $1 AND b = '?' AND c = $2"
    );
    assert!(postgres::dialect("SELECT @now").contains("statement_timestamp()"));
}

#[test]
fn with_dbname_replaces_the_database() -> anyhow::Result<()> {
    assert_eq!(
        with_dbname("postgres://u:p@127.0.0.1:5432/sbx_test", "d")?,
        "postgres://u:p@127.0.0.1:5432/d"
    );
    assert_eq!(
        with_dbname("postgresql://u@h/x?sslmode=disable", "d")?,
        "postgresql://u@h/d?sslmode=disable"
    );
    assert_eq!(with_dbname("postgres://u@h", "d")?, "postgres://u@h/d");
    Ok(())
}

/// SQLite's clock expression is the exact millisecond of `'now'` (a truncation of the
/// julianday product would be one short about half of the time).
#[tokio::test]
async fn sqlite_now_is_exact_to_the_ms() -> anyhow::Result<()> {
    const SQL_BOTH: &str = "SELECT @now, CAST(strftime('%s', 'now') AS INTEGER) * 1000 \
         + CAST(substr(strftime('%f', 'now'), 4) AS INTEGER)";
    let dir = std::env::temp_dir().join(format!("sbx-control-{}", sbx_api::ids::new_id("t")));
    std::fs::create_dir_all(&dir)?;
    let result = async {
        let db = Db::open(&format!("sqlite:{}", dir.join("c.db").display())).await?;
        for _ in 0..50 {
            let rows = db
                .backend
                .query(SQL_BOTH, vec![])
                .await
                .map_err(DbError::from)?;
            ensure!(
                rows.len() == 1 && rows[0].len() == 2 && rows[0][0] == rows[0][1],
                "{rows:?}"
            );
            tokio::time::sleep(Duration::from_micros(700)).await;
        }
        Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

both!(a_node_s_listeners_are_kept, case_listeners);
async fn case_listeners(url: String) -> anyhow::Result<()> {
    let db = Db::open(&url).await?;
    let a1 = db.register_node(&reg("alpha"), 10_000).await?;
    ensure!(a1.e2b_url.is_none() && a1.preview_url.is_none(), "{a1:?}");
    let mut with = reg("alpha");
    with.e2b_url = Some("http://alpha.test:7790".into());
    with.preview_url = Some("http://alpha.test:7780".into());
    let a2 = db.heartbeat(&a1.id, &with, 10_000).await?;
    ensure!(
        a2.e2b_url.as_deref() == Some("http://alpha.test:7790")
            && a2.preview_url.as_deref() == Some("http://alpha.test:7780"),
        "{a2:?}"
    );
    let read = db.node("alpha").await?;
    ensure!(read.as_ref() == Some(&a2), "{read:?}");
    // Joining again (a restart with the listener off) says so.
    let mut off = with.clone();
    off.e2b_url = None;
    let a3 = db.register_node(&off, 10_000).await?;
    ensure!(a3.id == a1.id, "{a3:?}");
    ensure!(
        a3.e2b_url.is_none() && a3.preview_url.as_deref() == Some("http://alpha.test:7780"),
        "{a3:?}"
    );
    Ok(())
}

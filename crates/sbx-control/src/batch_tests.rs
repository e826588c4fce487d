//! Evacuations and recoveries against the fake nodes of `moves_tests.rs` (its helpers: a
//! control plane on loopback, fake nodes `a`, `b` and here `c`), on SQLite and PostgreSQL.

use super::*;

use crate::db::batch::RECOVERY;
use crate::db::NodeState;

/// A control plane's nodes' lease in these cases (a recovery waits for it and its grace).
const LEASE: Duration = Duration::from_millis(500);

/// A store in a temporary folder.
fn store_in(dir: &TempDir) -> anyhow::Result<sbx_blob::Store> {
    Ok(sbx_blob::Store::open(&format!(
        "file://{}",
        dir.0.join("store").display()
    ))?)
}

/// The store holds a sleep of `id` at `epoch` (its manifest: what a recovery looks for).
async fn slept(store: &sbx_blob::Store, id: &str, epoch: u64) -> anyhow::Result<()> {
    store
        .put_manifest(&sbx_blob::Manifest {
            sandbox_id: id.into(),
            epoch,
            build: "0123456789abcdef".into(),
            image: "img-1".into(),
            kind: sbx_blob::Kind::Sleep,
            parts: vec![],
            written_at: "2026-01-01T00:00:00Z".into(),
        })
        .await?;
    Ok(())
}

impl Fleet {
    /// A third fake node `c` in the table (ready, a long lease).
    async fn add_node(&self, name: &str) -> anyhow::Result<(FakeNode, String)> {
        let n = fake_node(name).await?;
        let r = NodeReg {
            name: name.into(),
            url: format!("http://{}", n.addr),
            build: "0123456789abcdef".into(),
            capacity: Capacity {
                max_sandboxes: 10,
                sandboxes: 0,
                images: vec![],
            },
            ..reg(name)
        };
        let id = self.ctl.db.register_node(&r, 600_000).await?.id;
        Ok((n, id))
    }

    /// Node `a`'s lease runs out now (its last heartbeat with a lease of 1 ms).
    async fn lose_a(&self) -> anyhow::Result<()> {
        let r = NodeReg {
            name: "a".into(),
            url: format!("http://{}", self.a.addr),
            build: "0123456789abcdef".into(),
            capacity: Capacity {
                max_sandboxes: 10,
                sandboxes: 0,
                images: vec![],
            },
            ..reg("a")
        };
        self.ctl.db.register_node(&r, 1).await?;
        Ok(())
    }

    /// A sandbox on `a` at epoch 1: in the table (`status`) and held by the fake.
    async fn on_a(&self, status: &str, volumes: bool) -> anyhow::Result<String> {
        let id = sbx_api::ids::new_id("sbx");
        let mut r = row(&id, &self.a_id, 1);
        r.status = status.into();
        self.ctl.db.insert_sandbox(&r).await?;
        self.a.hold(&id, 1, status, volumes);
        Ok(id)
    }

    async fn get_batch(&self, id: &str) -> anyhow::Result<Value> {
        let (s, _, v) = self
            .call("GET", &format!("/internal/batches/{id}"), None)
            .await?;
        ensure!(s == 200, "GET the batch: {s} {v}");
        Ok(v)
    }

    /// Waits until the batch has ended.
    async fn wait_ended(&self, id: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let v = self.get_batch(id).await?;
            if !v["ended_at"].is_null() {
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!("the batch did not end in {WAIT:?}: {v}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn move_of<'a>(batch: &'a Value, sandbox: &str) -> anyhow::Result<&'a Value> {
    batch["moves"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["sandbox_id"] == sandbox)
        .with_context(|| format!("no move of {sandbox} in {batch}"))
}

both!(a_lost_node_is_recovered_from_the_store, case_recover);
async fn case_recover(url: String) -> anyhow::Result<()> {
    let dir = TempDir::new()?;
    let store = store_in(&dir)?;
    let f = Fleet::with(&url, LEASE, Some(store.clone()), None).await?;
    let (c, c_id) = f.add_node("c").await?;
    // On a: the fleet's running sandbox (slept once: in the store), one asleep (in the store),
    // and one that never slept (nothing in the store).
    let running = f.sbx.clone();
    slept(&store, &running, 1).await?;
    let asleep = f.on_a("sleeping", false).await?;
    slept(&store, &asleep, 1).await?;
    let never = f.on_a("running", false).await?;
    // A later epoch's manifest does not count for a sandbox at epoch 1 (a takeover at 4 reads
    // below 4): only its own.
    slept(&store, &never, 9).await?;

    // Its lease runs: refused, lease_until beside (its lease and the grace after it).
    f.lose_a().await?;
    let (s, _, v) = f.call("POST", "/internal/nodes/a/recover", None).await?;
    ensure!(s == 409 && v["error"]["code"] == "lease_held", "{s} {v}");
    let until = v["lease_until"]
        .as_str()
        .context("lease_until")?
        .to_string();
    let node = f.ctl.db.node("a").await?.context("a")?;
    ensure!(
        until == crate::server::rfc3339(node.lease_until_ms + 1_100),
        "{until} vs {}",
        node.lease_until_ms
    );
    let (s, _, v) = f
        .call("POST", "/internal/nodes/nod-nothere/recover", None)
        .await?;
    ensure!(s == 404 && v["error"]["code"] == "not_found", "{s} {v}");

    // After it: 202 with the batch.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let (s, _, b) = f.call("POST", "/internal/nodes/a/recover", None).await?;
    ensure!(s == 202, "{s} {b}");
    let bid = b["id"].as_str().context("id")?.to_string();
    ensure!(sbx_api::ids::is_id("rcv", &bid), "{b}");
    ensure!(b["object"] == "batch" && b["kind"] == RECOVERY, "{b}");
    ensure!(
        b["node"]["id"] == f.a_id.as_str() && b["node"]["name"] == "a",
        "{b}"
    );
    ensure!(b["counts"]["total"] == 3, "{b}");
    let b = f.wait_ended(&bid).await?;
    ensure!(
        b["counts"] == json!({"total": 3, "done": 2, "failed": 1, "running": 0, "pending": 0}),
        "{b}"
    );
    for (id, ran) in [(&running, true), (&asleep, false)] {
        let m = move_of(&b, id)?;
        ensure!(
            m["why"] == "recovery"
                && m["batch"] == bid.as_str()
                && m["from_store"] == true
                && m["step"] == "done"
                && m["epoch"] == 1
                && m["wake"] == ran
                && m["release"].is_null(),
            "{m}"
        );
        let r = f.ctl.db.sandbox(id).await?.context("row")?;
        ensure!(r.epoch == 4 && r.node_id != f.a_id, "{r:?}");
        ensure!(
            r.status == if ran { "running" } else { "sleeping" },
            "{r:?}"
        );
        let (holder, other) = if r.node_id == f.b_id {
            (&f.b, &c)
        } else {
            ensure!(r.node_id == c_id, "{r:?}");
            (&c, &f.b)
        };
        ensure!(holder.epoch_of(id) == Some((4, false)));
        ensure!(other.epoch_of(id).is_none());
        let asked: Vec<Value> = holder
            .calls("takeover")
            .into_iter()
            .filter(|t| t["move_id"] == m["id"])
            .collect();
        ensure!(asked.len() == 1, "{asked:?}");
        ensure!(
            asked[0]["epoch"] == 4
                && asked[0]["from_store"] == true
                && asked[0]["from"]["local"].is_null()
                && asked[0]["from"]["name"] == "a"
                && asked[0]["wake"] == ran,
            "{}",
            asked[0]
        );
    }
    // The one the store has nothing of: failed node_lost, left on a (at its epoch), lost.
    let m = move_of(&b, &never)?;
    ensure!(
        m["step"] == "failed"
            && m["error"]["code"] == "node_lost"
            && m["to"]["id"] == f.a_id.as_str()
            && m["error"]["message"]
                .as_str()
                .is_some_and(|s| s.contains("holds nothing")),
        "{m}"
    );
    let r = f.ctl.db.sandbox(&never).await?.context("row")?;
    ensure!(
        r.node_id == f.a_id && r.epoch == 1 && r.status == "lost",
        "{r:?}"
    );
    // The lost node was asked nothing (it learns from its heartbeat), and stays lost.
    ensure!(lock(&f.a.calls).is_empty(), "{:?}", lock(&f.a.calls));
    let n = f.ctl.db.node("a").await?.context("a")?;
    ensure!(n.state == NodeState::Lost);
    // The list by node.
    let (s, _, l) = f.call("GET", "/internal/batches?node_id=a", None).await?;
    ensure!(
        s == 200 && l["data"].as_array().map(Vec::len) == Some(1),
        "{l}"
    );
    ensure!(l["data"][0]["id"] == bid.as_str());
    // Again: nothing left but the lost one (no sleep of it): one failed move more.
    let (s, _, again) = f.call("POST", "/internal/nodes/a/recover", None).await?;
    ensure!(s == 202, "{s} {again}");
    let again = f.wait_ended(again["id"].as_str().context("id")?).await?;
    ensure!(
        again["counts"]["total"] == 1 && again["counts"]["failed"] == 1,
        "{again}"
    );
    Ok(())
}

both!(
    a_refused_recovery_is_tried_once_more_elsewhere,
    case_recover_refused
);
async fn case_recover_refused(url: String) -> anyhow::Result<()> {
    let dir = TempDir::new()?;
    let store = store_in(&dir)?;
    let f = Fleet::with(&url, LEASE, Some(store.clone()), None).await?;
    let (c, c_id) = f.add_node("c").await?;
    slept(&store, &f.sbx, 1).await?;
    lock(&f.b.behave).takeover_refuse = Some(ErrorCode::BuildMissing);
    f.lose_a().await?;
    tokio::time::sleep(LEASE + Duration::from_millis(1_300)).await;
    let (s, _, b) = f.call("POST", "/internal/nodes/a/recover", None).await?;
    ensure!(s == 202, "{s} {b}");
    let b = f.wait_ended(b["id"].as_str().context("id")?).await?;
    // b (first by name) refused: it forgot what it may have made at E+3, the table went back
    // to a at E+4; then c took it at E+4+3.
    let moves = b["moves"].as_array().context("moves")?;
    ensure!(moves.len() == 2, "{b}");
    ensure!(
        moves[0]["step"] == "failed"
            && moves[0]["error"]["code"] == "build_missing"
            && moves[0]["to"]["name"] == "b"
            && moves[0]["epoch"] == 1,
        "{}",
        moves[0]
    );
    ensure!(
        moves[1]["step"] == "done" && moves[1]["to"]["name"] == "c" && moves[1]["epoch"] == 5,
        "{}",
        moves[1]
    );
    ensure!(
        b["counts"] == json!({"total": 2, "done": 1, "failed": 1, "running": 0, "pending": 0}),
        "{b}"
    );
    let forgot = f.b.calls("forget");
    ensure!(forgot.len() == 1 && forgot[0]["epoch"] == 4, "{forgot:?}");
    let r = f.sandbox_row().await?;
    ensure!(
        r.node_id == c_id && r.epoch == 8 && r.status == "running",
        "{r:?}"
    );
    ensure!(c.epoch_of(&f.sbx) == Some((8, false)));
    ensure!(f.b.epoch_of(&f.sbx).is_none());

    // Refused by both: tried once more only, then left on a, lost, one epoch past the last.
    let other = f.on_a("sleeping", false).await?;
    slept(&store, &other, 1).await?;
    lock(&c.behave).takeover_refuse = Some(ErrorCode::ImageMissing);
    let (s, _, b) = f.call("POST", "/internal/nodes/a/recover", None).await?;
    ensure!(s == 202, "{s} {b}");
    let b = f.wait_ended(b["id"].as_str().context("id")?).await?;
    let codes: Vec<&str> = b["moves"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["error"]["code"].as_str())
        .collect();
    ensure!(codes == ["build_missing", "image_missing"], "{b}");
    let r = f.ctl.db.sandbox(&other).await?.context("row")?;
    ensure!(
        r.node_id == f.a_id && r.epoch == 9 && r.status == "lost",
        "{r:?}"
    );
    // It is over: a cancel finds nothing to cancel.
    let id = b["moves"][1]["id"].as_str().unwrap_or("").to_string();
    let (s, _, v) = f
        .call("POST", &format!("/internal/moves/{id}/cancel"), None)
        .await?;
    ensure!(s == 409 && v["error"]["code"] == "move_over", "{s} {v}");
    Ok(())
}

both!(an_evacuation_moves_sleeping_ones_first, case_evacuate);
async fn case_evacuate(url: String) -> anyhow::Result<()> {
    let f = Fleet::with(&url, Duration::from_secs(60), None, None).await?;
    let (c, _) = f.add_node("c").await?;
    // a: the fleet's running one, three asleep, one with volumes.
    let mut asleep = Vec::new();
    for _ in 0..3 {
        asleep.push(f.on_a("sleeping", false).await?);
    }
    let volumed = f.on_a("sleeping", true).await?;
    // The releases are held: the evacuation is under way while we look.
    lock(&f.a.behave).hold_release = true;
    let (s, _, b) = f.call("POST", "/internal/nodes/a/evacuate", None).await?;
    ensure!(s == 202, "{s} {b}");
    let bid = b["id"].as_str().context("id")?.to_string();
    ensure!(
        sbx_api::ids::is_id("evc", &bid) && b["kind"] == "evacuation",
        "{b}"
    );
    let n = f.ctl.db.node("a").await?.context("a")?;
    ensure!(n.state == NodeState::Draining, "{n:?}");
    // A second one while it runs: 409 already_moving, the batch beside.
    let (s, _, v) = f.call("POST", "/internal/nodes/a/evacuate", None).await?;
    ensure!(
        s == 409 && v["error"]["code"] == "already_moving" && v["batch_id"] == bid.as_str(),
        "{s} {v}"
    );
    // Four at once; the sleeping ones first, the running one last (the volumed one fails at
    // once and takes no place).
    let b = f.get_batch(&bid).await?;
    let moves = b["moves"].as_array().context("moves")?;
    ensure!(moves.len() == 5, "{b}");
    let order: Vec<&str> = moves
        .iter()
        .filter(|m| m["step"] != "failed")
        .filter_map(|m| m["sandbox_id"].as_str())
        .collect();
    ensure!(order.len() == 4 && order[3] == f.sbx, "{order:?}");
    ensure!(
        asleep.iter().all(|s| order[..3].contains(&s.as_str())),
        "{order:?}"
    );
    ensure!(
        b["counts"]["running"] == 4 && b["counts"]["failed"] == 1,
        "{b}"
    );
    let vm = move_of(&b, &volumed)?;
    ensure!(vm["error"]["code"] == "not_movable", "{vm}");
    lock(&f.a.behave).hold_release = false;
    f.a.open(8);
    let b = f.wait_ended(&bid).await?;
    ensure!(
        b["counts"] == json!({"total": 5, "done": 4, "failed": 1, "running": 0, "pending": 0}),
        "{b}"
    );
    for m in b["moves"].as_array().context("moves")? {
        ensure!(
            m["why"] == "evacuation" && m["batch"] == bid.as_str(),
            "{m}"
        );
        ensure!(m["from_store"] == false, "{m}");
    }
    let m = move_of(&b, &f.sbx)?;
    ensure!(m["wake"] == true && m["step"] == "done", "{m}");
    // Each on b or c (spread: the fewest first), the running one running.
    for id in asleep.iter().chain([&f.sbx]) {
        let r = f.ctl.db.sandbox(id).await?.context("row")?;
        ensure!(r.node_id != f.a_id && r.epoch == 2, "{r:?}");
        let on = f.b.epoch_of(id).or(c.epoch_of(id));
        ensure!(on == Some((2, false)), "{id}: {on:?}");
    }
    ensure!(f.sandbox_row().await?.status == "running");
    let r = f.ctl.db.sandbox(&volumed).await?.context("row")?;
    ensure!(r.node_id == f.a_id && r.epoch == 1, "{r:?}");
    ensure!(!f.b.calls("takeover").is_empty() && !c.calls("takeover").is_empty());
    // A lost node is not evacuated.
    f.lose_a().await?;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, _, v) = f.call("POST", "/internal/nodes/a/evacuate", None).await?;
    ensure!(s == 409 && v["error"]["code"] == "not_movable", "{s} {v}");
    Ok(())
}

both!(
    a_control_plane_restarted_mid_evacuation_ends_it,
    case_evacuate_restart
);
async fn case_evacuate_restart(url: String) -> anyhow::Result<()> {
    let mut f = Fleet::with(&url, Duration::from_secs(60), None, None).await?;
    let mut all = vec![f.sbx.clone()];
    for _ in 0..5 {
        all.push(f.on_a("sleeping", false).await?);
    }
    lock(&f.a.behave).hold_release = true;
    let (s, _, b) = f.call("POST", "/internal/nodes/a/evacuate", None).await?;
    ensure!(s == 202, "{s} {b}");
    let bid = b["id"].as_str().context("id")?.to_string();
    wait_until("four releases are asked", || {
        f.a.calls("release").len() == 4
    })
    .await?;
    // Stopped: four moves made, two to place.
    f.ctl = control_with(&url, false, None, Duration::from_secs(60), None).await?;
    f.url = format!("http://{}", f.ctl.addr);
    let b = f.get_batch(&bid).await?;
    ensure!(
        b["counts"]["running"] == 4 && b["counts"]["pending"] == 2 && b["ended_at"].is_null(),
        "{b}"
    );
    lock(&f.a.behave).hold_release = false;
    f.a.open(4);
    f.ctl = control_with(&url, true, None, Duration::from_secs(60), None).await?;
    f.url = format!("http://{}", f.ctl.addr);
    let b = f.wait_ended(&bid).await?;
    ensure!(
        b["counts"] == json!({"total": 6, "done": 6, "failed": 0, "running": 0, "pending": 0}),
        "{b}"
    );
    for id in &all {
        let r = f.ctl.db.sandbox(id).await?.context("row")?;
        ensure!(r.node_id == f.b_id && r.epoch == 2, "{r:?}");
        ensure!(f.b.epoch_of(id) == Some((2, false)));
    }
    ensure!(f.ctl.db.unfinished_batches().await?.is_empty());
    Ok(())
}

both!(a_node_lost_long_enough_is_recovered_by_itself, case_auto);
async fn case_auto(url: String) -> anyhow::Result<()> {
    let dir = TempDir::new()?;
    let store = store_in(&dir)?;
    let f = Fleet::with(
        &url,
        LEASE,
        Some(store.clone()),
        Some(Duration::from_millis(300)),
    )
    .await?;
    slept(&store, &f.sbx, 1).await?;
    let never = f.on_a("running", false).await?;
    // Not before its lease, grace and the 300 ms ran out.
    f.lose_a().await?;
    let lost_at = Instant::now();
    wait_until("a recovery by itself", || {
        f.b.epoch_of(&f.sbx) == Some((4, false))
    })
    .await?;
    ensure!(
        lost_at.elapsed() >= Duration::from_millis(1_300),
        "recovered after {:?}",
        lost_at.elapsed()
    );
    let batches = f.ctl.db.batches(Some(&f.a_id)).await?;
    ensure!(
        batches.len() == 1 && batches[0].kind == RECOVERY,
        "{batches:?}"
    );
    // Once a loss: what is left (the lost one) is not recovered again and again.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let batches = f.ctl.db.batches(Some(&f.a_id)).await?;
    ensure!(batches.len() == 1, "{batches:?}");
    let r = f.ctl.db.sandbox(&never).await?.context("row")?;
    ensure!(r.status == "lost" && r.node_id == f.a_id, "{r:?}");
    Ok(())
}

"""E2B's snapshots, forks and metrics through E2B's Python SDK (pinned by scripts/e2b-sdks.sh)
against an sbx node: snapshots named, listed (by sandbox, by name, paged), made into
sandboxes and deleted; forks with their own timeout; metrics over a time range. Run by
crates/sandboxd/tests/it/e2b.rs; prints one line per check and exits non-zero at the first
that fails."""

import datetime
import sys
import time

from e2b import Sandbox, SandboxException, SandboxNotFoundException


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def ids(paginator):
    return [s.snapshot_id for s in paginator.next_items()]


made = []
snaps = []
try:
    s = Sandbox.create(metadata={"suite": "snap"}, timeout=120)
    made.append(s)
    s.files.write("/home/user/state.txt", "before")
    # A process that lives on in what is made from the snapshot: it counts in memory. A
    # command of envd's, running in the background (its output no longer followed: a
    # snapshot waits for the sandbox's open streams).
    h = s.commands.run(
        "sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.2; done'",
        background=True,
    )
    h.disconnect()
    time.sleep(1)

    # Snapshots: named (E2B's names are free text), listed, made into sandboxes.
    a = s.create_snapshot(name="My_snap test")
    check("a snapshot has the node's id", a.snapshot_id.startswith("snap-"), a.snapshot_id)
    snaps.append(a.snapshot_id)
    check("its name is E2B's as given", a.names == ["My_snap test"], str(a.names))
    b = Sandbox.create_snapshot(s.sandbox_id)
    snaps.append(b.snapshot_id)
    check("an unnamed one has no names", b.names == [], str(b.names))
    listed = ids(Sandbox.list_snapshots(sandbox_id=s.sandbox_id))
    check("listed by sandbox, newest first", listed == [b.snapshot_id, a.snapshot_id], str(listed))
    check("listed by name", ids(Sandbox.list_snapshots(name="My_snap test")) == [a.snapshot_id])
    check("listed by id", ids(Sandbox.list_snapshots(name=b.snapshot_id)) == [b.snapshot_id])
    check("no other name", ids(Sandbox.list_snapshots(name="My_snap")) == [])
    p = Sandbox.list_snapshots(sandbox_id=s.sandbox_id, limit=1)
    first = ids(p)
    check("a page of one has a next", p.has_next and first == [b.snapshot_id], str(first))
    second = ids(p)
    check("the next page", second == [a.snapshot_id] and not p.has_next, str(second))
    try:
        s.create_snapshot(name="My_snap test")
        check("a name taken is refused", False)
    except SandboxException as e:
        check("a name taken is refused", "409" in str(e), str(e))

    s.files.write("/home/user/state.txt", "after")
    c = Sandbox.create(a.snapshot_id, metadata={"suite": "snap"}, timeout=60)
    made.append(c)
    check("a sandbox from a snapshot has its files", c.files.read("/home/user/state.txt") == "before")
    n1 = int(c.files.read("/tmp/count"))
    time.sleep(1)
    n2 = int(c.files.read("/tmp/count"))
    check("and its processes, running on", n2 > n1, f"{n1} {n2}")
    c.files.write("/home/user/state.txt", "copy")
    check("the copy is its own", s.files.read("/home/user/state.txt") == "after")
    check("the original runs on", s.is_running())

    check("delete: true", Sandbox.delete_snapshot(a.snapshot_id) is True)
    check("delete again: false", Sandbox.delete_snapshot(a.snapshot_id) is False)
    check("a deleted one is not listed", ids(Sandbox.list_snapshots(sandbox_id=s.sandbox_id)) == [b.snapshot_id])
    check("the sandbox made from it runs on", c.files.read("/home/user/state.txt") == "copy")

    # Forks: each its own sandbox, with the timeout asked; the fork's snapshot is not kept.
    forks = s.fork(count=2, timeout=60)
    check("two forks", len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), str(forks))
    made.extend(forks)
    fids = {f.sandbox_id for f in forks}
    check("each of its own id", len(fids) == 2 and s.sandbox_id not in fids)
    for f in forks:
        check("a fork has the files", f.files.read("/home/user/state.txt") == "after")
        left = (f.get_info().end_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        check("a fork ends at its timeout", 30 < left <= 61, str(left))
    forks[0].files.write("/home/user/state.txt", "fork")
    check("a fork is its own", s.files.read("/home/user/state.txt") == "after")
    check("the fork's snapshot is not kept", ids(Sandbox.list_snapshots(sandbox_id=s.sandbox_id)) == [b.snapshot_id])
    gone = Sandbox.create(timeout=30)
    gone.kill()
    try:
        gone.fork()
        check("a killed sandbox is not forked", False)
    except SandboxNotFoundException:
        check("a killed sandbox is not forked", True)

    # Metrics over a time range.
    m = s.get_metrics()
    check("metrics now", len(m) >= 1 and m[-1].mem_used > 0 and m[-1].cpu_count >= 1, str(m))
    s.commands.run("timeout 2 sh -c 'while :; do :; done' || true")
    now = datetime.datetime.now(datetime.timezone.utc)
    m = s.get_metrics(start=now - datetime.timedelta(minutes=5), end=now + datetime.timedelta(seconds=5))
    check("samples over a range", len(m) >= 2, str(m))
    check("in time order", all(x.timestamp <= y.timestamp for x, y in zip(m, m[1:])))
    # (How much CPU: the node's cgroup accounting, absent on some v1 hosts: a share only.)
    check("CPU shares", all(0 <= x.cpu_used_pct <= 100 for x in m), str([x.cpu_used_pct for x in m]))
    check("memory within its total", all(0 < x.mem_used <= x.mem_total for x in m), str(m))
    old = s.get_metrics(start=now - datetime.timedelta(hours=1), end=now - datetime.timedelta(minutes=30))
    check("none before it was", old == [], str(old))
    print("all passed", flush=True)
finally:
    for x in made:
        try:
            x.kill()
        except Exception:
            pass
    for sid in snaps:
        try:
            Sandbox.delete_snapshot(sid)
        except Exception:
            pass

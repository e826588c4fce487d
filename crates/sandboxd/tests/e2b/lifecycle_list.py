"""E2B's Python SDK against an sbx node: lists of sandboxes (E2B's `GET /v2/sandboxes`) paged
by `limit` and `nextToken` over running, paused and mixed sandboxes, in `order`, filtered by
`started_after` and the template; kill. Run by crates/sandboxd/tests/it/e2b.rs; prints one
line per check and exits non-zero at the first that fails."""

import sys
import uuid
from datetime import timedelta

from e2b import Sandbox, SandboxQuery, SandboxState


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def pages(query, **kw):
    """Every page of a list, as lists of (id, state)."""
    p = Sandbox.list(query=query, **kw)
    out = []
    while p.has_next:
        out.append([(s.sandbox_id, s.state) for s in p.next_items()])
    return out


tag = {"lifecycle_list": str(uuid.uuid4())}
made = []
try:
    a = Sandbox.create(metadata=tag, timeout=120)
    made.append(a)
    b = Sandbox.create(metadata=tag, timeout=120)
    made.append(b)
    c = Sandbox.create(metadata=tag, timeout=120)
    made.append(c)
    q = SandboxQuery(metadata=tag)

    # Newest first by default, a page of one at a time: three pages, then no token.
    got = pages(q, limit=1)
    check(
        "running: one a page, the newest first",
        [[i for i, _ in pg] for pg in got] == [[c.sandbox_id], [b.sandbox_id], [a.sandbox_id]],
        str(got),
    )
    p = Sandbox.list(query=q, limit=2)
    first = p.next_items()
    check("a page of two has a next token", len(first) == 2 and p.has_next and p.next_token)
    second = p.next_items()
    check("the last page has none", len(second) == 1 and not p.has_next and p.next_token is None)

    asc = [s.sandbox_id for s in Sandbox.list(query=q, order="asc").next_items()]
    check("order asc: the oldest first", asc == [a.sandbox_id, b.sandbox_id, c.sandbox_id], str(asc))
    desc = [s.sandbox_id for s in Sandbox.list(query=q, order="desc").next_items()]
    check("order desc: the newest first", desc == [c.sandbox_id, b.sandbox_id, a.sandbox_id], str(desc))

    # Paused ones: their own state filter, and mixed with running ones.
    b.pause()
    c.pause()
    paused = pages(SandboxQuery(metadata=tag, state=[SandboxState.PAUSED]), limit=1)
    check(
        "paused: one a page, both paused",
        paused == [[(c.sandbox_id, SandboxState.PAUSED)], [(b.sandbox_id, SandboxState.PAUSED)]],
        str(paused),
    )
    running = pages(SandboxQuery(metadata=tag, state=[SandboxState.RUNNING]), limit=1)
    check("running: only the one not paused", running == [[(a.sandbox_id, SandboxState.RUNNING)]], str(running))
    mixed = pages(
        SandboxQuery(metadata=tag, state=[SandboxState.RUNNING, SandboxState.PAUSED]), limit=2
    )
    check(
        "mixed: two pages, by start",
        mixed
        == [
            [(c.sandbox_id, SandboxState.PAUSED), (b.sandbox_id, SandboxState.PAUSED)],
            [(a.sandbox_id, SandboxState.RUNNING)],
        ],
        str(mixed),
    )

    # startedAfter: from its own start it is listed, a second later not.
    info = a.get_info()
    later = [
        s.sandbox_id
        for s in Sandbox.list(query=SandboxQuery(metadata=tag, started_after=info.started_at)).next_items()
    ]
    check("started_after its start: listed", a.sandbox_id in later, str(later))
    later = [
        s.sandbox_id
        for s in Sandbox.list(
            query=SandboxQuery(metadata=tag, started_after=info.started_at + timedelta(seconds=1))
        ).next_items()
    ]
    check("started_after a second later: not listed", a.sandbox_id not in later, str(later))

    # The template filter.
    by_t = Sandbox.list(query=SandboxQuery(metadata=tag, template=info.template_id)).next_items()
    check("template: its own lists all three", len(by_t) == 3, str(by_t))
    by_t = Sandbox.list(query=SandboxQuery(metadata=tag, template="unknown-template")).next_items()
    check("template: another lists none", by_t == [])

    # Kill: gone from the list; a second kill is False.
    check("kill", Sandbox.kill(a.sandbox_id) is True)
    left = [s.sandbox_id for s in Sandbox.list(query=q).next_items()]
    check("a killed one is not listed", a.sandbox_id not in left and len(left) == 2, str(left))
    check("kill of one gone: False", Sandbox.kill(a.sandbox_id) is False)
    check("is_running of a killed one: False", a.is_running() is False)
finally:
    for s in made:
        try:
            s.kill()
        except Exception:
            pass
print("all passed", flush=True)

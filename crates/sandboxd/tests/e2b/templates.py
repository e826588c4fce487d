"""Templates built through E2B's API by E2B's Python SDK (pinned by scripts/e2b-sdks.sh)
against an sbx node: a build from the base image with copy, run_cmd, set_envs, set_workdir
and a start command with its ready command, named; exists; a sandbox made from it sees the
copied file, the working directory, the env and the started server; a failing run_cmd fails
the build with its log; a build in the background, its status polled to ready, its tag;
tags assigned, listed and removed. Run by crates/sandboxd/tests/it/e2b.rs; prints one line
per check and exits non-zero at the first that fails. The templates it builds are deleted by
the test (DELETE /templates/{name})."""

import os
import shutil
import sys
import tempfile
import time
import uuid

from e2b import Sandbox, Template, wait_for_port, wait_for_url
from e2b.exceptions import BuildException


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


suffix = uuid.uuid4().hex[:8]
name = f"sbx-tmpl-{suffix}"
bg_name = f"sbx-tmpl-bg-{suffix}"
print(f"names: {name} {bg_name}", flush=True)

ctx = tempfile.mkdtemp(prefix="sbx-e2b-ctx-")
os.makedirs(os.path.join(ctx, "data"))
with open(os.path.join(ctx, "data", "hello.txt"), "w") as f:
    f.write(f"hello from the context {suffix}\n")

made = []
try:
    # A build from the base: copy, run_cmd, env, workdir, a start command and its check.
    logs = []
    t = (
        Template(file_context_path=ctx)
        .from_base_image()
        .copy("data/*", "data/")
        .run_cmd("cat data/hello.txt && echo built-$((6*7))")
        .set_envs({"GREETING": "hi there", "LONG": "y" * 3000})
        .set_workdir("/app")
        .run_cmd("echo served > marker.txt && pwd")
        .set_start_cmd(
            "python3 -m http.server 8123 --bind 127.0.0.1",
            wait_for_url("http://127.0.0.1:8123/marker.txt", 200),
        )
    )
    info = Template.build(t, name, on_build_logs=lambda e: logs.append(e.message))
    check("a build answers its ids", info.template_id and info.build_id, str(info))
    text = "\n".join(logs)
    check("its log has the steps' output", "built-42" in text and f"context {suffix}" in text, text)
    check("and the working directory's", "\n/app" in text, text)

    check("exists by its name", Template.exists(name))
    check("base exists", Template.exists("base"))
    check("an unknown name does not", not Template.exists(f"nope-{suffix}"))

    s = Sandbox.create(name, timeout=120, envs={"EXTRA": "from the create"})
    made.append(s)
    copied = s.files.read("/home/user/data/hello.txt")
    check("a sandbox of it has the copied file", copied == f"hello from the context {suffix}\n", copied)
    r = s.commands.run("pwd")
    check("its commands run in the template's workdir", r.stdout.strip() == "/app", r.stdout)
    r = s.commands.run('echo "$GREETING"')
    check("with the template's env", r.stdout.strip() == "hi there", r.stdout)
    r = s.commands.run('printf %s "$LONG" | wc -c')
    check("a long one too", r.stdout.strip() == "3000", r.stdout)
    r = s.commands.run('echo "$EXTRA"')
    check("and the create's", r.stdout.strip() == "from the create", r.stdout)
    r = s.commands.run("curl -s http://127.0.0.1:8123/marker.txt")
    check("the start command runs in it", r.stdout.strip() == "served", r.stdout)
    r = s.commands.run("whoami")
    check("as E2B's user", r.stdout.strip() == "user", r.stdout)
    listed = Sandbox.get_info(s.sandbox_id)
    check("it is of the template by name", listed.template_id == name, str(listed.template_id))
    check("no defaults shown as metadata", listed.metadata == {}, str(listed.metadata))
    s.kill()
    made.remove(s)

    # A failing step: the build's error, with the step's log.
    bad = Template().from_base_image().run_cmd("echo about-to-fail && exit 3")
    bad_logs = []
    try:
        Template.build(bad, f"{name}-bad", on_build_logs=lambda e: bad_logs.append(e.message))
        check("a failing run_cmd fails the build", False)
    except BuildException as e:
        check("a failing run_cmd fails the build", "exit status 3" in str(e), str(e))
    check("its log has the step's output", "about-to-fail" in "\n".join(bad_logs), str(bad_logs))
    bad_user = Template().from_base_image().run_cmd("whoami", user="root123")
    try:
        Template.build(bad_user, f"{name}-bad")
        check("an unknown user fails the build", False)
    except BuildException as e:
        check(
            "an unknown user fails the build as E2B's",
            "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'"
            in str(e),
            str(e),
        )
    check("a failed build names nothing", not Template.exists(f"{name}-bad"))

    # In the background, from the first template, with a tag.
    bg = (
        Template()
        .from_template(name)
        .run_cmd("sleep 2 && echo second > /app/second.txt")
        .set_start_cmd(
            "python3 -m http.server 8124 --bind 127.0.0.1",
            wait_for_port(8124),
        )
    )
    binfo = Template.build_in_background(bg, f"{bg_name}:v1")
    st = Template.get_build_status(binfo)
    check("a background build is building", st.status.value == "building", str(st.status))
    deadline = time.time() + 60
    while time.time() < deadline and not any(
        "[builder" in e.message for e in Template.get_build_status(binfo, logs_offset=0).log_entries
    ):
        time.sleep(0.2)
    listed = Sandbox.list().next_items()
    check("its sandbox, running its steps, is not listed", listed == [], str(listed))
    deadline = time.time() + 120
    while st.status.value == "building" and time.time() < deadline:
        time.sleep(0.5)
        st = Template.get_build_status(binfo)
    check("and gets ready", st.status.value == "ready", str(st))
    check("its name exists with its tag", Template.exists(bg_name))
    s = Sandbox.create(f"{bg_name}:v1", timeout=60)
    made.append(s)
    r = s.commands.run("cat second.txt marker.txt")
    check(
        "a sandbox of name:tag has both templates' files and workdir",
        r.stdout == "second\nserved\n",
        r.stdout,
    )
    r = s.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8124/second.txt")
    check("its start command, awaited by wait_for_port (ss), serves", r.stdout == "200", r.stdout)
    s.kill()
    made.remove(s)

    # Tags.
    tags = Template.get_tags(bg_name)
    check("its tags", [x.tag for x in tags] == ["v1"], str(tags))
    a = Template.assign_tags(f"{bg_name}:v1", ["prod", "stable"])
    check("tags assigned to its build", a.build_id == tags[0].build_id and a.tags == ["prod", "stable"], str(a))
    check("listed", sorted(x.tag for x in Template.get_tags(bg_name)) == ["prod", "stable", "v1"])
    Template.remove_tags(bg_name, ["stable", "v1"])
    check("removed", [x.tag for x in Template.get_tags(bg_name)] == ["prod"])
    s = Sandbox.create(f"{bg_name}:prod", timeout=60)
    made.append(s)
    check("a sandbox of the tag left", s.commands.run("cat second.txt").stdout == "second\n")
    s.kill()
    made.remove(s)
finally:
    for s in made:
        try:
            s.kill()
        except Exception:
            pass
    shutil.rmtree(ctx, ignore_errors=True)

print("all passed", flush=True)

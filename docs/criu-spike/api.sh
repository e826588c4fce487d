# source me: small helpers over the node's API
API=${API:-127.0.0.1:7951}
sbx_create() { curl -s -XPOST -H 'Content-Type: application/json' $API/v1/sandboxes -d "${1:-{\}}"; }
sbx_id() { python3 -c 'import json,sys;print(json.load(sys.stdin)["id"])'; }
# sbx_exec ID 'shell command' [wait_seconds]
sbx_exec() { python3 - "$@" <<'PY'
import json, sys, urllib.request, os
sid, cmd = sys.argv[1], sys.argv[2]
wait = float(sys.argv[3]) if len(sys.argv) > 3 else 10
req = urllib.request.Request("http://%s/v1/sandboxes/%s/exec" % (os.environ.get("API", "127.0.0.1:7951"), sid),
    data=json.dumps({"command": cmd, "wait_seconds": wait}).encode(), headers={"Content-Type": "application/json"})
try:
    r = json.load(urllib.request.urlopen(req))
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()); sys.exit(1)
o = r
print(r["status"], r.get("exit_code"), repr(o.get("stdout", "")), repr(o.get("stderr", ""))[:300])
PY
}
sbx_delete() { curl -s -XDELETE $API/v1/sandboxes/$1; }
sbx_agent_pid() { curl -s $API/v1/sandboxes/$1 >/dev/null; sqlite3 -readonly /tmp/criu-node/state.db "select * from sandboxes where id='$1'" 2>/dev/null; }
sbx_put() { curl -s -XPUT --data-binary @"$2" "$API/v1/sandboxes/$1/files?path=$3" >/dev/null; }
# the agent's host pid: PID 1 of the sandbox = the process of its freezer cgroup whose NSpid ends in 1
sbx_agent_pid() { local g p; g=$(find /sys/fs/cgroup/freezer -maxdepth 4 -type d -name "$1" | head -1)
  for p in $(cat $g/cgroup.procs); do grep -q "^NSpid:.*[[:space:]]1$" /proc/$p/status && { echo $p; return; }; done; }
sbx_counter() { sbx_put $1 /work/e2bsdk/criu/counter.py /root/counter.py; sbx_exec $1 "nohup python3 /root/counter.py ${2:-8080} ${3:-0} >/tmp/c.log 2>&1 &" 2; }

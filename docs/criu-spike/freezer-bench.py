#!/usr/bin/python3
"""freezer-bench.py CGROUP_DIR [N]: cgroup v1 freezer pause/thaw of a sandbox: time from writing
FROZEN until freezer.state reads FROZEN, and the THAWED write; p50/p90/max over N rounds."""
import os, sys, time
d = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
fr, th = [], []
for _ in range(n):
    t = time.perf_counter()
    with open(d + "/freezer.state", "w") as f:
        f.write("FROZEN")
    while open(d + "/freezer.state").read().strip() != "FROZEN":
        pass
    fr.append((time.perf_counter() - t) * 1000)
    time.sleep(0.05)
    t = time.perf_counter()
    with open(d + "/freezer.state", "w") as f:
        f.write("THAWED")
    th.append((time.perf_counter() - t) * 1000)
    time.sleep(0.05)
q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]
procs = len(open(d + "/cgroup.procs").read().split())
print("%s (%d processes): freeze p50 %.3f ms p90 %.3f max %.3f | thaw p50 %.3f ms p90 %.3f max %.3f" % (
    d, procs, q(fr, .5), q(fr, .9), max(fr), q(th, .5), q(th, .9), max(th)))

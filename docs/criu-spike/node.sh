#!/bin/bash
# Start the test node (main's debug binaries copied to /tmp/criu-bin) with no inherited fds
# but 0-2 (the bash tool's job wrapper leaks fds 10, 250-255 into children, and sandboxd passes
# them on to every agent: criu then refuses the dump on an external pipe).
EGRESS=${EGRESS:-allow}; PORT=${PORT:-7951}; DATA=${DATA:-/tmp/criu-node}; CG=${CG:-sbxcriu}
mkdir -p $DATA
cmd="exec /tmp/criu-bin/sandboxd --listen 127.0.0.1:$PORT --data-dir $DATA --images-dir /var/lib/sbx/images --cgroup-name $CG --preview-listen off --warm-pool 0 --egress-default $EGRESS"
for fd in /proc/self/fd/*; do n=${fd##*/}; [ "$n" -gt 2 ] && cmd="$cmd $n>&-"; done
setsid bash -c "$cmd" </dev/null >$DATA.log 2>&1 &
echo $! > $DATA.pid
sleep 2; curl -s 127.0.0.1:$PORT/healthz; echo

#!/bin/bash
# cycle.sh NAME SLOT IMGDIR [fork-name fork-slot]
# sleep = criu dump (tree killed) of mock sandbox NAME; wake = criu restore into the same
# directory, or with fork args into a new sandbox directory (copy of the upper dir), a new
# pool netns (eth0 10.99.SLOT.2) and new cgroups.
# Prints timings. Needs the agent's host pid as $PID (after a wake: IMGDIR/pid-NAME). Env: PREFREEZE=1
# (freeze the cgroup first), LEAVE=1 (snapshot: keep running), TCP=1 (--tcp-established),
# NODUMP=1 (restore only), EXTRA_DUMP / EXTRA_RESTORE (more criu options), V (log level).
set -e
cd /work/e2bsdk/criu; . ./ext.sh
N=$1; SLOT=$2; IMG=$3; F=${4:-}; FSLOT=${5:-}
D=/tmp/criu-mock/$N
V=${V:-1}; CRIU=${CRIU:-/work/e2bsdk/criu/criu-fast.sh}
ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
if [ -z "$NODUMP" ]; then
  P=${PID:?agent pid}
  rm -rf $IMG; mkdir -p $IMG
  FREEZE=$(find /sys/fs/cgroup/freezer -maxdepth 4 -type d -path "*sbxmock/$N" | head -1)
  t=$(date +%s%N)
  if [ -n "$PREFREEZE" ]; then   # the node pauses first (cgroup freezer), then criu finds it FROZEN
    echo FROZEN > $FREEZE/freezer.state; until grep -q FROZEN $FREEZE/freezer.state; do :; done
    echo "freeze: $(ms $t) ms"
  fi
  $CRIU dump -t $P -D $IMG -o dump.log -v$V --network-lock nftables --freeze-cgroup $FREEZE $(ext_dump) ${LEAVE:+--leave-running} ${TCP:+--tcp-established} $EXTRA_DUMP
  echo "dump: $(ms $t) ms, image $(du -sh $IMG | cut -f1)"
  # the node's side of sleep: the pool netns goes (host side veth with it), the rootfs unmounted
  [ -n "$LEAVE" ] || { ./mkusernet.py -d /tmp/criu-ns/$N $SLOT; umount $D/rootfs 2>/dev/null || true; }
  M=/sys/fs/cgroup/memory$(grep memory /proc/self/cgroup | cut -d: -f3 | sed 's:/$::')/sbxmock/$N
  [ -f $M/memory.usage_in_bytes ] && echo "asleep: memory cgroup usage $(( $(cat $M/memory.usage_in_bytes) / 1048576 )) MiB"
fi
[ -n "$F" ] || [ -z "$LEAVE" ] || exit 0   # a snapshot of a running sandbox: nothing to restore yet
if [ -n "$F" ]; then
  # a fork: its own upper dir (a copy), its own cgroups, its own netns + address
  ND=/tmp/criu-mock/$F; SLOTN=$FSLOT; rm -rf $ND; mkdir -p $ND/rootfs $ND/work
  t=$(date +%s%N); cp -a $D/upper $ND/upper; echo "fork: copy of upper $(ms $t) ms ($(du -sh $ND/upper | cut -f1))"
  # only the sandbox's own controllers move (a bare --cgroup-root also moves cpuset & co: EACCES)
  MEMBASE=$(grep memory /proc/self/cgroup | cut -d: -f3); MEMBASE=${MEMBASE%/}
  CGROOT=(--cgroup-root "freezer:/sbxmock/$F" --cgroup-root "cpu:/sbxmock/$F" --cgroup-root "pids:/sbxmock/$F" --cgroup-root "memory:$MEMBASE/sbxmock/$F")
  TCPOPT=(--tcp-close)
else
  ND=$D; SLOTN=$SLOT; CGROOT=(); TCPOPT=(${TCP:+--tcp-established})
fi
t0=$(date +%s%N)
./mkusernet.py /tmp/criu-ns/${F:-$N} $SLOTN >/dev/null   # the pool's prepared userns+netns with eth0
echo "pool netns (not on the wake path in a node: made ahead): $(ms $t0) ms"
t=$(date +%s%N)
mountpoint -q $ND/rootfs || mount -t overlay overlay -o lowerdir=/var/lib/sbx/images/base/rootfs,upperdir=$ND/upper,workdir=$ND/work $ND/rootfs
t1=$(date +%s%N)
SBX_POOL_NETNS=/tmp/criu-ns/${F:-$N}/net SBX_ADDR=10.99.$SLOTN.2 SBX_GW=10.99.$SLOTN.1 \
  $CRIU restore -D $IMG -o restore-${F:-$N}.log -v$V -d --pidfile $IMG/pid-${F:-$N} --root $ND/rootfs $(ext_restore) \
  --empty-ns net --action-script /work/e2bsdk/criu/netns-hook.sh "${CGROOT[@]}" "${TCPOPT[@]}" $EXTRA_RESTORE
echo "restore: mount $(( (t1 - t) / 1000000 )) ms + criu $(ms $t1) ms; agent pid $(cat $IMG/pid-${F:-$N})"

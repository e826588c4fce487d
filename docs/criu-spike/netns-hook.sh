#!/bin/bash
# criu --action-script for restore with --empty-ns net: at setup-namespaces, move the pool's
# prepared eth0 into the restored sandbox's (empty) network namespace and configure it.
# env from the caller: SBX_POOL_NETNS (a netns file holding eth0), SBX_ADDR (10.99.N.2), SBX_GW.
[ "$CRTOOLS_SCRIPT_ACTION" = setup-namespaces ] || exit 0
set -e
ns=/proc/$CRTOOLS_INIT_PID/ns/net
nsenter --net=$SBX_POOL_NETNS ip link set eth0 netns $ns
nsenter --net=$ns ip link set lo up
nsenter --net=$ns ip link set eth0 up
nsenter --net=$ns ip addr add $SBX_ADDR/32 dev eth0
nsenter --net=$ns ip route add $SBX_GW/32 dev eth0
nsenter --net=$ns ip route add default via $SBX_GW dev eth0

#!/bin/bash
# mknetns.sh NAME N: a network namespace like the node's pool makes (veth, eth0 = 10.99.N.2/32,
# gateway 10.99.N.1 on the host side), owned by the host's user namespace. rm: mknetns.sh -d NAME
set -e
if [ "$1" = -d ]; then ip netns del $2 2>/dev/null; ip link del ${2}h 2>/dev/null; exit 0; fi
N=$1; I=$2
ip netns add $N
ip link add ${N}h type veth peer name eth0 netns $N
ip addr add 10.99.$I.1/32 dev ${N}h; ip link set ${N}h up
ip route add 10.99.$I.2/32 dev ${N}h
ip -n $N link set lo up; ip -n $N link set eth0 up
ip -n $N addr add 10.99.$I.2/32 dev eth0
ip -n $N route add 10.99.$I.1/32 dev eth0; ip -n $N route add default via 10.99.$I.1 dev eth0

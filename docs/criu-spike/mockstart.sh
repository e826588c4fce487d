#!/bin/bash
# mockstart.sh NAME [mocksbx args]: a mock sandbox with the counter running; prints the agent's host pid
cd /work/e2bsdk/criu; N=$1; shift
rm -rf /tmp/criu-mock/$N; mkdir -p /tmp/criu-mock
P=$(./mocksbx.py /tmp/criu-mock/$N "$@" | sed -n 's/^pid //p'); [ -n "$P" ] || exit 1
S=/tmp/criu-mock/$N/agent.sock; case " $* " in *" --abstract "*) S=net:$P;; esac
./mockctl.py $S 'mkdir -p /root && cp /.sbx/counter.py /root/counter.py' >/dev/null
./mockctl.py $S --bg "exec python3 /root/counter.py 8080 ${MB:-0} >/tmp/c.log 2>&1" >/dev/null
echo $P

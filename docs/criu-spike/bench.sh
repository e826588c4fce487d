#!/bin/bash
# bench.sh NAME SLOT N: N sleep/wake cycles of mock sandbox NAME (running), p50 of each phase
cd /work/e2bsdk/criu; N=$1; S=$2; R=${3:-5}; IMG=/tmp/criu-img/$N; out=$(mktemp)
for i in $(seq $R); do
  P=$(cat $IMG/pid-$N 2>/dev/null || echo $PID)
  PREFREEZE=1 PID=$P ./cycle.sh $N $S $IMG >> $out 2>&1
done
p50() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "$N x$R: freeze p50 $(grep -oP 'freeze: \K\d+' $out | p50) ms, dump p50 $(grep -oP 'dump: \K\d+' $out | p50) ms," \
  "restore p50 $(grep -oP 'criu \K\d+' $out | p50) ms (+ overlay mount $(grep -oP 'mount \K\d+' $out | p50) ms), image $(grep -oP 'image \K\S+' $out | tail -1)"
rm -f $out

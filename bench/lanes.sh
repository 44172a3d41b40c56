#!/usr/bin/env bash
# Runs benchmark commands side by side on disjoint GPUs of one host, e.g. two 2-GPU lanes on a
# 4-GPU machine: each lane runs its commands one after another, with CUDA_VISIBLE_DEVICES set to
# its GPUs, and every lane's results are packed once, into $OUT/results.tgz, when all are done.
# A lane is "GPUS=COMMANDS"; LANE_TIMEOUT (seconds, default 540) stops a lane that runs late,
# so packing still happens inside the device's 10-minute limit.
#   bash bench/lanes.sh "0,1=STEPS=300 bash bench/strategies.sh precision_a" \
#                       "2,3=python3 bench/memory_check.py --models 350m"
# Lanes share the host's CPUs and memory but no GPU and no NVLink pair, so a lane's tokens/s
# is compared only with baselines of the same lane (or measured in both, as docs/benchmarks.md
# says for each table).
set -uo pipefail
source bench/common.sh   # set-up, OUT, and pack_results (trapped at exit)
pids=()
stop_lanes() {  # the device's limit (TERM) or Ctrl-C: stop every lane, then pack (EXIT trap)
  # Each pid is a lane's `timeout`, which passes the signal on to the lane's whole process
  # group (torchrun and its ranks included).
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  wait
  exit 143
}
trap stop_lanes TERM INT
i=0
for lane in "$@"; do
  gpus=${lane%%=*} cmd=${lane#*=}
  echo "lane $i on GPUs $gpus: $cmd"
  CUDA_VISIBLE_DEVICES=$gpus PACK_RESULTS=0 timeout "${LANE_TIMEOUT:-540}" bash -c "$cmd" \
    > "$OUT/lane$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  [ $rc = 124 ] && echo "lane $i: stopped by LANE_TIMEOUT" || echo "lane $i: exit $rc"
done
for log in "$OUT"/lane*.log; do echo "== $log"; tail -n 25 "$log"; done

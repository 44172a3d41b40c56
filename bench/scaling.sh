#!/usr/bin/env bash
# Weak scaling on one host: the same per-GPU batch on 1, 2 and 4 (or 8) GPUs.
# model=1b, seq 2048, micro-batch 8 per GPU, bf16, synthetic data.
#   OUT=/tmp/out bash bench/scaling.sh "1 2 4"
set -uo pipefail
source bench/common.sh
run() {  # $1 = strategy, $2 = GPUs, extra overrides after
  local s=$1 n=$2; shift 2
  dtrain_run "${s}_x$n" $n strategy=$s "$@" | cut -c1-300
}
for n in ${1:-1 2 4}; do run fsdp $n; done
N=$(echo ${1:-1 2 4} | awk '{print $NF}')
run zero2 $N
run hsdp $N strategy.replicate_degree=2

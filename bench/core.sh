#!/usr/bin/env bash
# Core benchmark: dtrain single/ddp vs the plain loop, model=1b, seq 2048, micro 8, bf16.
#   bash bench/core.sh single   # 1 GPU
#   bash bench/core.sh ddp      # 2 GPUs
set -uo pipefail
source bench/common.sh
run_pair() {  # $1 = wrapper name for the plain loop, $2 = dtrain strategy, $3 = nproc
  local L="python3"; [ "$3" -gt 1 ] && L="torchrun --standalone --nproc_per_node=$3"
  $L bench/plain_loop.py --model $MODEL --wrapper $1 --out $OUT/plain_$1.json 2>&1 | tail -2
  dtrain_run dtrain_$2 $3 strategy=$2
}
case "${1:-single}" in
  single) run_pair none single 1 ;;
  ddp) run_pair ddp ddp 2 ;;
esac

#!/usr/bin/env bash
# Core benchmark (issue 2): dtrain single/ddp vs the plain loop, model=1b, seq 2048, micro 8, bf16.
#   bash bench/core.sh single   # 1 GPU
#   bash bench/core.sh ddp      # 2 GPUs
set -uo pipefail
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-1b}; STEPS=${STEPS:-40}
COMMON="model=$MODEL data=synthetic precision=bf16 trainer.seq_len=2048 trainer.micro_batch_size=8
  trainer.max_steps=$STEPS trainer.log_every=10 trainer.eval_every=0 checkpoint.save_final=false
  trainer.progress_bar=false optim.warmup_steps=10"
run_pair() {  # $1 = wrapper name for the plain loop, $2 = dtrain strategy, $3 = nproc
  local L="python3"; [ "$3" -gt 1 ] && L="torchrun --standalone --nproc_per_node=$3"
  $L bench/plain_loop.py --model $MODEL --wrapper $1 --out $OUT/plain_$1.json 2>&1 | tail -2
  rm -rf /tmp/runs/$2
  $L launch/train.py $COMMON strategy=$2 hydra.run.dir=/tmp/runs/$2 > $OUT/dtrain_$2.log 2>&1
  tail -3 $OUT/dtrain_$2.log
  python3 bench/dtrain_result.py /tmp/runs/$2 --out $OUT/dtrain_$2.json
}
case "${1:-single}" in
  single) run_pair none single 1 ;;
  ddp) run_pair ddp ddp 2 ;;
esac

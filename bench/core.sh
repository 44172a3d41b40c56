#!/usr/bin/env bash
# Core benchmark (issue 2): dtrain single/ddp vs the plain loop, model=1b, seq 2048, micro 8, bf16.
#   bash bench/core.sh single   # 1 GPU
#   bash bench/core.sh ddp      # 2 GPUs
#   PRECS="hand bf16 bf16fused bf16fused12" bash bench/core.sh loss   # 1 GPU: the LM loss
# loss (issue 63): one case per word of PRECS, each a run of its own, one after another: hand
# is the plain loop (its loss over the full logits), bf16 dtrain with the plain loss
# (model.loss_kernel=plain), bf16fused with the fused chunked loss (model.loss_kernel=fused),
# bf16fusedN the fused loss at micro-batch N (12: the plan fits it in an H100's 80 GB, 16 an
# H200's), bf16fusedauto at the largest micro-batch the plan fits.
set -uo pipefail
source bench/common.sh
run_pair() {  # $1 = wrapper name for the plain loop, $2 = dtrain strategy, $3 = nproc
  local L="python3"; [ "$3" -gt 1 ] && L="torchrun --standalone --nproc_per_node=$3"
  $L bench/plain_loop.py --model $MODEL --wrapper $1 --out $OUT/plain_$1.json 2>&1 | tail -2
  dtrain_run dtrain_$2 $3 strategy=$2
}
loss_case() {  # $1 = a word of PRECS
  local fused="strategy=single model.loss_kernel=fused"
  case $1 in
    hand) python3 bench/plain_loop.py --model $MODEL --wrapper none --out $OUT/plain_none.json \
        2>&1 | tail -2 ;;
    bf16) dtrain_run loss_bf16 1 strategy=single model.loss_kernel=plain ;;
    bf16fused) dtrain_run loss_bf16fused 1 $fused ;;
    bf16fused*) dtrain_run loss_$1 1 $fused trainer.micro_batch_size=${1#bf16fused} ;;
    *) echo "bench/core.sh loss: unknown case $1 (hand, bf16, bf16fused, bf16fusedN)" >&2
       return 2 ;;
  esac
}
case "${1:-single}" in
  single) run_pair none single 1 ;;
  ddp) run_pair ddp ddp 2 ;;
  loss) for p in ${PRECS:-hand bf16 bf16fused bf16fused12}; do loss_case $p; done ;;
esac

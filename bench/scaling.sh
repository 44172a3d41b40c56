#!/usr/bin/env bash
# Weak scaling on one host (issue 10): the same per-GPU batch on 1, 2 and 4 (or 8) GPUs.
# model=1b, seq 2048, micro-batch 8 per GPU, bf16, synthetic data.
#   OUT=/tmp/out bash bench/scaling.sh "1 2 4"
set -uo pipefail
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-1b}; STEPS=${STEPS:-40}
COMMON="model=$MODEL data=synthetic precision=bf16 trainer.seq_len=2048 trainer.micro_batch_size=8
  trainer.max_steps=$STEPS trainer.log_every=10 trainer.eval_every=0 checkpoint.save_final=false
  trainer.progress_bar=false optim.warmup_steps=10"
export TORCH_CUDA_ARCH_LIST=9.0
run() {  # $1 = strategy, $2 = GPUs, extra overrides after
  local s=$1 n=$2; shift 2
  local name="${s}_x$n"
  rm -rf /tmp/runs/$name
  torchrun --standalone --nproc_per_node=$n launch/train.py $COMMON strategy=$s "$@" \
    hydra.run.dir=/tmp/runs/$name > $OUT/$name.log 2>&1
  python3 bench/dtrain_result.py /tmp/runs/$name --out $OUT/$name.json | cut -c1-300
}
for n in ${1:-1 2 4}; do run fsdp $n; done
N=$(echo ${1:-1 2 4} | awk '{print $NF}')
run zero2 $N
run hsdp $N strategy.replicate_degree=2

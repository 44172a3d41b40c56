#!/usr/bin/env bash
# Strategies benchmark (issue 4), 2 GPUs, model=1b, seq 2048, micro-batch 8, bf16, synthetic data:
# dtrain ddp/fsdp/zero1/zero2/zero3 next to the plain loop (ddp, fsdp), a plain DeepSpeed loop
# (ZeRO-2, ZeRO-3) and Lightning Fabric (ddp, fsdp, deepspeed_stage_2), all in one call.
#   OUT=/tmp/out bash bench/strategies.sh            # everything (~25 min on 2x H100)
#   OUT=/tmp/out bash bench/strategies.sh dtrain     # only dtrain's five strategies
#   OUT=/tmp/out bash bench/strategies.sh baselines  # only the plain / DeepSpeed / Fabric loops
# Each writes $OUT/<loop>_<wrapper>.json (tokens/s, per GPU, MFU, peak memory per rank).
set -uo pipefail
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-1b}; STEPS=${STEPS:-40}
TR="torchrun --standalone --nproc_per_node=2"
COMMON="model=$MODEL data=synthetic precision=bf16 trainer.seq_len=2048 trainer.micro_batch_size=8
  trainer.max_steps=$STEPS trainer.log_every=10 trainer.eval_every=0 checkpoint.save_final=false
  trainer.progress_bar=false optim.warmup_steps=10"
dtrain() {  # $1 = strategy
  rm -rf /tmp/runs/$1
  $TR launch/train.py $COMMON strategy=$1 hydra.run.dir=/tmp/runs/$1 > $OUT/dtrain_$1.log 2>&1
  tail -3 $OUT/dtrain_$1.log
  python3 bench/dtrain_result.py /tmp/runs/$1 --out $OUT/dtrain_$1.json
}
baselines() {
  for w in ddp fsdp; do
    $TR bench/plain_loop.py --model $MODEL --wrapper $w --out $OUT/plain_$w.json 2>&1 | tail -1
  done
  for s in 2 3; do
    $TR bench/deepspeed_loop.py --model $MODEL --stage $s --out $OUT/deepspeed_zero$s.json \
      > $OUT/deepspeed_zero$s.log 2>&1; tail -1 $OUT/deepspeed_zero$s.log
  done
  for f in ddp fsdp deepspeed_stage_2; do
    $TR bench/fabric_loop.py --model $MODEL --strategy $f --out $OUT/fabric_$f.json \
      > $OUT/fabric_$f.log 2>&1; tail -1 $OUT/fabric_$f.log
  done
}
plain() {  # $1 = wrapper of bench/plain_loop.py
  $TR bench/plain_loop.py --model $MODEL --wrapper $1 --out $OUT/plain_$1.json 2>&1 | tail -1
}
deepspeed_plain() {  # $1 = stage
  $TR bench/deepspeed_loop.py --model $MODEL --stage $1 --out $OUT/deepspeed_zero$1.json \
    > $OUT/deepspeed_zero$1.log 2>&1; tail -1 $OUT/deepspeed_zero$1.log
}
fabric() {  # $1 = Fabric strategy
  $TR bench/fabric_loop.py --model $MODEL --strategy $1 --out $OUT/fabric_$1.json \
    > $OUT/fabric_$1.log 2>&1; tail -1 $OUT/fabric_$1.log
}
# DeepSpeed's FusedAdam JIT build fails with the box's default TORCH_CUDA_ARCH_LIST=9.0a.
export TORCH_CUDA_ARCH_LIST=9.0
case "${1:-all}" in
  # The full set in two calls of under 10 minutes each (the device's per-command limit).
  part1) plain ddp; dtrain ddp; plain fsdp; dtrain fsdp; dtrain zero2; dtrain zero3 ;;
  part2) deepspeed_plain 2; deepspeed_plain 3; for f in ddp fsdp deepspeed_stage_2; do fabric $f; done
         dtrain zero1 ;;
  dtrain) for s in ddp fsdp zero1 zero2 zero3; do dtrain $s; done ;;
  baselines) baselines ;;
  all) baselines; for s in ddp fsdp zero1 zero2 zero3; do dtrain $s; done ;;
  *) dtrain "$1" ;;  # one strategy, e.g. fsdp
esac

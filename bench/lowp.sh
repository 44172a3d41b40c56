#!/usr/bin/env bash
# Low precision at scale (issue 16): bf16 against fp8 (and int8) in one call, on dtrain's own
# training command and synthetic tokens, every ratio against the bf16 run of the same call.
#   OUT=/tmp/out bash bench/lowp.sh fsdp8b     # model=8b, fsdp on 2 GPUs, seq 8192, micro-batch 1
#   OUT=/tmp/out bash bench/lowp.sh single1b   # model=1b, 1 GPU, seq 2048, micro-batch 8
#   OUT=/tmp/out bash bench/lowp.sh profile8b  # the same 8b runs, 3 steps traced each (top ops)
# Each run writes $OUT/<name>.json (bench/dtrain_result.py: tokens/s, MFU, peak memory per rank).
# 8b under fsdp needs about 99 GiB per GPU in bf16: H200s (or H100s with activation checkpointing).
set -uo pipefail
source bench/common.sh
fsdp8b() {  # $1 = result name, then overrides
  local name=$1; shift
  MODEL=8b dtrain_run "$name" 2 strategy=fsdp model=8b trainer.seq_len=8192 \
    trainer.micro_batch_size=1 data.vocab_size=128256 "$@"
}
single1b() {
  local name=$1; shift
  dtrain_run "$name" 1 "$@"
}
case "${1:-}" in
  fsdp8b) for p in bf16 fp8 ${EXTRA:-}; do fsdp8b fsdp8b_$p precision=$p; done ;;
  single1b) for p in bf16 fp8 ${EXTRA:-}; do single1b single1b_$p precision=$p; done ;;
  profile8b)
    for p in bf16 fp8; do
      fsdp8b prof8b_$p precision=$p profile.enabled=true profile.wait=8 profile.active=2 \
        profile.row_limit=40
      cp /tmp/runs/prof8b_$p/profile_table.txt "$OUT/prof8b_${p}_table.txt" 2>/dev/null || true
    done ;;
  *) echo "usage: bench/lowp.sh fsdp8b|single1b|profile8b" >&2; exit 2 ;;
esac

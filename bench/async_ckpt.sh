#!/usr/bin/env bash
# Checkpoint stall: the time the training loop is blocked by each periodic
# save, checkpoint.async_save=false against true, side by side at one model and strategy. Both
# runs save every EVERY steps (keep_last=1); bench/ckpt_stall.py reads every save's stall_s and
# save_s from the two metrics.jsonl and prints their medians and sync's over async's.
#   OUT=/tmp/out bash bench/async_ckpt.sh                       # 1b, fsdp on 2 GPUs
#   OUT=/tmp/out MODEL=8b SEQ=8192 MICRO=1 EXTRA=data.vocab_size=128256 bash bench/async_ckpt.sh
# NPROC (2), STRATEGY (fsdp), EVERY (10), STEPS (40), SEQ (2048), MICRO (8); EXTRA adds
# overrides to both runs. Checkpoints are written under /tmp/runs/<name>/checkpoints: the
# box's local disk, whose speed is part of the figure (say which disk with the result).
# Each run also writes $OUT/<name>.json (bench/dtrain_result.py): the tokens/s the background
# write costs the loop shows there.
set -uo pipefail
source bench/common.sh
NPROC=${NPROC:-2}; STRATEGY=${STRATEGY:-fsdp}; EVERY=${EVERY:-10}
for mode in false true; do
  dtrain_run ckpt_async_$mode "$NPROC" strategy="$STRATEGY" trainer.seq_len="${SEQ:-2048}" \
    trainer.micro_batch_size="${MICRO:-8}" checkpoint.every_n_steps="$EVERY" \
    checkpoint.keep_last=1 checkpoint.async_save=$mode ${EXTRA:-}
  # The figures are in metrics.jsonl; the checkpoints go, so the next run's fit on the disk
  # (an 8b one is 90 GB, the box has 128).
  rm -rf /tmp/runs/ckpt_async_$mode/checkpoints
done
python3 bench/ckpt_stall.py /tmp/runs/ckpt_async_false /tmp/runs/ckpt_async_true \
  --out "$OUT/async_ckpt.json"

#!/usr/bin/env bash
# The plan's figures beyond 2 GPUs beside published results of another framework
# (docs/planner.md "Beyond two GPUs"): torchtitan's Llama 3.1 8B under FSDP on 8 and 128
# H100s (docs/performance.md of pytorch/torchtitan, Tables 1 and 3: local batch 2, seq 8192,
# selective activation checkpointing, eager / torch.compile / torch.compile + Float8).
# CPU only: plans, runs nothing. Their card (H100 96 GB HBM2e at 500 W) is in no datasheet
# table: the plan is made for the SXM H100 and for the PCIe H100, which bracket it.
#   bash bench/plan_published.sh > bench/results/2026-11-27-published/plan_torchtitan_8b.txt
set -euo pipefail
cd "$(dirname "$0")/.."
for g in h100-80gb h100-pcie-80gb; do
  for n in 8 128; do
    for extra in "precision=bf16 strategy.compile=false" "precision=bf16" "precision=fp8"; do
      echo "== $g world $n $extra"
      # shellcheck disable=SC2086
      PYTHONPATH=$PWD python -m dtrain.cli.plan model=8b gpu=$g world_size=$n gpus_per_node=8 \
        strategy=fsdp trainer.micro_batch_size=2 trainer.seq_len=8192 data.vocab_size=128256 \
        data.num_streams=128 strategy.activation_checkpointing=selective $extra |
        sed -n '/^speed per GPU/,$p'
    done
  done
done

#!/usr/bin/env bash
# Strategies benchmark, 2 GPUs, model=1b, seq 2048, micro-batch 8, bf16, synthetic data:
# dtrain ddp/fsdp/zero1/zero2/zero3 next to the plain loop (ddp, fsdp), a plain DeepSpeed loop
# (ZeRO-2, ZeRO-3) and Lightning Fabric (ddp, fsdp, deepspeed_stage_2), all in one invocation.
#   OUT=/tmp/out bash bench/strategies.sh            # everything (~25 min on 2x H100)
#   OUT=/tmp/out bash bench/strategies.sh dtrain     # only dtrain's five strategies
#   OUT=/tmp/out bash bench/strategies.sh baselines  # only the plain / DeepSpeed / Fabric loops
# Each writes $OUT/<loop>_<wrapper>.json (tokens/s, per GPU, MFU, peak memory per rank).
set -uo pipefail
source bench/common.sh
TR="torchrun --standalone --nproc_per_node=2"
dtrain() {  # $1 = strategy
  dtrain_as $1 strategy=$1
}
dtrain_as() {  # $1 = result name, then overrides (strategy=... and any others)
  local name=$1; shift
  dtrain_run dtrain_$name 2 "$@"
}
baselines() {
  for w in ddp fsdp; do plain $w; done
  for s in 2 3; do deepspeed_plain $s; done
  for f in ddp fsdp deepspeed_stage_2; do fabric $f; done
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
case "${1:-all}" in
  # The full set in two parts of under 10 minutes each (for machines with a 10-minute limit a
  # command).
  part1) plain ddp; dtrain ddp; plain fsdp; dtrain fsdp; dtrain zero2; dtrain zero3 ;;
  part2) deepspeed_plain 2; deepspeed_plain 3; for f in ddp fsdp deepspeed_stage_2; do fabric $f; done
         dtrain zero1 ;;
  # Compile plan (loss compiled apart, ddp per block) and ZeRO-3 with DeepCompile, with baselines.
  part3) dtrain ddp; plain ddp; dtrain fsdp; plain fsdp
         dtrain_as zero3_deepcompile strategy=zero3 strategy.deepcompile=true; dtrain zero3
         dtrain_as ddp_model strategy=ddp strategy.compile_scope=model ;;
  # Kernel and compile choices against the baselines of the same wrapper: the attention kernels
  # at the 1b shape, DDP with torch's 25 MB buckets (DDP's default then) and cuDNN attention,
  # and 200 MB buckets (part4); 400/1000 MB buckets and FSDP's reshard_after_forward=false
  # (part5). As run, part4 also had two runs with the model compiled before DDP wraps it
  # (`strategy.compile_scope=inner`, removed since: it measured the same; docs/benchmarks.md),
  # and attention_kernel=auto was then named torch.
  part4) python3 bench/attention_kernels.py --out $OUT/attention_kernels.jsonl
         B25="strategy=ddp strategy.bucket_cap_mb=25"
         dtrain_as ddp_cudnn $B25 trainer.attention_kernel=cudnn
         dtrain_as ddp_torch $B25; fabric ddp; plain ddp
         dtrain_as ddp_bucket200 strategy=ddp strategy.bucket_cap_mb=200 ;;
  part5) for mb in 400 1000; do dtrain_as ddp_bucket$mb strategy=ddp strategy.bucket_cap_mb=$mb; done
         plain ddp; fabric ddp
         dtrain fsdp; dtrain_as fsdp_noreshard strategy=fsdp strategy.reshard_after_forward=false
         plain fsdp; fabric fsdp ;;
  # After part4/part5: DDP's 400 MB buckets as the default, and precision.reduce_dtype=bf16
  # (Lightning's "bf16-mixed" FSDP reduces in bf16) for both wrappers, with the baselines.
  part6) dtrain_as fsdp_reduce_bf16 strategy=fsdp precision.reduce_dtype=bf16; fabric fsdp
         dtrain ddp; fabric ddp; dtrain fsdp
         dtrain_as ddp_reduce_bf16 strategy=ddp precision.reduce_dtype=bf16; plain fsdp; plain ddp ;;
  # Every precision under fsdp on 2 GPUs (bf16 is part3's dtrain fsdp).
  precision_fsdp)
    # (int8's grad-weight default was int8 when these ran; pinned so the labels stay true.)
    for p in fp16 fp8; do dtrain_as fsdp_$p strategy=fsdp precision=$p; done
    dtrain_as fsdp_int8 strategy=fsdp precision=int8 precision.int8_grad_weight=int8
    dtrain_as fsdp_int8_adamw8bit strategy=fsdp precision=int8 precision.optimizer_8bit=true \
      precision.int8_grad_weight=int8
    dtrain_as fsdp_fp32_tf32 strategy=fsdp precision=fp32 precision.tf32=true ;;
  # The same on real text for the loss after 300 steps (and steady tokens/s), in two parts:
  #   DATA="data=embedded model.vocab_size=50304" STEPS=300 LOG_EVERY=50 bash bench/strategies.sh precision_loss1
  precision_loss1)
    dtrain_as loss_fp32_tf32 strategy=fsdp precision=fp32 precision.tf32=true
    dtrain_as loss_int8 strategy=fsdp precision=int8 precision.int8_grad_weight=int8
    dtrain_as loss_int8_adamw8bit strategy=fsdp precision=int8 precision.optimizer_8bit=true \
      precision.int8_grad_weight=int8 ;;
  precision_loss2)
    for p in bf16 fp16 fp8; do dtrain_as loss_$p strategy=fsdp precision=$p; done ;;
  # int8 with grad_weight in bf16 (SwitchBack) against bf16 and all-int8, same settings:
  #   DATA="data=embedded model.vocab_size=50304" STEPS=300 LOG_EVERY=50 bash bench/strategies.sh precision_switchback
  precision_switchback)
    dtrain_as loss_bf16 strategy=fsdp precision=bf16
    dtrain_as loss_int8_switchback strategy=fsdp precision=int8 precision.int8_grad_weight=bf16
    dtrain_as loss_int8 strategy=fsdp precision=int8 precision.int8_grad_weight=int8 ;;
  # For a 4-GPU machine run as two 2-GPU lanes (bench/lanes.sh), 300 steps of text: the
  # precisions under fsdp, with bf16 again as the reference measured beside them.
  precision_lane_a)
    for p in bf16 fp16; do dtrain_as loss_$p strategy=fsdp precision=$p; done ;;
  precision_lane_b)
    dtrain_as loss_int8_adamw8bit strategy=fsdp precision=int8 precision.optimizer_8bit=true \
      precision.int8_grad_weight=int8
    dtrain_as loss_int8_switchback strategy=fsdp precision=int8 precision.int8_grad_weight=bf16 ;;
  precision_torchao) dtrain_as loss_int8_torchao strategy=fsdp precision=int8-torchao ;;
  # ZeRO-3 with DeepCompile resumed on CUDA: N steps straight against N/2, a checkpoint, and
  # resume=auto to N in the same run dir (MODEL=350m STEPS=20 LOG_EVERY=1 keep it short).
  deepcompile_resume)
    Z="strategy=zero3 strategy.deepcompile=true"
    dtrain_as dc_straight $Z
    dtrain_as dc_resumed $Z trainer.max_steps=$((STEPS / 2)) checkpoint.save_final=true
    $TR launch/train.py $COMMON $Z precision=bf16 resume=auto \
      hydra.run.dir=/tmp/runs/dtrain_dc_resumed >> $OUT/dtrain_dc_resumed.log 2>&1
    tail -2 $OUT/dtrain_dc_resumed.log
    python3 bench/resume_check.py /tmp/runs/dtrain_dc_straight /tmp/runs/dtrain_dc_resumed \
      --after $((STEPS / 2)) --out $OUT/dc_resume.json ;;
  # The 1-GPU bound beside Fabric's fsdp: 1.1x Fabric needs more than 2x one GPU's tokens/s?
  single_bound)
    python3 bench/plain_loop.py --model $MODEL --wrapper none --out $OUT/plain_none.json 2>&1 | tail -1
    dtrain_run dtrain_single 1 strategy=single ;;
  fsdp_vs_fabric)
    fabric fsdp; dtrain fsdp; dtrain_as fsdp_reduce_bf16 strategy=fsdp precision.reduce_dtype=bf16 ;;
  # The caching allocator with expandable segments (dtrain's default since) against torch's
  # classic segments, tokens/s and reserved memory (the memory check found fragmentation to be
  # most of the plan's misses). As run, the expandable runs set PYTORCH_CUDA_ALLOC_CONF and the
  # classic ones were plain `dtrain ddp|fsdp`, then the default.
  expandable_ddp)
    dtrain_as ddp strategy=ddp trainer.expandable_segments=false
    dtrain_as ddp_expandable strategy=ddp trainer.expandable_segments=true ;;
  expandable_fsdp)
    dtrain_as fsdp_expandable strategy=fsdp trainer.expandable_segments=true
    dtrain_as fsdp strategy=fsdp trainer.expandable_segments=false ;;
  dtrain) for s in ddp fsdp zero1 zero2 zero3; do dtrain $s; done ;;
  baselines) baselines ;;
  all) baselines; for s in ddp fsdp zero1 zero2 zero3; do dtrain $s; done ;;
  *) dtrain "$1" ;;  # one strategy, e.g. fsdp
esac

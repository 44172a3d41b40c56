#!/usr/bin/env bash
# bf16 at model=1b on one GPU (seq 2048, micro-batch 8, synthetic tokens): dtrain against the
# hand-written compiled loop (bench/plain_loop.py), where a dtrain step's GPU time goes, and
# what Inductor's GEMM autotuning gives each of them (the loop gets the same tuning).
#   CASES="hand bf16 auto prof hand_mat slice8b_mat" bash bench/bf16_limit.sh
# Cases: hand / bf16 (the pair at torch.compile's defaults), auto (dtrain with
# trainer.micro_batch_size=auto), hand_mb (the loop at HAND_MB, default 12: what auto picks on
# an H100), prof (dtrain with the profiler on three steps after the first 16, summarised by
# bench/trace_summary.py into $OUT/prof_trace.md), hand_mat (the loop with Inductor's
# max_autotune_gemm: its log lists each GEMM's time under cuBLAS and under Inductor's Triton
# templates), slice8b_mat (the same table at 8b's shapes: model=8b cut to 2 blocks, seq 8192,
# micro-batch 1, vocab 128,256).
source bench/common.sh
HAND_MB=${HAND_MB:-12}
hand() {  # $1 = result name, $2 = micro-batch, then environment assignments for the loop
  local name=$1 mb=$2; shift 2
  env "$@" python3 bench/plain_loop.py --model $MODEL --wrapper none --steps $STEPS \
    --micro-batch $mb --out $OUT/$name.json > $OUT/$name.log 2>&1
  tail -1 $OUT/$name.log
}
for c in ${CASES:-hand bf16}; do
  t0=$SECONDS
  case $c in
    hand) hand hand 8 ;;
    hand_mb) hand hand_mb$HAND_MB $HAND_MB ;;
    hand_mat) hand hand_mat 8 TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ;;
    bf16) dtrain_run bf16 1 ;;
    auto) dtrain_run auto 1 trainer.micro_batch_size=auto ;;
    slice8b_mat)
      TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 dtrain_run slice8b_mat 1 model=8b model.n_layer=2 \
        trainer.seq_len=8192 trainer.micro_batch_size=1 data.vocab_size=128256 \
        trainer.max_steps=6 trainer.log_every=2 optim.warmup_steps=2
      ;;
    prof)
      dtrain_run prof 1 profile.enabled=true profile.wait=15 profile.warmup=1 profile.active=3
      python3 bench/trace_summary.py /tmp/runs/prof --steps 3 --top 30 --waits \
        > $OUT/prof_trace.md 2>&1
      ;;
    *) echo "unknown case $c (hand, hand_mb, bf16, auto, prof, hand_mat, slice8b_mat)"; exit 2 ;;
  esac
  echo "case $c: $((SECONDS - t0)) s"
done

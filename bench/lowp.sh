#!/usr/bin/env bash
# Low precision at scale: bf16 against fp8 (and int8) side by side in one invocation, on dtrain's
# own training command and synthetic tokens, every ratio against the bf16 run of the same
# invocation.
#   OUT=/tmp/out bash bench/lowp.sh fsdp8b     # model=8b, fsdp on 2 GPUs, seq 8192, micro-batch 1
#   OUT=/tmp/out bash bench/lowp.sh single1b   # model=1b, 1 GPU, seq 2048, micro-batch 8
#   OUT=/tmp/out bash bench/lowp.sh fsdp1b     # model=1b, fsdp on 2 GPUs, seq 2048, micro-batch 8
#   OUT=/tmp/out bash bench/lowp.sh slice8b    # 8b's blocks on 1 GPU: model=8b cut to LAYERS
#       blocks (default 16: bf16 fits in an H200's 141 GB), seq 8192, micro-batch 1, Llama 3's
#       vocab; 8b's shapes on a single GPU (no sharding, so no gather to hide)
#   OUT=/tmp/out bash bench/lowp.sh profile8b  # the same 8b runs, 2 steps traced each (top ops)
#   OUT=/tmp/out bash bench/lowp.sh profile1b  # the same for the 1b runs
#   OUT=/tmp/out bash bench/lowp.sh int8kernels  # bf16 vs torch._int_mm vs Triton int8: GEMMs,
#       quantizes and 1b end to end on one GPU (bench/int8_kernels.py; ~5 min on an H100)
#   OUT=/tmp/out STEPS=400 DATA=data=embedded SEED=7 bash bench/lowp.sh lossslice8b: the same
#       at 8b's widths on one GPU (model=8b cut to LAYERS=4 blocks, seq 8192, micro-batch 1)
#   OUT=/tmp/out MODEL=350m STEPS=500 DATA=data=embedded SEED=7 bash bench/lowp.sh loss350m
#       500 steps of real text on 1 GPU; the mean loss of the last 50 steps per precision (two
#       lanes with two SEEDs give two bf16 runs: the noise). VOCAB=50304 widens the head to
#       GPT-2's vocabulary (the byte tokenizer's is 320), as at 1b: what an fp8 head is tried at
# PRECS lists the precisions (default: bf16 fp8; also int8, int8gw8, int8gwg, int8gwgg, int8apart,
# fp8wide, fp8cf, fp8head, fp8fast, fp8acc, fp8gi, fp8fwd, fp8headgi, fp8d, fp8dyn, fp8dhead, fp8dheadgi, int8o8, fp8o8, fp8o8gi, fp16, int8mk, bf16mk, int8tma, int8ptr, int8gluon, int8fastest, int8gapart, int8qfused, int8qsweeps, int8gic, int8swiglu, int8all); EXTRA adds more to fsdp8b, fsdp1b, single1b and slice8b.
# TAG=x adds _x to each run's name: two lanes that run the same precision need distinct run
# dirs (the run-dir lock refuses a second run in one).
# PACK_RESULTS=0 on all but the last of several invocations into one OUT (each pack replaces
# $OUT/results.tgz).
# Each run writes $OUT/<name>.json (bench/dtrain_result.py: tokens/s, MFU, peak memory per rank).
# 8b under fsdp needs about 99 GiB per GPU in bf16: H200s (or H100s with activation checkpointing).
set -uo pipefail
source bench/common.sh
fsdp8b() {  # $1 = result name, then overrides
  local name=$1; shift
  MODEL=8b dtrain_run "$name" 2 strategy=fsdp model=8b trainer.seq_len=8192 \
    trainer.micro_batch_size=1 data.vocab_size=128256 "$@"
}
# A precision name -> its overrides: int8gw8 is int8 with all three matmuls int8 (grad-weight too);
# int8gwg the same with grad-weight's output gradients scaled per 128 tokens (int8_grouped) on
# the Triton GEMMs, int8gwgg on the Gluon one (precision.int8_grouped_gemm=triton / gluon; the
# default, auto, is the Gluon one on Hopper); int8apart is int8 with every quantize a kernel of
# its own under compile (precision.int8_quantize=apart), int8qfused with every quantize fused
# into its producer (=fused), int8gapart and int8gic name the defaults (=gradients; grad-input
# in the compute dtype); fp8wide is fp8 with fsdp's weights gathered in bf16
# (precision.fp8_all_gather=false);
# fp8head is fp8 with the LM head in fp8 too, fp8fast that and fast accumulation in the backward,
# fp8acc fast accumulation in the backward alone; fp8gi fast accumulation in the grad-input GEMM
# only, fp8headgi that with the head in fp8; int8o8 and fp8o8 are int8 and fp8 with AdamW's
# moments in 8 bits (precision.optimizer_8bit, dtrain/lowp/optim8bit/adamw.py), fp8o8gi fp8o8 with
# fast accumulation in the grad-input GEMM. precision=fp8 scales with delayed amaxes where
# parameters are whole (fp8_scaling=auto: single1b, slice8b, so fp8 and its variants there are
# delayed ones) and dynamically under fsdp; fp8dyn names dynamic scales. fp8_fast_accum=
# grad_input is fp8's default, so fp8 and every fp8 variant that does not name fast accumulation
# accumulate fast in the grad-input GEMM; fp8fwd names torchao's recipe (forward only).
# Delayed scaling's first step (dynamic scales) runs eagerly where the model compiles; fp8cf
# compiles it too (precision.fp8_first_step=compiled). FRESH_CACHE=1 (bench/common.sh) gives
# each run empty compile caches: the A/B of start-up times.
# int8ptr: int8 with the pointer-load GEMM (precision.int8_gemm=pointer) instead of the
# persistent TMA one (the default; int8tma names it); int8gluon with the warp-specialized Gluon
# GEMM (=gluon) for the scaled forward and grad-input GEMMs; int8fastest with the faster of the
# two per shape (=fastest). int8swiglu (and int8all): each SwiGLU as one function, its gate's
# product and backward each one Triton kernel with their quantizes (precision.int8_swiglu=fused).
# int8qsweeps: the quantize op on two sweeps of a fixed tile (precision.int8_quantize_tiles=
# sweeps), not autotuned with one pass.
I8=precision=int8
prec() { case $1 in int8gw8) echo "$I8 precision.int8_grad_weight=int8" ;;
  int8gwg) echo "$I8 precision.int8_grad_weight=int8_grouped precision.int8_grouped_gemm=triton" ;;
  int8gwgg) echo "$I8 precision.int8_grad_weight=int8_grouped precision.int8_grouped_gemm=gluon" ;;
  int8apart) echo "$I8 precision.int8_quantize=apart" ;;
  int8qfused) echo "$I8 precision.int8_quantize=fused" ;;
  int8gapart|int8gic|int8mk|int8tma) echo "$I8" ;;
  int8qsweeps) echo "$I8 precision.int8_quantize_tiles=sweeps" ;;
  int8ptr) echo "$I8 precision.int8_gemm=pointer" ;;
  int8gluon) echo "$I8 precision.int8_gemm=gluon" ;;
  int8fastest) echo "$I8 precision.int8_gemm=fastest" ;;
  int8swiglu|int8all) echo "$I8 precision.int8_swiglu=fused" ;;
  fp8cf) echo "precision=fp8 precision.fp8_first_step=compiled" ;;
  fp8wide) echo "precision=fp8 precision.fp8_all_gather=false" ;;
  fp8head) echo "precision=fp8 precision.fp8_lm_head=true" ;;
  fp8fast) echo "precision=fp8 precision.fp8_lm_head=true precision.fp8_fast_accum=all" ;;
  fp8acc) echo "precision=fp8 precision.fp8_fast_accum=all" ;;
  fp8gi) echo "precision=fp8 precision.fp8_fast_accum=grad_input" ;;
  fp8fwd) echo "precision=fp8 precision.fp8_fast_accum=forward" ;;
  fp8headgi) echo "precision=fp8 precision.fp8_lm_head=true precision.fp8_fast_accum=grad_input" ;;
  bf16mk) echo "precision=bf16" ;;
  int8o8) echo "$I8 precision.optimizer_8bit=true" ;;
  fp8o8) echo "precision=fp8 precision.optimizer_8bit=true" ;;
  fp8o8gi) echo "precision=fp8 precision.optimizer_8bit=true precision.fp8_fast_accum=grad_input" ;;
  fp8d) echo "precision=fp8 precision.fp8_scaling=delayed" ;;
  fp8dyn) echo "precision=fp8 precision.fp8_scaling=dynamic" ;;
  fp8dhead) echo "precision=fp8 precision.fp8_scaling=delayed precision.fp8_lm_head=true" ;;
  fp8dheadgi) echo "precision=fp8 precision.fp8_scaling=delayed precision.fp8_lm_head=true precision.fp8_fast_accum=grad_input" ;;
  fp8do8gi) echo "precision=fp8 precision.fp8_scaling=delayed precision.optimizer_8bit=true precision.fp8_fast_accum=grad_input" ;;
  *) echo "precision=$1" ;; esac; }
# int8mk and bf16mk: Inductor's multi-kernel reductions (each row reduction compiled persistent
# and looped, the faster chosen at run time; persistent up to 16x longer rows): the A/B of the
# quantizes that turn pointwise producers into looped row reductions (rows of 2048 and 5632).
mkenv() { case $1 in *mk) echo 1 ;; *) echo 0 ;; esac; }
# Runs precision $1's benchmark function $2 (fsdp8b, single1b) with Inductor's setting for it.
with_env() { local p=$1; shift
  TORCHINDUCTOR_MULTI_KERNEL=$(mkenv $p) "$@"; }
single1b() {
  local name=$1; shift
  dtrain_run "$name" 1 "$@"
}
slice8b() {
  local name=$1; shift
  MODEL=8b dtrain_run "$name" 1 model=8b model.n_layer=${LAYERS:-16} trainer.seq_len=8192 \
    trainer.micro_batch_size=1 data.vocab_size=128256 "$@"
}
fsdp1b() {  # MODEL is bench/common.sh's default, 1b
  local name=$1; shift
  dtrain_run "$name" 2 strategy=fsdp data.vocab_size=50304 "$@"
}
case "${1:-}" in
  fsdp8b) for p in ${PRECS:-bf16 fp8} ${EXTRA:-}; do
      with_env $p fsdp8b fsdp8b_$p${TAG:+_$TAG} $(prec $p); done ;;
  single1b) for p in ${PRECS:-bf16 fp8} ${EXTRA:-}; do
      with_env $p single1b single1b_$p${TAG:+_$TAG} $(prec $p); done ;;
  fsdp1b) for p in ${PRECS:-bf16 fp8} ${EXTRA:-}; do
      with_env $p fsdp1b fsdp1b_$p${TAG:+_$TAG} $(prec $p); done ;;
  slice8b) for p in ${PRECS:-bf16 fp8} ${EXTRA:-}; do
      with_env $p slice8b slice8b_$p${TAG:+_$TAG} $(prec $p); done ;;
  int8kernels) python3 bench/int8_kernels.py --out "$OUT" ;;
  loss350m)
    for p in ${PRECS:-bf16 fp8}; do
      dtrain_run loss${MODEL}_${p}_s${SEED:-1337}${VOCAB:+_v$VOCAB} 1 $(prec $p) \
        seed=${SEED:-1337} ${VOCAB:+model.vocab_size=$VOCAB}
    done ;;
  lossslice8b)  # the loss at 8b's widths on one GPU: model=8b cut to LAYERS (default 4) blocks,
    # seq 8192, micro-batch 1, the head at VOCAB (default 50304); DATA=data=embedded for text
    for p in ${PRECS:-bf16 fp8}; do
      MODEL=8b dtrain_run lossslice8b_${p}_s${SEED:-1337} 1 $(prec $p) seed=${SEED:-1337} \
        model=8b model.n_layer=${LAYERS:-4} trainer.seq_len=8192 trainer.micro_batch_size=1 \
        model.vocab_size=${VOCAB:-50304}
    done ;;
  profile8b|profile1b)
    run=${1#profile}; run=${run/8b/fsdp8b}; run=${run/1b/single1b}
    for p in ${PRECS:-bf16 fp8}; do
      with_env $p $run prof${1#profile}_$p $(prec $p) profile.enabled=true profile.wait=8 \
        profile.active=2 profile.row_limit=40
    done ;;
  *) echo "usage: bench/lowp.sh fsdp8b|fsdp1b|single1b|slice8b|profile8b|profile1b|int8kernels|loss350m|lossslice8b" >&2
     exit 2 ;;
esac

# Sourced by the GPU benchmark scripts (core.sh, scaling.sh, strategies.sh): the box's set-up,
# the dtrain overrides every benchmark run shares, and one way to run dtrain and summarise it.
# MODEL, STEPS, DATA and LOG_EVERY change the shared overrides; OUT is where results go.
source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# The device returns at most 8 files a call: at exit (a timeout's TERM too) every result and
# log in $OUT, and each dtrain run's metrics.jsonl, config and TensorBoard events (what
# `python -m dtrain.cli.compare` reads), go into one archive, $OUT/results.tgz.
pack_results() {
  local keep=/tmp/bench_keep; rm -rf $keep; mkdir -p $keep/runs
  find "$OUT" -maxdepth 1 -type f ! -name results.tgz -exec mv {} $keep/ \;
  # Run dirs one or two levels down (bench/memory_check.py puts its points in /tmp/runs/mc/),
  # and the check's own table, chart and logs.
  local m d name f
  while read -r m; do
    d=$(dirname "$m"); name=${d#/tmp/runs/}; name=${name//\//_}
    mkdir -p "$keep/runs/$name"
    (cd "$d" && cp -r --parents metrics.jsonl .hydra tensorboard "$keep/runs/$name/" 2>/dev/null)
  done < <(find /tmp/runs -maxdepth 3 -name metrics.jsonl 2>/dev/null)
  while read -r f; do  # several checks: each file named by its check's dir
    cp "$f" "$keep/$(basename "$(dirname "$f")")_$(basename "$f")"
  done < <(find /tmp/runs -mindepth 2 -maxdepth 2 -type f \( -name 'memory_check.*' -o -name '*.log' \) 2>/dev/null)
  tar czf "$OUT/results.tgz" -C $keep . && echo "packed: $OUT/results.tgz ($(du -h "$OUT/results.tgz" | cut -f1))"
}
# bench/lanes.sh runs several scripts side by side and packs once, after all of them.
if [ "${PACK_RESULTS:-1}" = 1 ]; then trap pack_results EXIT; fi
trap 'exit 143' TERM
MODEL=${MODEL:-1b}; STEPS=${STEPS:-40}
DATA=${DATA:-data=synthetic}
COMMON="model=$MODEL $DATA trainer.seq_len=2048 trainer.micro_batch_size=8
  trainer.max_steps=$STEPS trainer.log_every=${LOG_EVERY:-10} trainer.eval_every=0
  checkpoint.save_final=false trainer.progress_bar=false optim.warmup_steps=10"
# DeepSpeed's FusedAdam JIT build fails with the box's default TORCH_CUDA_ARCH_LIST=9.0a.
export TORCH_CUDA_ARCH_LIST=9.0

dtrain_run() {  # $1 = result name, $2 = processes, then overrides (strategy=..., bf16 unless set)
  local name=$1 n=$2; shift 2
  local L="python3"; [ "$n" -gt 1 ] && L="python3 -m dtrain.launcher --standalone --nproc_per_node=$n"
  case " $* " in *" precision="*) ;; *) set -- "$@" precision=bf16 ;; esac
  rm -rf /tmp/runs/$name
  # FRESH_CACHE=1: each run compiles from nothing (its own Inductor and Triton caches), so
  # start-up times compare; otherwise a run reuses what an earlier one of the call compiled.
  local cache=/tmp/cache_$name fresh=(); rm -rf $cache
  if [ "${FRESH_CACHE:-0}" = 1 ]; then
    fresh=(env TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton)
  fi
  ${fresh[@]+"${fresh[@]}"} $L launch/train.py $COMMON "$@" hydra.run.dir=/tmp/runs/$name \
    > $OUT/$name.log 2>&1
  tail -2 $OUT/$name.log
  # Prints the run's summary (one JSON line) and writes it to $OUT/$name.json.
  python3 bench/dtrain_result.py /tmp/runs/$name --out $OUT/$name.json
}

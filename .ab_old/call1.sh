export PACK_RESULTS=0 PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/commit.txt 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv > $OUT/card.txt
lane0() {
  export CUDA_VISIBLE_DEVICES=0 STEPS=40 LOG_EVERY=5
  source bench/common.sh
  eval "$(sed -n '/^fsdp8b() {/,/^case /p' bench/lowp.sh | sed '$d')"
  for p in bf16 fp8 fp8d; do with_env $p single1b single1b_$p $(prec $p); done
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1 MASTER_PORT=29611 STEPS=14 LOG_EVERY=2
  source bench/common.sh
  eval "$(sed -n '/^fsdp8b() {/,/^case /p' bench/lowp.sh | sed '$d')"
  TORCH_LOGS=recompiles with_env fp8d single1b prof1b_fp8d $(prec fp8d) profile.enabled=true profile.wait=8 profile.active=2 profile.row_limit=40
  python3 bench/trace_summary.py --steps 2 --top 60 /tmp/runs/prof1b_fp8d > $OUT/trace_fp8d.txt 2>&1
  export STEPS=40 LOG_EVERY=5
  for p in fp8dheadgi; do with_env $p single1b single1b_$p $(prec $p); done
}
(lane0 > $OUT/lane0.txt 2>&1) & (lane1 > $OUT/lane1.txt 2>&1) & wait
cd $OUT && tar czf results.tgz *.log *.json *.txt && rm -f *.log *.json

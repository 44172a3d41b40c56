#!/usr/bin/env bash
# The GPU test suite (tests/gpu, docs/gpu-tests.md): every strategy and precision on CUDA and
# NCCL, then the launch-to-step-10 time of every strategy at 1b. On a 2-GPU host it runs all of
# it; on one GPU the `multigpu` tests are skipped (and said so).
#   bash bench/gpu_suite.sh            # everything
#   SUITE="-k precision" bash bench/gpu_suite.sh   # pytest's selection; LAUNCH=0 skips timing
# Writes $OUT/gpu_suite.json (each test's figures), $OUT/gpu_suite.xml (JUnit: pass/fail and
# durations) and $OUT/launch_times.json.
source bench/common.sh
export DTRAIN_GPU_RESULTS=$OUT/gpu_suite.json
rm -f "$DTRAIN_GPU_RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu_suite_cards.txt
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml=$OUT/gpu_suite.xml \
  --durations=0 ${SUITE:-} 2>&1 | tee $OUT/gpu_suite.log | tail -40
if [ "${LAUNCH:-1}" = 1 ]; then
  python3 bench/launch_times.py --out $OUT/launch_times.json ${LAUNCH_STRATEGIES:-}
fi

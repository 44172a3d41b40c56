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
# Most of a test's time is a process starting (imports, NCCL, DeepSpeed), not GPU work: with
# pytest-xdist the tests run on WORKERS processes side by side (one-GPU runs spread over the
# GPUs, the straight runs trained once for all, the 1b memory runs one at a time). 2x H200,
# 2026-11-27, one after another: 20 of the 27 tests took 1010 s (docs/gpu-tests.md).
PAR=""
if python3 -c "import xdist" 2>/dev/null; then PAR="-n ${WORKERS:-4} --dist loadgroup"; fi
python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu --junitxml=$OUT/gpu_suite.xml \
  --durations=0 $PAR ${SUITE:-} > $OUT/gpu_suite.log 2>&1
rc=$?
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_suite.log | tail -60
if [ "${LAUNCH:-1}" = 1 ]; then
  # LAUNCH_BUDGET: seconds from this script's start that the machine's time limit allows it all
  python3 bench/launch_times.py --out $OUT/launch_times.json --limit ${LAUNCH_LIMIT:-150} \
    ${LAUNCH_BUDGET:+--budget $((LAUNCH_BUDGET - SECONDS))} ${LAUNCH_STRATEGIES:-}
fi
exit $rc  # the tests' verdict (launch times are figures, not pass/fail)

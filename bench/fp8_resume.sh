#!/usr/bin/env bash
# fp8's start-up on resume: a compiled precision=fp8 run at its defaults (delayed
# scales on one GPU) stopped after step STOP, then resumed to step 2*STOP in the same run dir.
# The fresh run compiles twice (the dynamic first step's graphs, then the delayed ones); the
# resume restores each rank's amax histories from the checkpoint and compiles the delayed
# graphs only. Prints each part's wall time and, from metrics.jsonl (log_every=1), the seconds
# from the loop's start to its first step and to its last.
#   OUT=/tmp/out STOP=5 bash bench/fp8_resume.sh [overrides, e.g. model=350m]
# PART=fresh or PART=resumed runs one part (default both): at model=1b on an H200 the fresh
# part alone took 471 s (two compiles and a 61 s save), so the two can go in two commands on one
# machine (the run dir stays in /tmp/runs between them).
set -uo pipefail
STOP=${STOP:-5}
STEPS=$((2 * STOP)) LOG_EVERY=1 source bench/common.sh
dir=/tmp/runs/fp8_resume
parts="fresh resumed"; [ -n "${PART:-}" ] && parts=$PART
[ "${PART:-}" = resumed ] || rm -rf $dir
for part in $parts; do
  extra=(); [ $part = fresh ] && extra=(trainer.stop_at_step=$STOP)
  t0=$(date +%s.%N)
  python3 launch/train.py $COMMON precision=fp8 "${extra[@]}" "$@" hydra.run.dir=$dir \
    > $OUT/fp8_resume_$part.log 2>&1
  rc=$?
  echo "$part: exit $rc, $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s wall"
  [ $rc = 0 ] || exit $rc
done | tee -a $OUT/fp8_resume.txt
python3 - "$dir/metrics.jsonl" "$STOP" <<'PY' | tee -a $OUT/fp8_resume.txt
import json, sys
recs = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
recs = [r for r in recs if "elapsed_s" in r]
stop = int(sys.argv[2])
for name, steps in (("fresh", range(1, stop + 1)), ("resumed", range(stop + 1, 2 * stop + 1))):
    part = [r for r in recs if r["step"] in steps]
    if part:
        print(json.dumps({"part": name, "first_step": part[0]["step"],
                          "s_to_first_step": round(part[0]["elapsed_s"], 1),
                          "last_step": part[-1]["step"],
                          "s_to_last_step": round(part[-1]["elapsed_s"], 1),
                          "last_tokens_per_s": round(part[-1]["tokens_per_s"])}))
PY

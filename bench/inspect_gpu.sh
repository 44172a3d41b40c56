#!/usr/bin/env bash
# GPU check (no figures): samples + attention maps at eval under torch.compile and
# bf16, a profiler trace with the self-device-time table, bf16 generation with the KV cache,
# Hugging Face export and its logits under transformers. Results and logs go to $OUT.
#   bash bench/inspect_gpu.sh            # 1 GPU
#   DEVICE=cpu STEPS=6 bash bench/inspect_gpu.sh   # CPU smoke run
set -euo pipefail
[ "${DEVICE:-cuda}" = cuda ] && source bench/gpu_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}; STEPS=${STEPS:-60}; RUN=/tmp/runs/inspect
PREC=bf16; [ "$DEVICE" = cpu ] && PREC=fp32
rm -rf $RUN
python3 launch/train.py model=tiny precision=$PREC trainer.device=$DEVICE trainer.max_steps=$STEPS \
  trainer.eval_every=$((STEPS / 3)) trainer.progress_bar=false trainer.seq_len=128 \
  profile.enabled=true profile.wait=2 profile.warmup=1 profile.active=2 \
  hydra.run.dir=$RUN > $OUT/train.log 2>&1
grep -A12 "top operators" $OUT/train.log
cp $RUN/profile_table.txt $OUT/ && ls -la $RUN/tensorboard/profile > $OUT/traces.txt
python3 -m dtrain.cli.generate checkpoint=$RUN prompt="def " max_new_tokens=80 top_p=0.95 \
  num_samples=2 device=$DEVICE dtype=$([ $DEVICE = cuda ] && echo bfloat16 || echo float32) \
  | tee $OUT/generate.txt
python3 -m dtrain.cli.export checkpoint=$RUN out=$OUT/hf || echo "export failed (safetensors missing?)"
python3 - "$RUN" "$OUT" <<'PY' | tee $OUT/checks.json
import json, sys, torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from dtrain.reporting.tensorboard import event_dirs
from dtrain.checkpoint.weights import load_checkpoint, resolve_checkpoint
run, out = sys.argv[1], sys.argv[2]
acc = EventAccumulator(str(event_dirs(run)[0]), size_guidance={"images": 0, "tensors": 0}); acc.Reload()
tags = acc.Tags()
res = {"images": sorted(tags["images"]), "samples": sorted(t for t in tags["tensors"] if "samples" in t),
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
try:
    from transformers import LlamaForCausalLM
    m = load_checkpoint(resolve_checkpoint(run)).model
    hf = LlamaForCausalLM.from_pretrained(out + "/hf", dtype=torch.float32).eval()
    x = torch.randint(0, 257, (2, 100))
    with torch.no_grad():
        res["hf_max_abs_logit_diff"] = (m(x) - hf(x).logits).abs().max().item()
except Exception as e:  # transformers or the export missing on this box
    res["hf_max_abs_logit_diff"] = repr(e)
print(json.dumps(res, indent=1))
PY

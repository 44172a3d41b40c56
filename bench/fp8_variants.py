"""Where fp8's step time goes at the 1b shape, and what each candidate change would save.

A slice of the 1b model (d 2048, ffn 5632, 16 heads, vocab 50304; --layers blocks, 4 by
default), built and swapped exactly as training does (build_model, apply_precision, one
torch.compile of the model), runs forward and backward at micro-batch 8 x seq 2048. Each
variant runs in a process of its own (Inductor's settings are read at import) and prints one
JSON line: ms per forward+backward and its top kernels from the profiler.

Variants (VARIANTS below): bf16; fp8 with dynamic scales (as dtrain trains it where parameters
are sharded; where parameters are whole, fp8 takes delayed scaling by default: the
fp8_delayed variant); that fp8 with one change each: an Inductor
setting (cooperative reductions, autotuned pointwise/reduction kernels, multi-kernel), torchao's
fast accumulation in both backward GEMMs or in the grad-input one only, the LM head in fp8 too
(alone, and with fast grad-input accumulation), or the weight-gradient GEMM
left in bf16 (that one on a GPU only: under CPU autocast torchao's bf16 grad-weight mm meets an
fp32 operand).

    python bench/fp8_variants.py --out $OUT/fp8_variants.jsonl            # all variants (GPU)
    python bench/fp8_variants.py --variants bf16,fp8 --layers 2
    python bench/fp8_variants.py --optim --out $OUT/optim_clip.jsonl      # the clip + AdamW step
    python bench/fp8_variants.py --smoke --layers 1 --batch 2 --seq 64 --iters 1   # CPU check

--optim times the step that follows the backward at the full 1b size (1336M fp32 parameters):
clip_grad_norm_ then fused AdamW, against the global norm then fused AdamW with the clip folded
into the kernel's grad_scale (one pass over the gradients fewer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (precision, environment, options of precision, a change to torchao's recipe)
VARIANTS: dict[str, tuple[str, dict[str, str], dict[str, bool | str], str]] = {
    "bf16": ("bf16", {}, {}, ""),
    "fp8": ("fp8", {}, {}, ""),
    "fp8_coop": ("fp8", {"TORCHINDUCTOR_COOPERATIVE_REDUCTIONS": "1"}, {}, ""),
    "fp8_autotune_pw": ("fp8", {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"}, {}, ""),
    "fp8_multikernel": ("fp8", {"TORCHINDUCTOR_MULTI_KERNEL": "1"}, {}, ""),
    "fp8_fastacc": ("fp8", {}, {"fp8_fast_accum": "all"}, ""),
    "fp8_fastgi": ("fp8", {}, {"fp8_fast_accum": "grad_input"}, ""),
    "fp8_head": ("fp8", {}, {"fp8_lm_head": True}, ""),
    "fp8_head_fastgi": ("fp8", {}, {"fp8_lm_head": True, "fp8_fast_accum": "grad_input"}, ""),
    "fp8_gwbf16": ("fp8", {}, {}, "gwbf16"),
    "fp8_delayed": ("fp8", {}, {"fp8_scaling": "delayed"}, ""),
}
# The fp8 variants' scales and fast accumulation unless a variant names them: dynamic scales and
# torchao's forward-only fast accumulation, the base the others were measured against
# (precision=fp8's defaults since are delayed scales on one GPU and `grad_input`).
FP8_BASE = {"fp8_scaling": "dynamic", "fp8_fast_accum": "forward"}


def patch_grad_weight_bf16() -> None:
    """Make dtrain's apply_fp8 build torchao's recipe with the weight-gradient GEMM left in
    high precision (no option does this: it measured slower)."""
    import torchao.float8 as f8
    from torchao.float8.config import ScalingType

    base = f8.Float8LinearConfig.from_recipe_name

    def recipe(name):
        c = base(name)
        off = ScalingType.DISABLED  # same target dtypes as the casts kept, as torchao checks
        return dataclasses.replace(
            c,
            cast_config_input_for_grad_weight=dataclasses.replace(
                c.cast_config_input, scaling_type=off
            ),
            cast_config_grad_output_for_grad_weight=dataclasses.replace(
                c.cast_config_grad_output, scaling_type=off
            ),
        )

    f8.Float8LinearConfig.from_recipe_name = staticmethod(recipe)


def build_variant(name: str, model: torch.nn.Module, device: torch.device):
    """Apply variant `name`'s precision to `model` in place, as training does; its Precision."""
    from dtrain.config import PrecisionConfig
    from dtrain.precision import apply_precision, build_precision

    prec_name, _, options, change = VARIANTS[name]
    if change == "gwbf16":
        patch_grad_weight_bf16()
    fp8 = prec_name == "fp8"
    emulate = {"fp8_emulate": True} if fp8 and device.type == "cpu" else {}
    options = {**(FP8_BASE if fp8 else {}), **options, **emulate}
    precision = build_precision(PrecisionConfig(name=prec_name, **options), device)
    apply_precision(model, precision)
    return precision


def top_kernels(prof, iters: int, n: int = 15) -> list[tuple[str, float]]:
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key[:110], t / 1e3 / iters))
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


# model=1b's shape (conf/model/1b.yaml) with GPT-2's vocabulary, as bench/lowp.sh runs it
SHAPE_1B = dict(n_head=16, d_model=2048, ffn_hidden=5632, vocab_size=50304, tie_embeddings=True)
SHAPE_SMOKE = dict(n_head=4, d_model=128, ffn_hidden=384, vocab_size=512, tie_embeddings=True)


def run_one(name: str, layers: int, batch: int, seq: int, iters: int, smoke: bool) -> dict:
    """One variant's forward+backward: ms a step and its top kernels. `smoke`: a small model,
    eager, on the CPU (fp8 emulated): checks that the variant builds and runs."""
    from dtrain.model import ModelConfig, build_model

    shape = SHAPE_SMOKE if smoke else SHAPE_1B
    cfg = ModelConfig(name="1b-slice", n_layer=layers, max_seq_len=seq, **shape)
    dev = torch.device("cpu" if smoke else "cuda")
    torch.manual_seed(0)
    model = build_model(cfg, dev)
    precision = build_variant(name, model, dev)
    precision.apply_backend_flags(dev)
    fp8_linears = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not smoke:
        model = torch.compile(model)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)

    def step():
        with precision.autocast(dev):
            loss = model(x, y)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(1 if smoke else 4):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / iters
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step()
        sync()
    reserved = torch.cuda.max_memory_reserved() / 2**30 if dev.type == "cuda" else None
    return {
        "variant": name,
        "layers": layers,
        "tokens": batch * seq,
        "fp8_linears": fp8_linears,
        "ms_fwd_bwd": round(ms, 3),
        "tokens_per_s": round(batch * seq / ms * 1e3),
        "peak_reserved_gib": round(reserved, 2) if reserved is not None else None,
        "top_kernels_ms": top_kernels(prof, 2),
    }


def run_optim(iters: int) -> list[dict]:
    """clip_grad_norm_ + fused AdamW against the norm + fused AdamW with grad_scale = the clip."""
    from dtrain.model import ModelConfig, build_model

    cfg = ModelConfig(name="1b", n_layer=24, **SHAPE_1B)
    dev = torch.device("cuda")
    model = build_model(cfg, dev)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    max_norm = 1.0
    out = []
    for mode in ("clip_then_step", "clip_in_grad_scale", "clip_then_step"):

        def step(mode=mode):
            if mode == "clip_then_step":
                torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
                opt.step()
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
                # fused AdamW divides each gradient by grad_scale: norm/max_norm when over.
                opt.grad_scale = torch.clamp(norm / max_norm, min=1.0).float()
                try:
                    opt.step()
                finally:
                    del opt.grad_scale

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            step()
        e.record()
        torch.cuda.synchronize()
        out.append({"optim": mode, "ms": round(s.elapsed_time(e) / iters, 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one variant
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--optim", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a small model on the CPU, eager")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.optim:
        rows = run_optim(a.iters)
    elif a.one:
        row = run_one(a.one, a.layers, a.batch, a.seq, a.iters, a.smoke)
        print(json.dumps(row), flush=True)
        return
    else:
        rows = []
        names = a.variants.split(",")
        for name in names:
            if name not in VARIANTS:
                print(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
                sys.exit(2)
        for name in names:
            env = {**os.environ, **VARIANTS[name][1]}
            argv = [
                sys.executable,
                __file__,
                "--one",
                name,
                "--layers",
                str(a.layers),
                "--batch",
                str(a.batch),
                "--seq",
                str(a.seq),
                "--iters",
                str(a.iters),
            ] + (["--smoke"] if a.smoke else [])
            r = subprocess.run(argv, env=env, capture_output=True, text=True)
            line = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
            rows.append(
                json.loads(line[0])
                if line
                else {"variant": name, "error": r.stderr.strip().splitlines()[-3:]}
            )
            emit(rows[-1], a.out)  # as each finishes: a call cut short keeps the rest
        if any("error" in r for r in rows):
            sys.exit(1)
        return
    for r in rows:
        emit(r, a.out)


def emit(row: dict, out: Path | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

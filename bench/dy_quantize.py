"""The output gradient's two quantizes under precision.int8_grad_weight=int8_grouped, timed on one
GPU: dy is quantized per token over its channels for the grad-input GEMM
(dtrain::int8_quantize_rowwise) and per channel per 128 tokens for the grouped grad-weight GEMM
(dtrain::int8_quantize_groups), each kernel reading all of dy. What one kernel reading dy once
would save, and what bounds it:

    apart       the two ops as training runs them (autotuned), and each alone
    apart, mul  the same ops with triton_gemm.quantize_values patched (a second process,
                before anything compiles) to multiply each value by Triton's approximate
                reciprocal of its scale (`1.0 / s`, div.full, one a value; codes may differ by
                one). Measured first against the IEEE division a value that the ops had then
                (raw outputs of 2026-12-03); since, the ops take one IEEE
                reciprocal a scale (int8.codes), and this is what that exactness costs
    roof        a tile kernel that reads dy once and writes int8 with no rounding: row-major
                only (one op's bytes), or row-major and transposed (both ops' bytes)
    local       the same tile kernel quantizing both ways inside its 128 x 128 tile (one scale
                per token per 128 channels, one per channel per 128 tokens): one read of dy,
                what a grad-input GEMM taking scales per 128 channels would allow; with the
                division, and with the multiply

    python bench/dy_quantize.py --out $OUT          # a GPU; ~1 min, times from CUDA-graph replays
    python bench/dy_quantize.py --out /tmp/x --smoke   # CPU, Triton's interpreter: checks only

The ops are checked bit for bit against the portable torch ops before they are timed. Writes
OUT/dy_quantize.json and OUT/dy_quantize.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# dy of each linear: (tokens, out_features); 1b at micro-batch 8 x seq 2048, 8b at seq 8192.
SHAPES = {
    "1b q,k,v,o / w2": (16384, 2048),
    "1b w1,w3": (16384, 5632),
    "8b q,o / w2": (8192, 4096),
    "8b w1,w3": (8192, 14336),
}
SMOKE_SHAPES = {"smoke": (300, 72)}


def _kernels():
    """bench/dy_quantize_tiles.py's kernels, imported once TRITON_INTERPRET is decided."""
    import dy_quantize_tiles as t

    return t.tile_kernel, t.quantize_values_mul


def _tile(kernel, g, *, round_: bool, mul: bool, both: bool, interpret: bool):
    import torch
    import triton

    m, n = g.shape
    q = torch.empty((m, n), dtype=torch.int8, device=g.device)
    qt = torch.empty((n, m), dtype=torch.int8, device=g.device) if both else q
    bm, bn, warps = (32, 32, 4) if interpret else (128, 128, 8)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    kernel[grid](g, q, qt, m, n, round_, mul, both, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return q, qt


def _differ(got, want) -> int:
    """The largest code difference (int8) or 1 for any scale that differs."""
    import torch

    worst = 0
    for a, b in zip(got, want, strict=True):
        if a.dtype == torch.int8:
            worst = max(worst, (a.int() - b.int()).abs().max().item() if a.numel() else 0)
        elif not torch.equal(a, b):
            worst = max(worst, 1)
    return worst


def measure(shapes: dict, device: str, interpret: bool, mul: bool) -> list[dict]:
    """Times each shape's variants; with `mul`, only the ops, their exact reciprocal a scale
    patched to the approximate one a value."""
    tile, quantize_values_mul = _kernels()
    from dtrain.lowp.int8 import grouped_triton as igt
    from dtrain.lowp.int8 import triton_gemm as it

    if mul:  # before anything compiles: the kernels look the helper up when they do
        it.quantize_values = igt.quantize_values = quantize_values_mul
    if device == "cuda":
        from triton.testing import do_bench_cudagraph

        # Replays of a CUDA graph of many calls: the kernels' time without the host's dispatch
        # of the custom op and its autotuner (0.05-0.1 ms a call, which do_bench adds to a
        # 0.03-0.1 ms kernel; in training the host runs ahead and only the kernels count).
        timer = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median")  # noqa: E731
    else:

        def timer(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

    rows = []
    for name, (m, n) in shapes.items():
        row = _measure_shape(name, m, n, device, interpret, mul, timer, tile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _measure_shape(name, m, n, device, interpret, mul, timer, tile) -> dict:
    import torch

    from dtrain.lowp.int8 import grouped as ig
    from dtrain.lowp.int8 import grouped_triton as igt
    from dtrain.lowp.int8 import triton_gemm as it
    from dtrain.lowp.int8.quant import quantize_rowwise

    gen = torch.Generator(device=device).manual_seed(0)
    g = (torch.randn((m, n), generator=gen, device=device) * 1e-3).to(torch.bfloat16)
    ts = torch.rand((m, 1), generator=gen, device=device) + 0.5
    want = (*quantize_rowwise(g), *ig.quantize_groups(g, ts))

    def rowwise():
        return it.quantize_rowwise(g, None)

    def groups():
        return igt.quantize_groups(g, ts)

    diff = _differ((*rowwise(), *groups()), want)
    if diff > (1 if mul else 0):
        raise AssertionError(f"{name}: the ops differ from the torch ops by {diff}")
    row = {"shape": name, "M": m, "N": n, "mul": mul, "ops_max_code_diff": diff}
    row["rowwise_ms"] = timer(rowwise)
    row["groups_ms"] = timer(groups)
    row["apart_ms"] = timer(lambda: (rowwise(), groups()))
    if not mul:
        for key, kw in {
            "roof_rows_ms": dict(round_=False, mul=False, both=False),
            "roof_both_ms": dict(round_=False, mul=False, both=True),
            "local_div_ms": dict(round_=True, mul=False, both=True),
            "local_mul_ms": dict(round_=True, mul=True, both=True),
        }.items():
            row[key] = timer(lambda kw=kw: _tile(tile, g, interpret=interpret, **kw))
        # TB/s with dy read once and two int8 codes written (the scales aside)
        both_bytes = m * n * (g.element_size() + 2)
        row["roof_both_tb_s"] = both_bytes / row["roof_both_ms"] / 1e9
        row["local_div_tb_s"] = both_bytes / row["local_div_ms"] / 1e9
        row["apart_tb_s"] = 2 * m * n * (g.element_size() + 1) / row["apart_ms"] / 1e9
    return row


def markdown(rows: list[dict], mul_rows: list[dict], meta: dict) -> str:
    mul = {r["shape"]: r for r in mul_rows}
    lines = [
        "# dy's two quantizes (bench/dy_quantize.py)",
        "",
        f"Device: {meta['name']}; torch {meta['torch']}; triton {meta['triton']}",
        "",
        "ms a call (median of CUDA-graph replays: kernel time, no host dispatch). TB/s: apart "
        "counts dy read twice and written twice as int8; roof and local count one read and two "
        "writes.",
        "",
        "| dy | M x N | row-wise op | groups op | apart | apart TB/s | apart, mul "
        "| roof, rows | roof, both | roof TB/s | local, div | local TB/s | local, mul |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = mul.get(r["shape"], {})
        apart_mul = f"{m['apart_ms']:.3f}" if m else "-"
        lines.append(
            f"| {r['shape']} | {r['M']} x {r['N']} | {r['rowwise_ms']:.3f} | {r['groups_ms']:.3f} "
            f"| {r['apart_ms']:.3f} | {r['apart_tb_s']:.2f} | {apart_mul} "
            f"| {r['roof_rows_ms']:.3f} | {r['roof_both_ms']:.3f} | {r['roof_both_tb_s']:.2f} "
            f"| {r['local_div_ms']:.3f} | {r['local_div_tb_s']:.2f} | {r['local_mul_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny, on CPU in Triton's interpreter")
    p.add_argument("--mul", action="store_true", help=argparse.SUPPRESS)  # the second process
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("dy_quantize: no CUDA device (run with --smoke on CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.mul:
        rows = measure(shapes, device, args.smoke, mul=True)
        (out / "dy_quantize_mul.json").write_text(json.dumps(rows, indent=1))
        return 0
    cmd = [sys.executable, __file__, "--out", str(out), "--mul"] + (
        ["--smoke"] if args.smoke else []
    )
    if subprocess.run(cmd).returncode != 0:
        print("dy_quantize: the multiply variant failed", file=sys.stderr)
        return 1
    mul_rows = json.loads((out / "dy_quantize_mul.json").read_text())
    meta = {
        "name": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    rows = measure(shapes, device, args.smoke, mul=False)
    result = {"meta": meta, "rows": rows, "mul_rows": mul_rows}
    (out / "dy_quantize.json").write_text(json.dumps(result, indent=1))
    (out / "dy_quantize.md").write_text(markdown(rows, mul_rows, meta))
    print(markdown(rows, mul_rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())

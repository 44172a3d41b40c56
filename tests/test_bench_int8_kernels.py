"""bench/int8_kernels.py runs end to end (tiny shapes and model on CPU) and writes its JSON
and tables: the GPU call it is written for gets one try."""

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_int8_kernels_bench_smoke(tmp_path):
    env = cli_env()
    res = subprocess.run(
        [sys.executable, "bench/int8_kernels.py", "--smoke", "--out", tmp_path]
        + ["--e2e-runs", "bf16,int8_triton", "--run-root", tmp_path / "runs"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "int8_kernels.json").read_text())
    gemms = out["micro"]["gemms"]
    assert {g["role"] for g in gemms} == {"forward", "grad_input", "grad_weight"}
    assert all(isinstance(g["bf16_ms"], float) and g["int_mm_dequant_ms"] > 0 for g in gemms)
    assert [r["run"] for r in out["e2e"]] == ["bf16", "int8_triton"]
    bf16, int8 = out["e2e"]
    assert bf16["tokens_per_s"] > 0 and int8["speed_vs_bf16"] > 0
    # On CPU the forced Triton path falls back, and the run says so in its one line.
    assert int8["int8_line"] == "int8 matmuls: torch._int_mm (no CUDA device)"
    gate = out["micro"]["gate"]
    assert [(r["model"], r["pass"], r["shape"]) for r in gate] == [
        ("tiny", "forward", [128, 96]),
        ("tiny", "backward", [128, 96]),
    ]
    for r in gate:  # no Triton on CPU: its columns are absent, the others timed
        assert all(r[f"{v}_ms"] > 0 for v in ("bf16_eager", "bf16_compiled", "quant_compiled"))
        assert "triton_one_pass_ms" not in r
    quant = out["micro"]["quantize"]
    assert quant and all(q["eager_ms"] > 0 and q["compiled_ms"] > 0 for q in quant)
    assert all("triton_two_sweeps_ms" not in q for q in quant)  # no Triton on CPU
    md = (tmp_path / "int8_kernels.md").read_text()
    assert "| triton, one pass | triton, two sweeps |" in md
    assert "| tiny | w1 | forward |" in md and "| int8_triton |" in md
    assert "| tiny | backward | 128 x 96 |" in md

"""bench/dy_quantize.py runs end to end on CPU (Triton's interpreter, one small shape): the ops
checked bit for bit against the torch ops before they are timed, the multiply variant in its
own process, and its JSON and table written: the GPU call it is written for gets one try."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_dy_quantize_bench_smoke(tmp_path):
    res = subprocess.run(
        [sys.executable, "bench/dy_quantize.py", "--smoke", "--out", tmp_path],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "dy_quantize.json").read_text())
    (row,) = out["rows"]
    (mul,) = out["mul_rows"]
    assert (row["M"], row["N"], row["mul"], mul["mul"]) == (300, 72, False, True)
    assert row["ops_max_code_diff"] == 0  # the ops are the torch ops' bits
    assert mul["ops_max_code_diff"] <= 1  # the patched division: at most one code apart
    keys = ("rowwise", "groups", "apart", "roof_rows", "roof_both", "local_div", "local_mul")
    assert all(row[f"{k}_ms"] > 0 for k in keys)
    assert "| smoke | 300 x 72 |" in (tmp_path / "dy_quantize.md").read_text()

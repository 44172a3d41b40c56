"""bench/optim8bit.py runs its variants (small and eager on the CPU) and refuses an unknown one."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/optim8bit.py", *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_optim8bit_smoke_and_bad_variant(tmp_path):
    pytest.importorskip("torchao")
    out = tmp_path / "o.jsonl"
    res = _run("--smoke", "--variants", "adamw_fused,grouped_8bit", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["adamw_fused", "grouped_8bit"]
    assert all(r["tensors"] > 0 and r["ms_step"] > 0 for r in rows)
    bad = _run("--smoke", "--variants", "adamw,grouped_8bit")
    assert bad.returncode == 2 and "unknown variant 'adamw'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_kernel_sweep_smoke_and_bad_rows():
    """bench/optim8bit_kernel_sweep.py times each launch shape (here in Triton's interpreter,
    a small tensor) and refuses a block count tl.arange cannot take."""
    pytest.importorskip("torchao")
    pytest.importorskip("triton")
    env = cli_env()
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")

    def sweep(*args):
        return subprocess.run(
            [sys.executable, "bench/optim8bit_kernel_sweep.py", "--smoke", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    res = sweep("--rows", "1,2", "--warps", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(r["rows"], r["warps"]) for r in rows] == [(1, 1), (2, 1)]
    assert all(r["ms"] > 0 and r["shape"] == [4, 512] for r in rows)
    bad = sweep("--rows", "3")
    assert bad.returncode == 2 and "--rows 3" in bad.stderr and "power of two" in bad.stderr
    assert "Traceback" not in bad.stderr

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

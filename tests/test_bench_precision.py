"""bench/precision.py runs end to end (tiny model on CPU) and writes its JSON and table."""

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_precision_bench_smoke(tmp_path):
    res = subprocess.run(
        [sys.executable, "bench/precision.py", "--smoke", "--variants", "int8", "--out", tmp_path],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (r,) = json.loads((tmp_path / "precision.json").read_text())
    assert r["variant"] == "int8" and r["tokens_per_s"] > 0, r
    assert r["steps_run"] == 3 and r["loss_last10"] > 0
    assert "| int8 |" in (tmp_path / "precision.md").read_text()

"""bench/precision.py runs end to end (tiny model on CPU) and writes its JSON and table."""

import json
import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_precision_bench_smoke(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "bench/precision.py",
            "--smoke",
            "--variants",
            "int8,int8-switchback",
            "--out",
            tmp_path,
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "precision.json").read_text())
    assert [(r["variant"], r["int8_grad_weight"]) for r in results] == [
        ("int8", "int8"),
        ("int8-switchback", "bf16"),
    ]
    for r in results:
        assert r["tokens_per_s"] > 0, r
        assert r["steps_run"] == 3 and r["loss_last10"] > 0
    md = (tmp_path / "precision.md").read_text()
    assert "| int8 |" in md and "| int8-switchback |" in md

"""The compiling step's line: a second process compiling the same graphs takes them from the
cache, and the line says so."""

import subprocess
import sys

from dtrain.run.compile_cache import CacheCounts, describe
from tests.conftest import ROOT, cli_env

COMPILE_TWICE = """
import logging, torch
from dtrain.run.compile_cache import CompileCacheNote
logging.basicConfig(level=logging.INFO, format="%(message)s")
f = torch.compile(lambda x: (x.sin() * 2).sum())
x = torch.randn(64, requires_grad=True)
with CompileCacheNote(1, True):
    f(x).backward()
"""


def _run(cache_dir) -> str:
    env = cli_env() | {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_TWICE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stderr


def test_a_second_process_says_its_graphs_came_from_the_cache(tmp_path):
    first = _run(tmp_path / "cache")
    assert "compiled 2 graphs; a second run of this config reuses them from" in first, first
    second = _run(tmp_path / "cache")
    assert "all 2 graphs came from the compile cache" in second, second
    assert str(tmp_path / "cache") in second


def test_the_line_counts_only_the_compiling_steps_graphs():
    assert describe(CacheCounts(3, 1), CacheCounts(3, 1), 1, 0.1) is None
    mixed = describe(CacheCounts(0, 0), CacheCounts(5, 2), 2, 40.0)
    assert mixed == (
        "torch.compile: step 2 took 40 s; 5 of 7 graphs came from the compile cache ("
        + mixed.split("(", 1)[1]
    )

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(
    shutil.which("ruff") is None, reason="ruff not installed (pip install -e .[dev])"
)
def test_ruff_clean():
    res = subprocess.run(
        ["ruff", "check", "dtrain", "launch", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout[-3000:]

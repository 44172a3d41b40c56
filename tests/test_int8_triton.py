"""The Triton int8 kernels, checked on CPU in Triton's interpreter (tests/int8_triton_interp.py,
in a subprocess with TRITON_INTERPRET=1): exact integer products against torch._int_mm, the
dequantizing epilogue and the quantize against the eager path bit for bit, odd shapes, strides,
chunked reductions, the int8 linear's forward and backward, torch.compile in one graph.

Skipped where Triton is not installed (CPU wheels of torch do not ship it, and CI does not
need it: the portable path and the dispatch are tested in test_int8_dispatch.py). The same
kernels compiled for a GPU: tests/gpu/test_int8_kernels.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_in_the_interpreter():
    env = cli_env()
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors only, even on a GPU machine
    env.pop("DTRAIN_INT8_KERNEL", None)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/int8_triton_interp.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]

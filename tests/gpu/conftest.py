"""tests/gpu: what only a CUDA machine can show (NCCL, bf16/fp8/int8 kernels, the allocator).

Marked `gpu` (one CUDA device) or `multigpu` (two); skipped where those are missing, so CPU CI
collects and skips them. Run them all with `bash bench/gpu_suite.sh` on a 2-GPU host.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA devices, found {n}"))
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def results():
    """The JSON summary bench/gpu_suite.sh asks for (DTRAIN_GPU_RESULTS), else None."""
    import os
    from pathlib import Path

    path = os.environ.get("DTRAIN_GPU_RESULTS")
    return Path(path) if path else None

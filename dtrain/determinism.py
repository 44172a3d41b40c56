"""trainer.deterministic: the same bits from the same start on CUDA, compiled or not.

Eager CUDA training in dtrain was repeatable where measured (the GPU suite resumes bit-exactly
on one H200 and on NCCL, cuDNN attention). Compiled, it was not: Inductor lowers the embedding's
gradient (an index_put with accumulate, fp32 under autocast) to a Triton kernel of atomic adds,
whose order changes from run to run. A compiled 1-GPU run resumed at step 15 drifted by up to
1.2e-4 in loss from the straight one (H200, 2026-11-27, docs/gpu-tests.md). torch's
deterministic mode makes Inductor fall back to ATen's sorted, deterministic kernel for such
scatters (lowering.py's index_put); Inductor's own flag skips the on-device benchmarks whose pick
changes the numerics; cuBLAS needs a fixed workspace.

Ops with no deterministic kernel warn instead of failing (warn_only): a run is not stopped by
one. That includes the flash and memory-efficient attention backward, whose deterministic path
torch takes only when warn_only is off; `trainer.attention_kernel=auto` on Hopper picks cuDNN
(the measured case).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

log = logging.getLogger("dtrain")

CUBLAS_WORKSPACE = ":4096:8"  # what torch's reproducibility notes ask for


@contextlib.contextmanager
def deterministic(enabled: bool, environ=os.environ):
    """Within: deterministic algorithms (ops without one warn rather than fail), Inductor's
    deterministic mode and cuBLAS's fixed workspace, unless the user set one. Everything is put
    back on exit (runs in one process, as tests start them, do not leak it into the next)."""
    if not enabled:
        yield
        return
    from torch._inductor import config as inductor

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        getattr(inductor, "deterministic", None),
        environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    # Read by cuBLAS when it makes a handle, at the process's first matmul: this runs before it.
    environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if before[2] is not None:  # torch versions without the flag have no such benchmarks
        inductor.deterministic = True
    log.info(
        "deterministic: torch deterministic algorithms, Inductor deterministic mode, "
        "CUBLAS_WORKSPACE_CONFIG=%s (slower; trainer.deterministic=false for speed)",
        environ["CUBLAS_WORKSPACE_CONFIG"],
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if before[2] is not None:
            inductor.deterministic = before[2]
        if before[3] is None:
            environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

"""Whether this Triton has Gluon for Hopper, which precision.int8_gemm=gluon and
int8_grouped_gemm's Gluon kernels are written against; no Triton import until asked."""

from __future__ import annotations

import functools


@functools.cache
def has_gluon_hopper() -> bool:
    """Gluon's Hopper language (wgmma, TMA, mbarriers) and `warp_specialize` taking a list of
    (function, arguments), as from Triton 3.6 (before it took the default partition apart)."""
    import inspect

    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait  # noqa
    except ImportError:
        return False
    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


def triton_version() -> str:
    """'this is Triton X.Y' or 'Triton is not installed', for an error message."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"this is Triton {version('triton')}"
    except PackageNotFoundError:
        return "Triton is not installed"

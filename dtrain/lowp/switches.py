"""The low-precision kernels' A/B switches: environment variables (DTRAIN_INT8_*,
DTRAIN_FP8_FIRST_STEP) that choose between ways of running the same computation, for benchmarks
that decide a default. Each is read where the layers are built; launch/train.py checks the
precision's first (check_switches), so a bad value stops the run in one line before anything
is written to the run dir."""

from __future__ import annotations

import functools
import os

from dtrain.config import say_choices
from dtrain.errors import ConfigError


def env_choice(env: str, choices: tuple[str, ...]) -> str:
    """`env`'s value, one of `choices`: the first when unset or empty; case and surrounding
    spaces ignored. Anything else is a ConfigError naming the variable and the choices."""
    value = os.environ.get(env, "").strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{env}={value!r} is not valid; choose {say_choices(choices)}")
    return value


# The GEMM kernel's switch (dtrain/lowp/int8_triton.py says what each does): here so the check
# at launch needs no Triton.
GEMM_VARIANTS = ("tma", "pointer", "gluon", "fastest")
GEMM_ENV = "DTRAIN_INT8_GEMM"
# The row-wise quantize op's tile (dtrain/lowp/int8_triton.py, QUANTIZE_TILES): "tuned" (one
# pass or two sweeps, autotuned per shape for contiguous rows) or "sweeps" (two sweeps of a
# fixed tile, the only way before the twenty-eighth session), for the A/B of the two.
QUANTIZE_TILE_CHOICES = ("tuned", "sweeps")
QUANTIZE_TILE_ENV = "DTRAIN_INT8_QUANTIZE_TILES"
# precision.int8_grad_weight=int8_grouped's GEMM on Hopper: "auto" (the default: the Gluon kernel
# where this Triton has Gluon for Hopper, else the Triton ones), "gluon" (dtrain/lowp/
# int8_grouped_gluon.py: warp-specialized, one warpgroup promoting while the other's MMAs run;
# 1.27-1.81x the Triton kernels on 1b's and 8b's grad-weights on an H200, bench/results/
# 2026-12-02-gpu-s31/; an error at launch without Gluon) or "triton" (dtrain/lowp/
# int8_grouped_triton.py), for their A/B. Where the Gluon kernel does not apply (not Hopper,
# operands TMA cannot read) the Triton kernels run whatever the choice.
GROUPED_GEMM_CHOICES = ("auto", "gluon", "triton")
GROUPED_GEMM_ENV = "DTRAIN_INT8_GROUPED_GEMM"
# fp8 delayed scaling's first step (no amax history yet, so dynamic scales) where the model
# compiles: "eager" (the default: only the delayed graphs are compiled) or "compiled" (that
# step's dynamic graphs compiled too, the only way before the forty-second session), for their
# A/B (dtrain/lowp/fp8_delayed.py).
FP8_FIRST_STEP_CHOICES = ("eager", "compiled")
FP8_FIRST_STEP_ENV = "DTRAIN_FP8_FIRST_STEP"


@functools.cache
def has_gluon_hopper() -> bool:
    """Whether this Triton has what dtrain/lowp/int8_grouped_gluon.py is written against:
    Gluon's Hopper language (wgmma, TMA, mbarriers) and `warp_specialize` taking a list of
    (function, arguments), as from Triton 3.6 (before it took the default partition apart)."""
    import inspect

    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait  # noqa
    except ImportError:
        return False
    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


def check_switches(precision: str) -> None:
    """Every A/B switch of `precision` (int8's DTRAIN_INT8_*, fp8's DTRAIN_FP8_FIRST_STEP):
    its value, or a ConfigError naming the bad one and its choices."""
    if precision == "fp8":
        env_choice(FP8_FIRST_STEP_ENV, FP8_FIRST_STEP_CHOICES)
    if precision != "int8":
        return
    from dtrain.lowp import int8 as i8
    from dtrain.lowp import int8_swiglu as sw

    for env, choices in (
        (i8.KERNEL_ENV, i8.KERNEL_CHOICES),
        (GEMM_ENV, GEMM_VARIANTS),
        (QUANTIZE_TILE_ENV, QUANTIZE_TILE_CHOICES),
        (i8.QUANTIZE_ENV, i8.QUANTIZE_MODES),
        (i8.GRAD_INPUT_ENV, i8.GRAD_INPUT_MODES),
        (sw.SWIGLU_ENV, sw.SWIGLU_MODES),
        (GROUPED_GEMM_ENV, GROUPED_GEMM_CHOICES),
    ):
        env_choice(env, choices)
    for env, choices, others in (
        (GROUPED_GEMM_ENV, GROUPED_GEMM_CHOICES, "auto or triton"),
        (GEMM_ENV, GEMM_VARIANTS, "tma or pointer"),
    ):
        if env_choice(env, choices) == "gluon" and not has_gluon_hopper():
            _no_gluon(env, others)


def _no_gluon(env: str, others: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = f"this is Triton {version('triton')}"
    except PackageNotFoundError:
        have = "Triton is not installed"
    raise ConfigError(
        f"{env}=gluon needs Triton's Gluon for Hopper (Triton 3.6 or later); "
        f"{have}: choose {others}"
    )

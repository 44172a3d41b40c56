"""precision=int8: every block linear's three matmuls in int8, a file per concern.

    linear.py          the layer (`apply_int8`, `Int8Linear`), which kernels run it, start-up lines
    options.py         `Int8Options`: precision.int8_*'s kernel choices as one value
    quant.py           the arithmetic every int8 module shares: quantize, int_mm, dequantize
    grouped.py         precision.int8_grad_weight=int8_grouped: scales per 128 tokens
    triton_gemm.py     the Triton GEMMs (TMA, pointer) and the quantize op, custom ops
    gluon_gemm.py      the warp-specialized Gluon GEMM (precision.int8_gemm=gluon / fastest)
    grouped_triton.py  int8_grouped's Triton GEMM and quantize, custom ops
    grouped_gluon.py   int8_grouped's Gluon GEMM on Hopper
    kernel_common.py   what the Triton and Gluon GEMMs share (autotuning's timer, tma_ok)
    gluon_support.py   whether this Triton has Gluon for Hopper; no Triton import until asked

The kernel modules import Triton: they are imported only where they run.
"""

from dtrain.lowp.int8.gluon_support import has_gluon_hopper, triton_version
from dtrain.lowp.int8.linear import GRAD_WEIGHT_MODES, Int8Linear, apply_int8
from dtrain.lowp.int8.options import INT8_KEYS, Int8Options

__all__ = [
    "GRAD_WEIGHT_MODES",
    "INT8_KEYS",
    "Int8Linear",
    "Int8Options",
    "apply_int8",
    "has_gluon_hopper",
    "triton_version",
]

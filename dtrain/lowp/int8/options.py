"""precision=int8's kernel choices as one value, built from precision.int8_* (dtrain/config.py
types them and says what each does) and handed to the layers that run them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Int8Options:
    kernel: str = "auto"  # auto | triton | torch: which kernels run the matmuls
    gemm: str = "tma"  # the Triton GEMM on large problems: tma | pointer | gluon | fastest
    quantize: str = "gradients"  # where quantizes run: gradients | fused | apart
    quantize_tiles: str = "tuned"  # the quantize op's tile: tuned | sweeps
    swiglu: str = "linears"  # linears | fused
    grouped_gemm: str = "auto"  # int8_grouped's GEMM on Hopper: auto | gluon | triton


# Each field is PrecisionConfig's int8_<field>.
INT8_KEYS = tuple(f.name for f in dataclasses.fields(Int8Options))

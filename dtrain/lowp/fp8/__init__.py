"""precision=fp8 through torchao's Float8Linear, a file per concern.

linear.py            the swap (`apply_fp8`), fsdp's fp8 weight shards cast once a step
delayed.py           precision.fp8_scaling=delayed: amax histories (imports torchao: import
                     its names from it, where delayed scaling is chosen)
layout.py            the weight-gradient GEMMs' transposes as their own op under compile
triton_transpose.py  that op's Triton kernel (imports Triton)
"""

from dtrain.lowp.fp8.linear import apply_fp8, fp8_shape_ok, precompute_fp8_scales

__all__ = ["apply_fp8", "fp8_shape_ok", "precompute_fp8_scales"]

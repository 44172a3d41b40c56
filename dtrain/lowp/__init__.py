"""Low-precision kernels and module swaps (int8 matmuls, fp8, loss scaling, 8-bit optimizers).

Imported lazily by dtrain.precision, only for the precisions that need them.
"""

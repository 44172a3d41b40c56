"""Low-precision kernels and module swaps: a package per precision (int8/, fp8/, optim8bit/),
beside the experimental wing's table (dispatch.py), fp16's loss scaling (scaling.py) and
precision=int8-torchao (torchao_ref.py).

Imported by dtrain.precision, only for the precisions that need them (README.md).
"""

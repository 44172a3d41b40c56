"""precision.optimizer_8bit: torchao's AdamW8bit, stepped in groups.

adamw.py        `build_adamw8bit`: GroupedAdamW8bit, torchao's states in a few compiled calls
triton_step.py  one tensor's step in one Triton kernel (CUDA, fp32 parameters)
"""

from dtrain.lowp.optim8bit.adamw import build_adamw8bit

__all__ = ["build_adamw8bit"]

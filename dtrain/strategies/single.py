"""strategy=single: one device (CUDA if present, else CPU). The base class is exactly this."""

from dtrain.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
    names = ("single",)
    options = ("compile_scope",)

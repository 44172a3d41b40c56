"""One block of model=tiny with int8 linears (SwitchBack), compiled on CPU: how many row-wise
quantizes the forward and backward graphs hold after AOTAutograd.
    TORCH_LOGS=post_grad_graphs python bench/results/2026-11-27-int8-graph/probe.py
"""
import sys, torch
sys.path.insert(0, ".")  # run from the repository root
from dtrain.config import compose
from dtrain.model import build_model, rope_tables
from dtrain.lowp.int8 import apply_int8
cfg = compose(["model=tiny", "model.n_layer=1"]); cfg.model.vocab_size = 256
m = build_model(cfg.model, "cpu")
n = apply_int8(m, lambda mod, fqn: "layers" in fqn, grad_weight="bf16", kernel="torch")
blk = m.layers["0"]
T = 64
rope = m.rope_cache[:T] if m.rope_cache.numel() else rope_tables(cfg.model.head_dim, T, cfg.model.rope_theta)
x = torch.randn(2, T, cfg.model.d_model, requires_grad=True)
out = blk(x, rope); tup = isinstance(out, tuple)
f = torch.compile(lambda x: blk(x, rope)[0] if tup else blk(x, rope))
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = f(x)
y.float().sum().backward()
print("swapped", n)

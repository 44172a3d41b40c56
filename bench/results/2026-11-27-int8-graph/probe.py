"""One block of model=tiny with int8 linears (SwitchBack), compiled on CPU: how many row-wise
quantizes the forward and backward graphs hold after AOTAutograd (one aten.amax each).

    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TORCH_LOGS=post_grad_graphs \
        python bench/results/2026-11-27-int8-graph/probe.py 2> graphs.log
"""

import sys

import torch

sys.path.insert(0, ".")  # run from the repository root
from dtrain.config import compose  # noqa: E402
from dtrain.lowp.int8 import apply_int8  # noqa: E402
from dtrain.model import build_model, rope_tables  # noqa: E402

cfg = compose(["model=tiny", "model.n_layer=1"])
cfg.model.vocab_size = 256
model = build_model(cfg.model, "cpu")
swapped = apply_int8(model, lambda mod, fqn: "layers" in fqn, grad_weight="bf16", kernel="torch")
block = model.layers["0"]
T = 64
rope = rope_tables(cfg.model.head_dim, T, cfg.model.rope_theta)
x = torch.randn(2, T, cfg.model.d_model, requires_grad=True)
returns_tuple = isinstance(block(x, rope), tuple)
step = torch.compile(lambda x: block(x, rope)[0] if returns_tuple else block(x, rope))
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = step(x)
y.float().sum().backward()
print("swapped", swapped)

"""On a CUDA device: dtrain's grouped, compiled step of torchao's AdamW8bit (dtrain/lowp/
optim8bit.py) against torchao's own compiled per-tensor step, and its Triton kernel's codes
against torchao's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_grouped_step_matches_torchaos_compiled_step():
    """model=tiny's shapes, 3 steps from the same gradients: the same parameters and 8-bit
    states as torchao's (Inductor may fuse the two differently, and the Triton kernel is
    another compilation: equal to fp32 rounding, but for the rare code rounded the other way),
    from fewer compiled graphs than tensors."""
    pytest.importorskip("torchao")
    from torch._dynamo.utils import counters
    from torchao.optim import AdamW8bit

    from dtrain.config import OptimConfig, compose
    from dtrain.lowp.optim8bit import build_adamw8bit
    from dtrain.model import build_model
    from dtrain.optim import param_groups

    cuda = torch.device("cuda")
    mcfg = compose(["model=tiny"]).model
    mcfg.vocab_size = 512
    cfg = OptimConfig(lr=1e-3)
    ours, ref = build_model(mcfg, cuda, seed=0), build_model(mcfg, cuda, seed=0)
    torch._dynamo.reset()
    counters.clear()
    opt = build_adamw8bit(ours, cfg)
    betas = (cfg.beta1, cfg.beta2)
    groups = param_groups(ref, cfg.weight_decay)
    ref_opt = AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    gen = torch.Generator(device=cuda).manual_seed(0)
    for step in range(3):
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=gen, device=cuda) * 1e-2
            b.grad = a.grad.clone()
        opt.step()
        if step == 0:  # before torchao's own graphs count too
            graphs = counters["stats"]["unique_graphs"]
        ref_opt.step()
    n = sum(1 for _ in ours.parameters())
    assert graphs < n / 2, (graphs, n)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        # Equal to fp32 rounding but where a code rounded the other way (below): that moves
        # an element by a fraction of a step (the coarsest code is 1.4% of its block's max).
        close = torch.isclose(a, b, rtol=1e-6, atol=1e-7).float().mean()
        assert close > 0.999 and (a - b).abs().max() < 0.1 * cfg.lr, (a - b).abs().max()
    codes = [
        (opt.state[a]["exp_avg"].codes, ref_opt.state[b]["exp_avg"].codes)
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True)
        if hasattr(opt.state[a]["exp_avg"], "codes")
    ]
    assert codes
    # Every fp32 tensor with 8-bit moments took the Triton kernel (optim8bit/triton_step.py).
    assert sum(len(fused) for fused, _ in opt._chunks.values()) == len(codes)
    for x, y in codes:  # a code may round to its neighbour where fp32 differs in its last bit
        off = (x.int() - y.int()).abs()
        assert off.max() <= 1 and (off > 0).float().mean() < 1e-2, (off > 0).float().mean()


def test_the_kernels_quantizer_gives_torchaos_codes_on_cuda():
    """The kernel's codes computed with the GPU's approximate log2 and exp2: torchao's, bit for
    bit (tests/optim8bit_quantize_check.py)."""
    pytest.importorskip("torchao")
    from tests.optim8bit_quantize_check import mismatches

    result = mismatches(torch.device("cuda"))
    assert len(result) == 6
    assert all(bad == 0 and n > 400_000 for n, bad in result.values()), result

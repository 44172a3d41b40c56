"""trainer.attention_kernel: the chosen SDPA kernel goes first in torch's priority order for the
run, the others stay enabled behind it, AOTAutograd's cache is off meanwhile, and torch's order
comes back afterwards."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
from torch.nn.attention import SDPBackend

from dtrain.attention import _BACKENDS, KERNELS, attention_kernel
from tests.conftest import FAST, launch, train


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient", "math"])
def test_chosen_kernel_goes_first_and_torchs_order_returns(name):
    before = torch._C._get_sdp_priority_order()
    cache = functorch_config.enable_autograd_cache
    with attention_kernel(name):
        order = torch._C._get_sdp_priority_order()
        assert SDPBackend(order[0]) == _BACKENDS[name]
        assert order[1:] == [i for i in before if i != order[0]]  # the rest in torch's order
        # every kernel stays enabled as a fallback for shapes the first cannot take
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        # AOTAutograd's cache would hand back a graph traced under another kernel order
        assert functorch_config.enable_autograd_cache is False
    assert torch._C._get_sdp_priority_order() == before
    assert functorch_config.enable_autograd_cache == cache


def test_auto_changes_nothing():
    before = torch._C._get_sdp_priority_order()
    cache = functorch_config.enable_autograd_cache
    with attention_kernel("auto"):
        assert torch._C._get_sdp_priority_order() == before
        assert functorch_config.enable_autograd_cache == cache


def test_a_run_computes_attention_with_the_chosen_kernel_first(tmp_path, monkeypatch):
    """Every attention call of a run (training, eval, samples) sees the chosen kernel first.
    (On CPU torch runs its one fused kernel whatever the order; the GPU benchmark
    bench/attention_kernels.py shows the kernels that really ran there.)"""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(SDPBackend(torch._C._get_sdp_priority_order()[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    train(
        tmp_path / "run",
        "trainer.attention_kernel=math",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        "strategy.compile=false",
    )
    assert seen and set(seen) == {SDPBackend.MATH}
    assert SDPBackend(torch._C._get_sdp_priority_order()[0]) != SDPBackend.MATH


def test_bad_kernel_exits_2_with_the_choices(tmp_path):
    res = launch(*FAST, "trainer.attention_kernel=fast", f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and ", ".join(KERNELS) in lines[0], res.stderr

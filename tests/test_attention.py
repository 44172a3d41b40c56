"""trainer.attention_kernel: the chosen SDPA kernel goes first in torch's priority order for the
run, the others stay behind it, and torch's order comes back afterwards."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from dtrain.attention import KERNELS, attention_kernel
from tests.conftest import FAST, launch, train

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient", "math"])
def test_chosen_kernel_goes_first_and_torchs_order_returns(name):
    before = torch._C._get_sdp_priority_order()
    with attention_kernel(name, CPU):
        order = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
        assert order[0].name.lower().startswith({"efficient": "efficient"}.get(name, name))
        # every kernel stays enabled as a fallback for shapes the first cannot take
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before


def test_auto_leaves_torchs_order_alone():
    before = torch._C._get_sdp_priority_order()
    with attention_kernel("auto", CPU):
        assert torch._C._get_sdp_priority_order() == before


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

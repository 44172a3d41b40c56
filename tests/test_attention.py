"""trainer.attention_kernel: the chosen SDPA kernel goes first in torch's priority order for the
run, the others stay enabled behind it, compile caches key on the choice, and torch's order
comes back afterwards."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.compiler.config as compiler_config
from torch.nn.attention import SDPBackend

from dtrain.attention import _BACKENDS, KERNELS, attention_kernel
from tests.conftest import FAST, launch, train


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient", "math"])
def test_chosen_kernel_goes_first_and_torchs_order_returns(name):
    before = torch._C._get_sdp_priority_order()
    tag = compiler_config.cache_key_tag
    with attention_kernel(name):
        order = torch._C._get_sdp_priority_order()
        assert SDPBackend(order[0]) == _BACKENDS[name]
        # the rest in torch's order (torch 2.6 repeats math at the end when it was named first)
        rest = order[1:-1] if torch.__version__ < "2.7" and order[1:].count(order[0]) else order[1:]
        assert rest == [i for i in before if i != order[0]]
        # every kernel stays enabled as a fallback for shapes the first cannot take
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        # compile caches key on the kernel: no graph traced under another order comes back
        assert compiler_config.cache_key_tag.endswith(f"sdpa={name}")
    assert torch._C._get_sdp_priority_order() == before
    assert compiler_config.cache_key_tag == tag


def test_auto_changes_nothing():
    before = torch._C._get_sdp_priority_order()
    tag = compiler_config.cache_key_tag
    with attention_kernel("auto"):
        assert torch._C._get_sdp_priority_order() == before
        assert compiler_config.cache_key_tag == tag


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


@pytest.mark.skipif(
    not functorch_config.enable_autograd_cache,
    reason="AOTAutograd's on-disk cache is off in this torch (off by default before 2.7)",
)
def test_a_graph_compiled_under_a_named_kernel_is_not_reused_by_another_choice():
    """torch's AOTAutograd cache keys a graph without the SDPA order: without the cache-key tag,
    a run with `auto` would get back (from disk) the graph an earlier run traced with `math`
    first. With it the second compile misses, and a third (same choice again) hits."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from torch._inductor import utils as inductor_utils

    # named fresh_inductor_cache before torch 2.7
    fresh_cache = (
        getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    )

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    def compile_and_run() -> dict:
        torch._dynamo.reset()  # nothing in memory: what comes back comes from the cache
        counters.clear()
        torch.compile(f)(torch.randn(1, 2, 16, 8, requires_grad=True)).backward()
        return dict(counters["aot_autograd"])

    with fresh_cache():
        with attention_kernel("math"):
            assert compile_and_run().get("autograd_cache_saved") == 1
        assert "autograd_cache_hit" not in compile_and_run()  # auto: not math's graph
        assert compile_and_run().get("autograd_cache_hit") == 1  # auto again: its own graph
    torch._dynamo.reset()

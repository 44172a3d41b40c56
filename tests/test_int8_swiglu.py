"""precision=int8's fused SwiGLU (dtrain/lowp/experimental/int8_swiglu.py, precision.int8_swiglu=
fused) on the
portable path: bitwise the three Int8Linear layers' numbers, in a whole model's loss and every
gradient; what it keeps for backward; the swap, its guards and its one line. The Triton kernels
it runs on a GPU: tests/int8_triton_interp.py (interpreter) and tests/gpu/test_int8_kernels.py."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from dtrain.config import PrecisionConfig
from dtrain.errors import ConfigError
from dtrain.lowp.experimental import int8_swiglu as sw
from dtrain.lowp.int8 import linear as i8
from dtrain.model import FeedForward, ModelConfig, build_model
from dtrain.precision import apply_precision, build_precision
from tests.conftest import FAST, launch, train_losses

CPU = torch.device("cpu")
TINY = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=96, max_seq_len=64)


def _int8_model(swiglu: str, grad_weight: str = "bf16") -> nn.Module:
    model = build_model(TINY, CPU, seed=0)
    cfg = PrecisionConfig("int8", int8_grad_weight=grad_weight, int8_swiglu=swiglu)
    apply_precision(model, build_precision(cfg, CPU))
    return model


def _loss_and_grads(model: nn.Module):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (2, 32), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, torch.roll(x, -1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grad_weight", ["bf16", "int8", "int8_grouped"])
def test_fused_swiglu_is_the_three_linears_bit_for_bit(grad_weight):
    ref = _int8_model("linears", grad_weight)
    fused = _int8_model("fused", grad_weight)
    ffns = [m for m in fused.modules() if isinstance(m, FeedForward)]
    assert len(ffns) == TINY.n_layer and all(type(m) is not FeedForward for m in ffns)
    assert all(type(m) is FeedForward for m in ref.modules() if isinstance(m, FeedForward))
    loss_r, grads_r = _loss_and_grads(ref)
    loss_f, grads_f = _loss_and_grads(fused)
    assert torch.equal(loss_f, loss_r)
    assert grads_f.keys() == grads_r.keys()
    for name, g in grads_r.items():
        assert torch.equal(grads_f[name], g), name


def test_fused_swiglu_keeps_less_for_backward():
    """Saved for backward by one SwiGLU, in bytes: the fused function keeps x's int8 once, not
    silu(a) (autograd's product keeps it) and not w2's int8 input (its backward recomputes it),
    so less than the three layers and the eager gate."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, ffn_hidden=192)

    def saved_bytes(ffn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            if not isinstance(t, nn.Parameter):
                total += t.numel() * t.element_size()
            return t

        x = torch.randn(4, 16, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ffn(x).float().sum().backward()
        return total

    ref, fused = FeedForward(cfg), FeedForward(cfg)
    for m in (ref, fused):
        i8.apply_int8(m, lambda m, n: True, grad_weight="bf16")
    assert sw.fuse_swiglu(fused) == 1
    tokens, hidden = 64, 192
    silu_a = tokens * hidden * 2  # bf16
    x_int8 = tokens * 64 + tokens * 4  # int8 values and fp32 scales
    h_int8 = tokens * hidden + tokens * 4
    assert saved_bytes(ref) - saved_bytes(fused) == silu_a + x_int8 + h_int8


def test_the_swap_keeps_parameters_and_skips_what_it_cannot_run():
    cfg = ModelConfig(d_model=32, ffn_hidden=64)
    ffn = FeedForward(cfg)
    keys = list(ffn.state_dict())
    assert sw.fuse_swiglu(ffn) == 0  # plain nn.Linear layers: not int8
    i8.apply_int8(ffn, lambda m, n: True)
    assert sw.fuse_swiglu(ffn) == 1 and isinstance(ffn, FeedForward)
    assert list(ffn.state_dict()) == keys and type(ffn).__name__ == "Int8FusedFeedForward"
    assert sw.fuse_swiglu(ffn) == 0  # already fused
    mixed = FeedForward(cfg)
    i8.apply_int8(mixed, lambda m, n: True)
    mixed.w2.grad_weight = "bf16"  # the three must run alike (the others: int8)
    assert sw.fuse_swiglu(mixed) == 0
    half = FeedForward(cfg)
    i8.apply_int8(half, lambda m, n: n != "w2")  # w2 left in bf16
    assert sw.fuse_swiglu(half) == 0


def test_the_mode_is_said_once_and_checked(caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        _int8_model("fused")
    said = [r.getMessage() for r in caplog.records if "int8 SwiGLU" in r.getMessage()]
    assert said == ["int8 SwiGLU: 2 gate(s) as one function (precision.int8_swiglu)"]
    bad = PrecisionConfig("int8", int8_swiglu="sideways")
    with pytest.raises(ConfigError, match="precision.int8_swiglu='sideways' is not valid; choose"):
        build_precision(bad, CPU)


def test_fused_swiglu_compiles_in_one_graph():
    """fullgraph=True through the fused function (aot_eager: AOTAutograd traces forward and
    backward as Inductor would); the gradients are eager's, bit for bit."""
    torch._dynamo.reset()
    cfg = ModelConfig(d_model=64, ffn_hidden=192)
    ffn = FeedForward(cfg)
    i8.apply_int8(ffn, lambda m, n: True, grad_weight="bf16")
    assert sw.fuse_swiglu(ffn) == 1
    x = torch.randn(4, 16, 64)

    def loss_fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ffn(x).float().pow(2).mean()

    torch.compile(loss_fn, backend="aot_eager", fullgraph=True)(x).backward()
    grads = [p.grad.clone() for p in ffn.parameters()]
    ffn.zero_grad()
    loss_fn(x).backward()
    for g, p in zip(grads, ffn.parameters(), strict=True):
        assert torch.equal(g, p.grad)  # aot_eager runs the same eager ops


@pytest.mark.parametrize(
    "frozen", [("w1",), ("w2",), ("w1", "w3"), ("w1", "w3", "x"), ("w2", "x")], ids="-".join
)
def test_only_the_gradients_asked_for_are_computed_and_they_are_the_linears(frozen):
    """Frozen weights (and an input without grad) get no gradient, and the others are the
    unfused layers' bit for bit: the backward skips what autograd does not need, and with w2's
    gradient alone it recomputes w2's input without the gate's backward."""
    cfg = ModelConfig(d_model=64, ffn_hidden=192)
    torch.manual_seed(0)
    ref = FeedForward(cfg)
    fused = FeedForward(cfg)
    fused.load_state_dict(ref.state_dict())
    for m in (ref, fused):
        i8.apply_int8(m, lambda m, n: True, grad_weight="bf16")
        for name in frozen:
            if name != "x":
                getattr(m, name).weight.requires_grad_(False)
    assert sw.fuse_swiglu(fused) == 1
    x = torch.randn(4, 16, 64, requires_grad="x" not in frozen)
    grads = []
    for m in (ref, fused):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x).float().pow(2).mean().backward()
        got = {n: getattr(m, n).weight.grad for n in ("w1", "w3", "w2")}
        got["x"] = None if x.grad is None else x.grad.clone()
        assert {n for n, g in got.items() if g is None} == set(frozen)
        grads.append(got)
    for name, r in grads[0].items():
        assert r is None or torch.equal(r, grads[1][name]), name


def test_fused_swiglu_trains_as_the_linears_alone_and_under_fsdp(tmp_path):
    """Whole runs: one process with the fused SwiGLU has the unfused run's losses exactly, and
    fsdp on two ranks (gloo; each block's weights gathered when the fused forward reads them)
    has them within the two-rank int8 tolerance of tests/test_precision_ddp.py."""
    steps = [*FAST, "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]
    steps += ["precision=int8", "precision.int8_grad_weight=bf16"]
    fused = ["precision.int8_swiglu=fused"]
    runs = {
        "linears": launch(*steps, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/l"),
        "fused": launch(
            *steps, *fused, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/f"
        ),
        "fsdp": launch(
            *steps,
            *fused,
            "strategy=fsdp",
            "trainer.micro_batch_size=4",
            f"hydra.run.dir={tmp_path}/d",
            nproc=2,
        ),
    }
    for name, res in runs.items():
        assert res.returncode == 0, (name, res.stderr[-3000:])
    said = re.compile(r"int8 SwiGLU: [1-9]\d* gate\(s\) as one function")  # every block's
    assert said.search(runs["fused"].stderr + runs["fused"].stdout)
    assert not said.search(runs["linears"].stderr + runs["linears"].stdout)
    lin, fus, fsdp = (train_losses(tmp_path / d) for d in "lfd")
    assert sorted(lin) == sorted(fus) == sorted(fsdp) == [1, 2, 3]
    assert lin == fus
    for step in lin:
        assert abs(fsdp[step] - lin[step]) <= 2e-3 * abs(lin[step]), (step, lin, fsdp)

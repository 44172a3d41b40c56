"""The fused, chunked linear + cross-entropy (dtrain/fused_loss.py) against the plain
F.cross_entropy over the full logits: loss and gradients, in the model, compiled, in training
(single and 2-rank FSDP) and in the memory planner."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dtrain.errors import ConfigError
from dtrain.fused_loss import (
    IGNORE_INDEX,
    default_chunk_tokens,
    fused_linear_cross_entropy,
    fused_loss_active,
)
from dtrain.model import GPT, LMHead, ModelConfig, build_model
from tests.conftest import FAST, compose, launch, train, train_losses

# fp32: the fused loss sums the same terms in another order (per chunk, then over chunks), so
# it agrees to rounding: 1e-5 relative is ~100x fp32's epsilon, far below any wrong term.
RTOL_FP32 = 1e-5
# bf16: both paths round the logits to bf16 alike and take the loss in fp32 (1e-5 for the
# loss); the gradients are rounded to bf16 per chunk rather than once, and their matmuls sum in
# another order: within 2 bf16 ulps (2^-7) of the largest element.
RTOL_BF16_LOSS = 1e-5
ATOL_BF16_GRAD = 2**-7


def plain(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=IGNORE_INDEX)


def inputs(n=37, d=16, v=50, dtype=torch.float32, seed=0, ignored=(3, 10, 36)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=gen) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    t[list(ignored)] = IGNORE_INDEX
    return x, w, t


def loss_and_grads(fn, x, w, t):
    x.grad = w.grad = None
    loss = fn(x, w, t)
    loss.backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


def assert_rel(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    scale = b.abs().max().clamp_min(1e-30)
    err = (a.float() - b.float()).abs().max()
    assert err <= rtol * scale, f"max error {err:.3g} against {rtol:.3g} x {scale:.3g}"


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])  # one token, odd splits, one, more
def test_fp32_matches_cross_entropy(chunk):
    x, w, t = inputs()
    want = loss_and_grads(plain, x, w, t)
    got = loss_and_grads(
        lambda x, w, t: fused_linear_cross_entropy(x, w, t, chunk_tokens=chunk), x, w, t
    )
    for a, b in zip(got, want, strict=True):
        assert_rel(a, b, RTOL_FP32)


def test_bf16_matches_cross_entropy_over_bf16_logits():
    x, w, t = inputs(n=64, d=32, v=300, dtype=torch.bfloat16)
    loss0, gx0, gw0 = loss_and_grads(plain, x, w, t)
    fused = lambda x, w, t: fused_linear_cross_entropy(x, w, t, chunk_tokens=24)  # noqa: E731
    loss1, gx1, gw1 = loss_and_grads(fused, x, w, t)
    assert loss1.dtype == torch.float32 and gx1.dtype == gw1.dtype == torch.bfloat16
    assert_rel(loss1, loss0, RTOL_BF16_LOSS)
    assert_rel(gx1, gx0, ATOL_BF16_GRAD)
    assert_rel(gw1, gw0, ATOL_BF16_GRAD)


def test_autocast_computes_in_its_dtype_and_returns_grads_in_the_inputs():
    """Under autocast (fp32 weights, bf16 matmuls) the fused loss casts explicitly, as autocast
    casts F.linear's inputs, and hands back fp32 gradients."""
    x, w, t = inputs(n=40, d=32, v=200)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(plain, x, w, t)
        got = loss_and_grads(
            lambda x, w, t: fused_linear_cross_entropy(x, w, t, chunk_tokens=16), x, w, t
        )
    assert got[1].dtype == got[2].dtype == torch.float32
    assert_rel(got[0], want[0], RTOL_BF16_LOSS)
    assert_rel(got[1], want[1], ATOL_BF16_GRAD)
    assert_rel(got[2], want[2], ATOL_BF16_GRAD)


def test_scales_by_the_loss_gradient_and_counts_only_targets():
    """The saved gradients follow a loss scaled after the fact (gradient accumulation's 1/n,
    fp16's loss scale); an ignored token changes neither the loss nor any gradient row but its
    own, which is zero."""
    x, w, t = inputs(ignored=(0, 1))
    want = loss_and_grads(plain, x, w, t)
    scaled = lambda x, w, t: fused_linear_cross_entropy(x, w, t, chunk_tokens=4) * 3.0  # noqa: E731
    _, gx, gw = loss_and_grads(scaled, x, w, t)
    assert_rel(gx, 3.0 * want[1], RTOL_FP32)
    assert_rel(gw, 3.0 * want[2], RTOL_FP32)
    assert gx[:2].abs().max() == 0 and gx[2:].abs().max() > 0


def test_without_gradients_gives_the_same_loss():
    x, w, t = inputs()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, t, chunk_tokens=6)
    assert_rel(loss, plain(x, w, t).detach(), RTOL_FP32)


def test_default_chunk_keeps_a_chunk_of_fp32_logits_small():
    assert default_chunk_tokens(50304) == 1024  # 206 MB of fp32 logits, not 3.3 GB for 16k
    assert default_chunk_tokens(320) == 2**17  # 209,715 tokens fit: the power of two below
    assert default_chunk_tokens(2**30) == 1


def test_auto_fuses_on_cuda_in_bf16_only():
    assert fused_loss_active("auto", "cuda", torch.bfloat16)
    assert not fused_loss_active("auto", "cpu", torch.bfloat16)
    assert not fused_loss_active("auto", "cuda", torch.float16)
    assert not fused_loss_active("auto", "cuda", torch.float32)
    assert fused_loss_active("fused", "cpu", torch.float32)
    assert not fused_loss_active("plain", "cuda", torch.bfloat16)
    assert not fused_loss_active("fused", "cuda", torch.bfloat16, plain_head=False)


# --- in the model ----------------------------------------------------------------------------


def tiny(kernel: str, tied: bool, chunk: int | None = 7) -> GPT:
    cfg = ModelConfig(
        n_layer=2, n_head=2, d_model=32, vocab_size=97, max_seq_len=16, tie_embeddings=tied
    )
    return build_model(replace(cfg, loss_kernel=kernel, loss_chunk_tokens=chunk), "cpu", seed=1)


def model_grads(model: GPT, idx, targets, autocast: bool = False, run=None):
    """The loss and every parameter's gradient of `model`, called through `run` (e.g. its
    compiled wrapper) where given."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = (model if run is None else run)(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_model_fused_matches_plain(tied, autocast):
    """Every parameter's gradient, the embedding's included where the head is tied to it."""
    idx = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(2))
    targets = idx.roll(-1, 1)
    targets[:, -1] = IGNORE_INDEX
    loss0, g0 = model_grads(tiny("plain", tied), idx, targets, autocast)
    fused = tiny("fused", tied)
    assert isinstance(fused.output, LMHead)
    loss1, g1 = model_grads(fused, idx, targets, autocast)
    assert ("output.weight" in g1) != tied
    assert_rel(loss1, loss0, RTOL_BF16_LOSS if autocast else RTOL_FP32)
    # bf16 rounding of the head's gradients flows through every block below it.
    rtol = 2**-5 if autocast else RTOL_FP32 * 10
    for name in g0:
        assert_rel(g1[name], g0[name], rtol)


def test_model_without_targets_still_returns_logits():
    model = tiny("fused", tied=False)
    idx = torch.randint(0, 97, (2, 5))
    assert model(idx).shape == (2, 5, 97)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_whole_model_compiled_traces_the_fused_loss(backend):
    """Compiled with the model (strategy.compile_scope=model), Dynamo traces the Function and
    its chunk loop in one graph: fullgraph, no break."""
    torch._dynamo.reset()
    idx = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    targets = idx.roll(-1, 1)
    loss0, g0 = model_grads(tiny("plain", tied=True), idx, targets)
    fused = tiny("fused", tied=True)
    compiled = torch.compile(fused, backend=backend, fullgraph=True)
    loss1, g1 = model_grads(fused, idx, targets, run=compiled)
    assert_rel(loss1, loss0, RTOL_FP32)
    for name in g0:
        assert_rel(g1[name], g0[name], RTOL_FP32 * 10)


@pytest.mark.slow
def test_compiled_chunk_with_inductor_matches():
    """The chunk compiled apart (compile_blocks's loss_chunk_fn), through Inductor on CPU."""
    from dtrain.fused_loss import chunk_loss_and_grads

    torch._dynamo.reset()
    chunk_fn = torch.compile(chunk_loss_and_grads, dynamic=False)
    x, w, t = inputs()
    want = loss_and_grads(plain, x, w, t)
    got = loss_and_grads(
        lambda x, w, t: fused_linear_cross_entropy(x, w, t, chunk_tokens=8, chunk_fn=chunk_fn),
        x,
        w,
        t,
    )
    for a, b in zip(got, want, strict=True):
        assert_rel(a, b, RTOL_FP32)


# --- config and planner ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.loss_kernel=fused", "precision=fp16"],
        ["model.loss_kernel=fused", "precision=fp8", "precision.fp8_lm_head=true"],
        ["model.loss_chunk_tokens=0"],
        ["model.loss_kernel=chunked"],
    ],
)
def test_config_refuses_what_the_fused_loss_cannot_do(overrides):
    with pytest.raises(ConfigError, match="loss_"):
        compose(*FAST, *overrides)


def test_planner_replaces_the_logits_by_one_chunk():
    from dtrain.memory.activations import head_activation_bytes, loss_transient_bytes
    from dtrain.memory.setup import MemorySetup
    from dtrain.precision import PRECISIONS

    cfg = ModelConfig(n_layer=2, n_head=16, d_model=2048, vocab_size=50304, tie_embeddings=True)
    setup = MemorySetup(
        strategy="single",
        precision=PRECISIONS["bf16"],
        micro_batch_size=8,
        seq_len=2048,
        compile=True,
    )
    plain_cfg, fused_cfg = replace(cfg, loss_kernel="plain"), replace(cfg, loss_kernel="auto")
    tokens, v, d = 8 * 2048, 50304, 2048
    saved = head_activation_bytes(plain_cfg, setup) - head_activation_bytes(fused_cfg, setup)
    # The bf16 logits and one fp32 lse a token, less the bf16 head-weight gradient kept.
    assert saved == 2 * tokens * v + 4 * tokens - 2 * v * d
    # The backward's bf16 gradient of the logits against one 1024-token chunk's work and the
    # head-weight gradient's accumulator.
    assert loss_transient_bytes(plain_cfg, setup) == 2 * tokens * v
    fused = loss_transient_bytes(fused_cfg, setup)
    assert fused == 4 * 1024 * v + 6 * v * d + 2 * (tokens * d + v * d)
    assert fused < loss_transient_bytes(plain_cfg, setup) * 0.7
    cpu = replace(setup, device="cpu")  # auto: the plain loss off CUDA
    assert head_activation_bytes(fused_cfg, cpu) == head_activation_bytes(plain_cfg, cpu)


# --- training ----------------------------------------------------------------------------------

STEPS = [
    "trainer.max_steps=6",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint.every_n_steps=0",
    "model.tie_embeddings=true",
]


def assert_same_losses(a: dict, b: dict, rtol: float = RTOL_FP32) -> None:
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:
        assert abs(a[s] - b[s]) <= rtol * abs(a[s]), (s, a[s], b[s])


def test_training_fused_matches_plain_single(tmp_path):
    plain_run, fused_run = tmp_path / "plain", tmp_path / "fused"
    train(plain_run, *STEPS, "model.loss_kernel=plain")
    train(fused_run, *STEPS, "model.loss_kernel=fused", "model.loss_chunk_tokens=100")
    assert_same_losses(train_losses(plain_run), train_losses(fused_run))


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp",
        "ddp",
        pytest.param(
            "zero3",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
            ),
        ),
    ],
)
def test_training_fused_on_two_ranks_matches_single(tmp_path, strategy):
    """Two ranks; under fsdp and zero3 the head's weight is a shard that the wrapper gathers
    before the head module runs (LMHead takes the targets for that reason)."""
    single, multi = tmp_path / "single", tmp_path / strategy
    train(single, *STEPS, "model.loss_kernel=plain", "trainer.micro_batch_size=8")
    res = launch(
        *FAST,
        *STEPS,
        f"strategy={strategy}",
        "model.loss_kernel=fused",
        "model.loss_chunk_tokens=100",
        "trainer.micro_batch_size=4",
        f"hydra.run.dir={multi}",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert_same_losses(train_losses(single), train_losses(multi))

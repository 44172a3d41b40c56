"""Precisions: int8 really runs int8 (kernels, saved activations, accuracy), fp16 loss scaling
skips and counts overflows, bf16-true/fp8/int8-torchao/8-bit AdamW train, bad combos exit 2."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.config import OptimConfig, PrecisionConfig, StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.lowp.int8 import linear as i8
from dtrain.model import ModelConfig, build_model
from dtrain.precision import (
    INT8_GRAD_WEIGHT_DEFAULT,
    PRECISIONS,
    apply_precision,
    build_precision,
    check_strategy,
    render_table,
)
from dtrain.strategies.single import SingleStrategy
from tests.conftest import FAST, ROOT, launch, read_jsonl, train

CPU = torch.device("cpu")
TINY = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, vocab_size=96, max_seq_len=64)


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - x.float()).pow(2).sum())).item()


class CountOps(TorchDispatchMode):
    """Counts aten ops as they are dispatched (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _tiny(precision: str, grad_weight: str | None = None) -> nn.Module:
    model = build_model(TINY, CPU, seed=0)
    cfg = PrecisionConfig(name=precision, int8_grad_weight=grad_weight)
    apply_precision(model, build_precision(cfg, CPU))
    return model


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (2, 32), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _swapped_grad_weight_modes(model: nn.Module) -> set[str]:
    return {m.grad_weight for m in model.modules() if isinstance(m, i8.Int8Linear)}


# --- int8: the path is really taken --------------------------------------------------------


def test_int8_swaps_only_the_blocks_linears_and_keeps_parameters():
    plain = build_model(TINY, CPU, seed=0)
    names = {n: p.shape for n, p in plain.named_parameters()}
    model = _tiny("int8")
    swapped = [n for n, m in model.named_modules() if isinstance(m, i8.Int8Linear)]
    assert len(swapped) == TINY.n_layer * 7  # wq wk wv wo w1 w2 w3
    assert all(n.startswith("layers.") for n in swapped)
    assert type(model.output) is nn.Linear  # LM head stays bf16
    assert type(model.tok_embeddings) is nn.Embedding
    # Same parameters under the same names, fp32 masters: checkpoints and optimizers unchanged.
    assert {n: p.shape for n, p in model.named_parameters()} == names
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_int8_kernel_runs_in_forward_and_both_backward_matmuls():
    model = _tiny("int8", grad_weight="int8")
    assert _swapped_grad_weight_modes(model) == {"int8"}
    x, y = _batch()
    with CountOps() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    forward_calls = ops.counts.get("_int_mm", 0)
    with CountOps() as ops:
        loss.backward()
    n_linears = TINY.n_layer * 7
    assert forward_calls == n_linears
    assert ops.counts.get("_int_mm", 0) == 2 * n_linears  # grad_input and grad_weight
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_int8_grad_weight_default_is_the_same_in_yaml_and_code():
    from omegaconf import OmegaConf

    # int8.yaml states the default; no other precision's yaml may set the key (an error there).
    keys = {
        f.stem: OmegaConf.load(f).get("int8_grad_weight")
        for f in (ROOT / "conf" / "precision").glob("*.yaml")
    }
    assert keys.pop("int8") == INT8_GRAD_WEIGHT_DEFAULT
    assert set(keys.values()) == {None}, keys
    assert build_precision(PrecisionConfig(name="int8"), CPU).int8_grad_weight == (
        INT8_GRAD_WEIGHT_DEFAULT
    )
    assert _swapped_grad_weight_modes(_tiny("int8")) == {INT8_GRAD_WEIGHT_DEFAULT}


def test_int8_grad_weight_bf16_takes_one_int8_matmul_less_per_linear():
    """SwitchBack: forward and grad_input stay on _int_mm, grad_weight is a matmul in the
    compute dtype (one _int_mm less per linear in backward)."""
    prec = build_precision(PrecisionConfig(name="int8", int8_grad_weight="bf16"), CPU)
    model = build_model(TINY, CPU, seed=0)
    apply_precision(model, prec)
    assert _swapped_grad_weight_modes(model) == {"bf16"}
    x, y = _batch()
    with CountOps() as fwd, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    with CountOps() as bwd:
        loss.backward()
    n_linears = TINY.n_layer * 7
    assert fwd.counts.get("_int_mm", 0) == n_linears
    assert bwd.counts.get("_int_mm", 0) == n_linears  # grad_input only
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    # Same weights, same batch: forward and grad_input are the int8 path's exactly, the
    # swapped layers' grad_weight is not (a bf16 matmul instead of int8).
    ref = _tiny("int8", grad_weight="int8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(x, y)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    w1, w1_ref = model.layers["0"].ffn.w1.weight, ref.layers["0"].ffn.w1.weight
    assert not torch.equal(w1.grad, w1_ref.grad)
    assert torch.equal(model.output.weight.grad, ref.output.weight.grad)  # LM head untouched


def _linear_outputs_and_grads(*linears, loud_tokens: int = 0):
    """(output, grad_input, grad_weight) of one (256 x 128) @ (128 x 192) linear: in fp32 first,
    then through each of `linears` and through F.linear under bf16 autocast, last. The first
    `loud_tokens` tokens get 30x larger output gradients."""
    torch.manual_seed(0)
    x = torch.randn(256, 128, requires_grad=True)
    w = (0.02 * torch.randn(192, 128)).requires_grad_()
    gy = torch.randn(256, 192)
    gy[:loud_tokens] *= 30

    def run(fn):
        x.grad = w.grad = None
        out = fn(x, w)
        out.backward(gy)
        return out.detach().float(), x.grad.clone(), w.grad.clone()

    ref = run(F.linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (ref, *(run(fn) for fn in linears), run(F.linear))


def test_int8_grad_weight_bf16_is_more_accurate_and_grad_input_stays_int8():
    # a few tokens with large gradients, as language models have
    ref, q8, sb, b = _linear_outputs_and_grads(
        lambda x, w: i8.int8_linear(x, w, grad_weight="int8"),
        lambda x, w: i8.int8_linear(x, w, grad_weight="bf16"),
        loud_tokens=4,
    )
    # forward and grad_input: the very same int8 computation
    assert torch.equal(sb[0], q8[0]) and torch.equal(sb[1], q8[1])
    # grad_weight: per-channel int8 rounding of dy over all tokens is gone; what is left is
    # the int8 input's (per token), so it stays below bf16's accuracy but well above int8's.
    snr_q8, snr_sb, snr_b = (snr_db(ref[2], r[2]) for r in (q8, sb, b))
    assert snr_sb > snr_q8 + 6, (snr_q8, snr_sb)
    assert snr_sb < snr_b, (snr_sb, snr_b)
    assert not torch.equal(sb[2], b[2])


def test_int8_grad_input_is_written_in_the_compute_dtype():
    """For an fp32 input under bf16 autocast the grad-input GEMM writes bf16, then the gradient
    is cast to fp32, as autocast's bf16 linear does (writing fp32 measured slower: 1.042x bf16
    against 1.063x, docs/benchmarks.md): every value of the fp32 gradient is a bf16 one."""
    _, int8, _ = _linear_outputs_and_grads(lambda x, w: i8.int8_linear(x, w, grad_weight="bf16"))
    dx = int8[1]
    assert dx.dtype == torch.float32
    assert torch.equal(dx, dx.to(torch.bfloat16).float())


@pytest.mark.parametrize("grad_weight", ["int8", "bf16", "int8_grouped"])
def test_int8_linear_compiles_in_one_graph_forward_and_backward(grad_weight):
    """fullgraph=True: no graph break in either grad_weight mode (aot_eager traces forward and
    backward as Inductor would, without its slow CPU code generation)."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    i8.apply_int8(model, lambda m, n: True, grad_weight=grad_weight)
    x = torch.randn(4, 32, 64)

    def loss_fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().pow(2).mean()

    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_fn(x).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-2, atol=1e-5)


def test_int8_linear_accuracy_vs_fp32_and_not_bf16():
    ref, q, b = _linear_outputs_and_grads(i8.int8_linear)
    for name, r, qi, bi in zip(("output", "grad_input", "grad_weight"), ref, q, b, strict=True):
        assert 20 < snr_db(r, qi) < 60, (name, snr_db(r, qi))
        assert not torch.equal(qi, bi), name  # really not the bf16 path
        assert not torch.equal(qi, r), name


def test_int8_saves_int8_inputs_not_bf16():
    def saved(model_fn):
        tensors = []

        def pack(t):
            tensors.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model_fn()
        return tensors

    x = torch.randn(64, 128)
    lin = nn.Linear(128, 96, bias=False)
    apply_precision_linear = i8.apply_int8(nn.Sequential(lin), lambda m, n: True)
    assert apply_precision_linear == 1
    s = saved(lambda: lin(x.requires_grad_()))
    acts = [t for t in s if t.shape == x.shape]
    assert [t.dtype for t in acts] == [torch.int8]  # the input, as int8 only
    assert any(t is lin.weight for t in s)  # the weight is the parameter, not a copy

    # Whole model: fewer bytes saved for backward than bf16 (activation memory shrinks).
    def nbytes(ts):
        seen = {}
        for t in ts:
            if t.requires_grad and isinstance(t, nn.Parameter):
                continue  # parameters are not activations
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    xb, yb = _batch()
    int8_bytes = nbytes(saved(lambda: _tiny("int8")(xb, yb)))
    bf16_bytes = nbytes(saved(lambda: _tiny("bf16")(xb, yb)))
    assert int8_bytes < 0.9 * bf16_bytes, (int8_bytes, bf16_bytes)


@pytest.mark.parametrize("m,k,n", [(3, 20, 12), (16, 64, 8), (40, 8, 30)])
def test_int_mm_padding_for_cuda_shape_limits_is_exact(m, k, n):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()  # column-major
    assert torch.equal(i8.int_mm(a, b, pad=True), torch._int_mm(a, b))


def test_long_reductions_are_chunked_without_int32_overflow(monkeypatch):
    a = torch.full((4, 96), 127, dtype=torch.int8)
    b = torch.full((8, 96), 127, dtype=torch.int8).t()
    exact = a.double() @ b.double()
    from dtrain.lowp.int8 import quant as int8_quant

    monkeypatch.setattr(int8_quant, "MAX_REDUCTION", 32)
    assert torch.equal(i8.int_mm(a, b).double(), exact)


# --- fp16 loss scaling ----------------------------------------------------------------------


def test_fp16_overflow_steps_are_skipped_and_counted():
    # fp16 is refused on CPU by build_precision; the strategy itself runs anywhere, so the
    # loss-scaling logic is tested here with CPU fp16 autocast.
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
    strat = SingleStrategy(StrategyConfig(compile=False), PRECISIONS["fp16"], env)
    strat.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
    x, y = _batch()
    before = {n: p.detach().clone() for n, p in strat.module.named_parameters()}
    scale0 = strat.loss_scaler.scaler.get_scale()

    strat.forward_backward(x, y, last_micro=True, loss_div=1)
    strat.module.layers["0"].ffn.w1.weight.grad[0, 0] = float("inf")  # an overflowed gradient
    norm = strat.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert not torch.isfinite(norm)
    for n, p in strat.module.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    m = strat.step_metrics()
    assert m["train/overflow_steps"] == 1
    assert m["train/loss_scale"] == scale0 / 2

    strat.forward_backward(x, y, last_micro=True, loss_div=1)
    strat.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert strat.step_metrics()["train/overflow_steps"] == 1  # a clean step is not counted
    assert not torch.equal(strat.module.output.weight, before["output.weight"])
    state = strat.state_dict()["loss_scaler"]
    assert int(state["overflow_steps"]) == 1 and float(state["scale"]) == scale0 / 2


# --- other precisions train -----------------------------------------------------------------

STEPS = ["trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=0", "model.n_layer=2"]


def test_bf16_true_keeps_params_grads_and_optimizer_states_in_bf16():
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
    strat = SingleStrategy(StrategyConfig(compile=False), PRECISIONS["bf16-true"], env)
    strat.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
    x, y = _batch()
    strat.forward_backward(x, y, last_micro=True, loss_div=1)
    strat.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert {p.dtype for p in strat.module.parameters()} == {torch.bfloat16}
    assert strat.module.rope_cache.dtype == torch.float32  # buffers keep their precision
    states = [v for s in strat.optimizer.state.values() for v in s.values() if v.ndim > 0]
    assert states and {v.dtype for v in states} == {torch.bfloat16}
    fp32 = SingleStrategy(StrategyConfig(compile=False), PRECISIONS["bf16"], env)
    fp32.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
    fp32.forward_backward(x, y, last_micro=True, loss_div=1)
    fp32.clip_and_step(lr=1e-3, grad_clip=1.0)
    a, b = strat.state_bytes(), fp32.state_bytes()
    assert a.params_bytes * 2 == b.params_bytes and a.optim_bytes < 0.6 * b.optim_bytes


@pytest.mark.parametrize(
    "precision,extra,module_type",
    [
        ("int8", [], "Int8Linear"),
        # tensorwise on one rank: precision.fp8_scaling=auto takes delayed scaling
        ("fp8", ["precision.fp8_emulate=true"], "DelayedFloat8Linear"),
        ("fp8", ["precision.fp8_emulate=true", "precision.fp8_recipe=rowwise"], "Float8Linear"),
        ("int8-torchao", [], "Int8MixedPrecisionTrainingLinear"),
    ],
)
def test_quantized_precisions_train(tmp_path, precision, extra, module_type):
    pytest.importorskip("torchao")
    out = train(tmp_path, f"precision={precision}", *extra, *STEPS)
    losses = [loss for _, loss in out["losses"]]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    model = build_model(TINY, CPU)
    recipe = "rowwise" if "precision.fp8_recipe=rowwise" in extra else "tensorwise"
    cfg = PrecisionConfig(name=precision, fp8_emulate=True, fp8_recipe=recipe)
    apply_precision(model, build_precision(cfg, CPU))
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.startswith("layers.")}
    assert module_type in kinds and "Linear" not in kinds
    assert type(model.output) is nn.Linear


@pytest.mark.parametrize(
    "head,fast,fast_gi,fast_gw",
    [
        (False, None, True, False),
        (False, "forward", False, False),
        (True, "grad_input", True, False),
        (False, "all", True, True),
    ],
)
def test_fp8_lm_head_and_fast_accum_take_their_paths(head, fast, fast_gi, fast_gw):
    """precision.fp8_lm_head swaps the LM head too, keeping it tied to the embedding, and its
    logits are the fp8 head's (quantized: close to, not equal to, the bf16 head's);
    precision.fp8_fast_accum sets fast accumulation in the GEMMs it names, in every fp8 linear:
    the default (None here: not set) is grad_input, and "forward" keeps torchao's promoted
    backward ones."""
    pytest.importorskip("torchao")
    tied = replace(TINY, tie_embeddings=True)
    x, y = _batch()
    model = build_model(tied, CPU, seed=0)
    fast_opt = {} if fast is None else {"fp8_fast_accum": fast}
    cfg = PrecisionConfig(
        name="fp8", fp8_emulate=True, fp8_lm_head=head, fp8_scaling="dynamic", **fast_opt
    )
    apply_precision(model, build_precision(cfg, CPU))
    assert (type(model.output).__name__ == "Float8Linear") is head
    assert model.output.weight is model.tok_embeddings.weight
    fp8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(fp8) == 7 * tied.n_layer + head
    for m in fp8:
        c = m.config
        assert c.gemm_config_output.use_fast_accum
        assert c.gemm_config_grad_input.use_fast_accum is fast_gi
        assert c.gemm_config_grad_weight.use_fast_accum is fast_gw
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x).float()
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    assert torch.isfinite(model.tok_embeddings.weight.grad).all()
    if head:  # the fp8 head's logits against the same weights' bf16 head
        ref = build_model(tied, CPU, seed=0)
        apply_precision(ref, build_precision(replace(cfg, fp8_lm_head=False), CPU))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out = ref(x).float()
        assert not torch.equal(ref_out, out)
        assert snr_db(ref_out, out) > 15


def test_precision_fp8_composes_to_fast_grad_input():
    """`precision=fp8` as a user composes it (conf/precision/fp8.yaml over the schema) builds
    linears whose grad-input GEMM accumulates fast and whose grad-weight GEMM promotes."""
    pytest.importorskip("torchao")
    from dtrain.config import compose

    cfg = compose(["precision=fp8", "precision.fp8_emulate=true"]).precision
    assert cfg.fp8_fast_accum == "grad_input"
    model = build_model(TINY, CPU, seed=0)
    apply_precision(model, build_precision(cfg, CPU))
    fp8 = [m for m in model.modules() if type(m).__name__.endswith("Float8Linear")]
    assert len(fp8) == 7 * TINY.n_layer
    for m in fp8:
        assert m.config.gemm_config_grad_input.use_fast_accum
        assert not m.config.gemm_config_grad_weight.use_fast_accum


def test_fp8_lm_head_with_fast_accum_trains(tmp_path):
    """Both fp8 options through the training command, the head tied to the embedding."""
    pytest.importorskip("torchao")
    opts = ["precision.fp8_emulate=true", "precision.fp8_lm_head=true"]
    opts += ["precision.fp8_fast_accum=all", "model.tie_embeddings=true"]
    out = train(tmp_path, "precision=fp8", *opts, *STEPS)
    losses = [loss for _, loss in out["losses"]]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_optimizer_8bit_has_8bit_states(monkeypatch):
    pytest.importorskip("torchao")
    # torchao compiles its step; on CPU that is minutes of C++ compilation: run it eagerly.
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
    prec = build_precision(PrecisionConfig(name="int8", optimizer_8bit=True), CPU)
    big = ModelConfig(n_layer=1, n_head=4, d_model=128, vocab_size=96, max_seq_len=64)
    strat = SingleStrategy(StrategyConfig(compile=False), prec, env)
    strat.setup(big, OptimConfig(warmup_steps=0), seed=0)
    assert type(strat.optimizer).__name__ == "GroupedAdamW8bit"
    x, y = _batch()
    strat.forward_backward(x, y, last_micro=True, loss_div=1)
    w = strat.module.layers["0"].ffn.w1.weight.detach().clone()
    strat.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert not torch.equal(w, strat.module.layers["0"].ffn.w1.weight)
    st = strat.optimizer.state[strat.module.layers["0"].ffn.w1.weight]
    assert "8bit" in type(st["exp_avg"]).__name__.lower()
    assert strat.state_bytes().optim_bytes < 0.4 * 8 * sum(
        p.numel() for p in strat.module.parameters()
    )


# --- bad input: one line, exit code 2 -------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["precision=fp16"], "needs a CUDA GPU"),
        (["precision=fp8"], "fp8_emulate=true"),
        (["precision=fp8", "precision.fp8_recipe=blockwise"], "tensorwise or rowwise"),
        (["precision=fp64"], "valid choices"),
        (
            ["precision=int8", "precision.int8_grad_weight=fp16"],
            "choose int8, bf16 or int8_grouped",
        ),
        (["precision=bf16", "+precision.int8_grad_weight=bf16"], "precision=int8 only"),
        (["precision=bf16", "+precision.fp8_all_gather=false"], "precision=fp8 only"),
        (["precision=bf16", "+precision.fp8_all_gather=true"], "precision=fp8 only"),
        (["precision=bf16", "+precision.fp8_lm_head=true"], "precision=fp8 only"),
        (["precision=int8", "+precision.fp8_fast_accum=all"], "precision=fp8 only"),
        (["precision=fp8", "precision.fp8_fast_accum=true"], "choose forward, grad_input, all"),
        (["precision=bf16", "+precision.fp8_scaling=delayed"], "precision=fp8 only"),
        (["precision=int8", "+precision.fp8_amax_history=4"], "precision=fp8 only"),
        (["precision=fp8", "precision.fp8_scaling=late"], "choose auto, dynamic, delayed"),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_recipe=rowwise"]
            + ["precision.fp8_scaling=delayed"],
            "fp8_scaling=delayed applies to precision.fp8_recipe=tensorwise only",
        ),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_scaling=delayed"]
            + ["precision.fp8_amax_history=0"],
            "fp8_amax_history must be > 0, got 0",
        ),
        (
            [
                "precision=fp8",
                "precision.fp8_emulate=true",
                "precision.fp8_scaling=dynamic",
                "precision.fp8_amax_history=4",
            ],
            "applies to precision.fp8_scaling=delayed only",
        ),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_lm_head=true"]
            + ["strategy=fsdp"],
            "strategy=fsdp, which shards parameters",
        ),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_lm_head=true"]
            + ["model.vocab_size=330"],
            "divisible by 16",
        ),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_recipe=rowwise"]
            + ["precision.fp8_all_gather=false"],
            "fp8_recipe=tensorwise only",
        ),
        (
            ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_all_gather=false"],
            "strategy=single gathers none",
        ),
    ],
)
def test_bad_precisions_are_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(tmp_path, *overrides, *STEPS)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_quantized_precisions_refuse_deepspeed():
    from dtrain.strategies import STRATEGIES

    zero2 = STRATEGIES["zero2"]
    for name in ("int8", "fp8", "int8-torchao"):
        with pytest.raises(ConfigError, match="strategy=zero2 cannot train precision="):
            zero2.check_config(StrategyConfig(name="zero2"), PRECISIONS[name], "cuda")
    zero2.check_config(StrategyConfig(name="zero2"), PRECISIONS["bf16"], "cuda")


def test_precision_checks_ask_the_strategy():
    """What a precision needs of a strategy is read from the facts it declares."""
    from dtrain.strategies import STRATEGIES

    eight_bit = replace(PRECISIONS["bf16"], optimizer_8bit=True)
    reduced = replace(PRECISIONS["bf16"], reduce_override=True)
    with pytest.raises(ConfigError, match="strategy=zero2: it builds its own optimizer"):
        check_strategy(eight_bit, STRATEGIES["zero2"], "zero2")
    with pytest.raises(ConfigError, match="strategy=single reduces none"):
        check_strategy(reduced, STRATEGIES["single"], "single")
    fp8_head = replace(PRECISIONS["fp8"], fp8_lm_head=True)
    with pytest.raises(ConfigError, match="fp8_lm_head=true is not supported with strategy=fsdp"):
        check_strategy(fp8_head, STRATEGIES["fsdp"], "fsdp")
    check_strategy(fp8_head, STRATEGIES["ddp"], "ddp")
    check_strategy(eight_bit, STRATEGIES["fsdp"], "fsdp")
    check_strategy(reduced, STRATEGIES["ddp"], "ddp")


def test_fp16_on_cpu_exits_2_with_one_line(tmp_path):
    res = launch(*FAST, "precision=fp16", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: precision=fp16 needs a CUDA GPU")


# --- the doc is the table -------------------------------------------------------------------


def test_docs_table_matches_precisions():
    doc = (ROOT / "docs" / "precision.md").read_text()
    block = re.search(r"<!-- table:begin -->\n(.*?)<!-- table:end -->", doc, re.S)
    assert block, "docs/precision.md lost its generated table markers"
    assert block.group(1) == render_table(), "regenerate: python -m dtrain.precision"


# --- the long one: int8 trains as well as bf16 ----------------------------------------------


@pytest.mark.slow
def test_int8_300_steps_within_5_percent_of_bf16(tmp_path):
    common = [
        "model.n_layer=1",
        "trainer.seq_len=32",
        "trainer.max_steps=300",
        "trainer.log_every=25",
        "trainer.eval_every=0",
        "checkpoint.save_final=false",
    ]
    final = {}
    for p in ("bf16", "int8"):
        train(tmp_path / p, f"precision={p}", *common)
        rows = [r for r in read_jsonl(Path(tmp_path / p / "metrics.jsonl")) if "loss" in r]
        final[p] = sum(r["loss"] for r in rows[-2:]) / 2  # the last 50 steps
    assert final["bf16"] < 3.5  # it did learn (from ~4.6)
    assert abs(final["int8"] - final["bf16"]) <= 0.05 * final["bf16"], final


def test_fsdp_fp16_builds_a_foreach_adamw_beside_the_sharded_scaler():
    """ShardedGradScaler's (1,)-shaped found_inf broke fused AdamW under fsdp + fp16 on 2x H200
    (torch 2.11, CUDA only: the CPU path does not hand found_inf to the fused kernel); the fsdp
    strategy therefore asks for the foreach AdamW there, and only there."""
    from dtrain.config import OptimConfig
    from dtrain.strategies.fsdp import sharded_scaler_optim

    assert sharded_scaler_optim(PRECISIONS["fp16"], OptimConfig(fused=None)).fused is False
    assert sharded_scaler_optim(PRECISIONS["fp16"], OptimConfig(fused=True)).fused is False
    for name in ("bf16", "fp32", "int8"):
        assert sharded_scaler_optim(PRECISIONS[name], OptimConfig(fused=None)).fused is None


def test_fp16_steps_under_fsdp_with_two_ranks(tmp_path):
    """fsdp's fp16 path (ShardedGradScaler, foreach AdamW, the DTensor gradient norm) steps on
    two ranks: three clean steps, no overflow counted, the same scale on both ranks. (On 2x H100
    this crashed at the first step: the DTensor norm met the scaler's plain counter.)"""
    from tests.conftest import ROOT, torchrun_script

    res = torchrun_script(ROOT / "tests" / "fsdp_fp16_worker.py", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    outs = [(tmp_path / f"rank{r}.txt").read_text().split("] ") for r in (0, 1)]
    for losses, rest in outs:
        assert len(losses.strip("[").split(",")) == 3
        overflow, scale = map(float, rest.split())
        assert overflow == 0 and scale == 2.0**16


def test_the_compiled_shard_cast_is_torchaos_cast_bit_for_bit():
    """fsdp's fp8 weight shards are cast after each step in one compiled call where the
    blocks compile (lowp/fp8/linear.cast_shards): the compiled graph (here Inductor's CPU code)
    gives torchao's bits, as the eager cast does, saturating at fp8's largest value, and new scales
    reuse the graph."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    from dtrain.lowp.fp8 import linear as fp8

    torch._dynamo.reset()
    fp8._compiled_cast_all = None
    gen = torch.Generator().manual_seed(0)
    hps = [torch.randn(s, generator=gen) * 3 for s in ((48, 32), (16, 32), (37, 20))]
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for k in (1.0, 0.5, 4.0):  # 4x the amax scale: values past fp8's range saturate
        scales = list(
            k * torch.finfo(torch.float8_e4m3fn).max / torch.stack([h.abs().max() for h in hps])
        )
        out = fp8.cast_shards(hps, scales, torch.float8_e4m3fn, compiled=True)
        eager = fp8.cast_shards(hps, scales, torch.float8_e4m3fn, compiled=False)
        for h, sc, q, e in zip(hps, scales, out, eager, strict=True):
            ref = hp_tensor_and_scale_to_float8(h, sc, torch.float8_e4m3fn)._data
            assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
            assert torch.equal(e.view(torch.uint8), ref.view(torch.uint8))
    assert fp8._compiled_cast_all is not None  # the compiled call was the one taken
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1


def test_fsdp_fp8_precomputes_weight_scales_after_each_step(tmp_path):
    """fp8 under fsdp all-gathers fp8 weights; their scales are computed for all linears in one
    all-reduce after the step (torchao's precompute, as torchtitan does), not one all-reduce
    per linear in the next forward. The path is taken (every fp8 weight holds a precomputed
    scale and a cached fp8 shard, cast once per step) and changes nothing but the speed (the
    weights equal a run without either, bit for bit)."""
    from tests.conftest import ROOT, torchrun_script

    res = torchrun_script(ROOT / "tests" / "fsdp_fp8_worker.py", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    for r in (0, 1):
        fields = map(int, (tmp_path / f"rank{r}.txt").read_text().split())
        scaled, cached, unscaled, same, wide_fp8, wide_hook, wide_trained = fields
        assert scaled == cached == 4 * 7 and unscaled == 0 and same == 1
        # precision.fp8_all_gather=false: plain weights, gathered in the compute dtype and
        # cast by each block, as on one GPU; no scale precompute; it trains.
        assert wide_fp8 == 0 and wide_hook == 0 and wide_trained == 1

"""precision.fp8_scaling=delayed (dtrain/lowp/fp8/delayed.py), on CPU where torch._scaled_mm
runs in real fp8: the first step is dynamic scaling bit for bit; later casts take their scale
from the amax history (the output and both gradients are those of that scale, saturating
where the history is too small); the history rolls after each step, keeps the max over
micro-batches, ignores eval, and starts again after a load; linears that read one tensor share
its state; and training runs through the command line and resumes."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import pytest
import torch

from dtrain.config import OptimConfig, PrecisionConfig, StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.precision import build_precision
from dtrain.strategies.single import SingleStrategy
from tests.test_fp8_layout import fp8_block
from tests.test_precision import CPU, TINY

pytest.importorskip("torchao")
fp8_delayed = pytest.importorskip("dtrain.lowp.fp8.delayed")
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def delayed_twin(block, compiled=False):
    """A copy of the fp8 `block` with delayed scaling, and its DelayedScaling."""
    twin = copy.deepcopy(block)
    linears = fp8_delayed.install_delayed_scaling(twin, history=4)
    device = block.attn_norm.weight.device
    return twin, fp8_delayed.DelayedScaling(linears, device, compiled=compiled)


def step(block, rope, compiled=False):
    """Output, input gradient and parameter gradients of one forward and backward (bf16
    autocast on a GPU), the same input every call; the gradients are then cleared."""
    d = block.attn_norm.weight
    x = torch.randn(2, rope.shape[0], d.shape[0], generator=torch.Generator().manual_seed(1))
    x = x.to(d.device).requires_grad_(True)
    run = torch.compile(block) if compiled else block
    with torch.autocast(d.device.type, torch.bfloat16, enabled=d.is_cuda):
        out = run(x, rope)[0]
    out.float().pow(2).mean().backward()
    grads = [out.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("compiled", [False, True])
def test_first_step_is_dynamic_and_a_full_history_of_the_same_tensors_changes_nothing(compiled):
    block, rope = fp8_block()
    twin, delayed = delayed_twin(block)
    assert all(m.delayed is False for m in delayed.linears)
    torch._dynamo.reset()
    first = step(block, rope, compiled)
    assert all(torch.equal(a, b) for a, b in zip(first, step(twin, rope, compiled), strict=True))
    recorded = [float(s.amax) for s in delayed.states]
    assert all(a > 0 for a in recorded)
    delayed.step()
    assert all(m.delayed for m in delayed.linears)
    assert [float(s.history[0]) for s in delayed.states] == recorded
    assert all(float(s.amax) == 0 for s in delayed.states)
    # Same weights, same input: the history's max is this step's amax, the scales dynamic's.
    again = step(twin, rope, compiled)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def dequant(t: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("factor", [4.0, 0.25])  # history above the tensor's amax; below: clips
def test_a_delayed_cast_uses_the_historys_scale(factor, compiled):
    from torchao.float8.float8_utils import amax_to_scale

    block, _ = fp8_block()
    twin, delayed = delayed_twin(block)
    lin = twin.attn.wo
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    dy = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    hx, hdy = factor * x.detach().abs().max(), factor * dy.abs().max()
    delayed.step()  # delayed from now on
    lin.fp8_input.history[1] = hx  # the max of the history (its newest entry is 0 here)
    lin.fp8_grad.history[2] = hdy
    torch._dynamo.reset()
    y = (torch.compile(lin) if compiled else lin)(x)
    y.backward(dy)
    w = lin.weight.detach()
    sx, sdy, sw = amax_to_scale(hx, E4), amax_to_scale(hdy, E5), amax_to_scale(w.abs().max(), E4)
    xq, dyq, wq = dequant(x.detach(), sx, E4), dequant(dy, sdy, E5), dequant(w, sw, E4)
    close = dict(rtol=1e-5, atol=1e-6)
    assert torch.allclose(y.detach().float(), xq @ wq.t(), **close)
    assert torch.allclose(x.grad.float(), dyq @ wq, **close)
    assert torch.allclose(lin.weight.grad.float(), dyq.t() @ xq, **close)
    # and the dynamic scale gives other numbers (the test would not see a scale left unused)
    assert not torch.allclose(xq, dequant(x.detach(), amax_to_scale(x.abs().max(), E4), E4))
    assert float(lin.fp8_input.amax) == float(x.detach().abs().max())
    assert float(lin.fp8_grad.amax) == float(dy.abs().max())


def test_history_rolls_keeps_the_micro_batch_max_skips_eval_and_resets():
    block, _ = fp8_block()
    twin, delayed = delayed_twin(block)
    lin = twin.ffn.w2
    state = lin.fp8_input
    for scale in (1.0, 3.0, 2.0):  # three micro-batches: the step's amax is the largest
        lin(torch.full((4, 128), scale))
    assert float(state.amax) == 3.0
    delayed.step()
    lin(torch.full((4, 128), 5.0))
    delayed.step()
    assert state.history.tolist() == [5.0, 3.0, 0.0, 0.0]  # newest first, 4 long
    with torch.no_grad():  # the trainer's eval: no_grad, still in train mode
        lin(torch.full((4, 128), 100.0))
    lin.eval()
    lin(torch.full((4, 128), 100.0))
    assert float(state.amax) == 0.0  # eval records nothing
    delayed.reset()
    assert all(m.delayed is False for m in delayed.linears)
    assert state.history.abs().sum() == 0


def test_a_non_finite_step_does_not_reach_the_scales():
    """trainer.on_nonfinite=skip goes on after an inf/NaN step: its amax enters the history as
    the history's max, so the next scales are the last finite ones; on the first step (still
    dynamic) delayed scaling waits for a step whose amaxes are all finite."""
    block, _ = fp8_block()
    twin, delayed = delayed_twin(block)
    lin = twin.ffn.w2
    lin(torch.full((4, 128), float("nan")))
    delayed.step()
    assert not lin.delayed and float(lin.fp8_input.history.abs().sum()) == 0  # still dynamic
    lin(torch.full((4, 128), 2.0))
    delayed.step()
    assert lin.delayed and lin.fp8_input.history.tolist() == [2.0, 0.0, 0.0, 0.0]
    lin(torch.full((4, 128), float("inf")))
    delayed.step()
    assert lin.fp8_input.history.tolist() == [2.0, 2.0, 0.0, 0.0]
    x = torch.randn(8, 128).requires_grad_(True)
    lin(x).backward(torch.randn(8, 64))
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()


def test_linears_that_read_one_tensor_share_its_state():
    block, _ = fp8_block()
    twin, delayed = delayed_twin(block)
    attn, ffn = twin.attn, twin.ffn
    assert attn.wk.input_state() is attn.wq.input_state() is attn.wv.input_state()
    assert ffn.w3.input_state() is ffn.w1.input_state()
    assert attn.wo.input_state() is not attn.wq.input_state()
    assert ffn.w2.input_state() is not ffn.w1.input_state()
    assert len({id(m.fp8_grad) for m in delayed.linears}) == 7  # every output its own
    assert len(delayed.states) == 4 + 7  # inputs: qkv, wo, w1/w3, w2
    names = fp8_delayed.state_buffer_names(twin)
    assert "attn.wq.fp8_input.history" in names and "attn.wk.fp8_input.history" not in names
    assert not any("fp8" in k for k in twin.state_dict())  # each rank's: not the model's


def strategy(scaling: str, compile: bool = False, **precision) -> SingleStrategy:
    cfg = PrecisionConfig(name="fp8", fp8_emulate=True, fp8_scaling=scaling, **precision)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
    s = SingleStrategy(StrategyConfig(compile=compile), build_precision(cfg, CPU), env)
    s.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
    return s


def test_the_strategy_rolls_after_each_step_and_starts_again_after_a_load():
    s = strategy("delayed")
    assert s.post_step is not None and s.post_load is not None
    linears = [m for m in s.module.modules() if isinstance(m, fp8_delayed.DelayedFloat8Linear)]
    assert len(linears) == 7 * TINY.n_layer
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    s.forward_backward(x, x, last_micro=True, loss_div=1)
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert all(m.delayed for m in linears)
    assert float(linears[0].input_state().history[0]) > 0
    s.load_state_dict(s.state_dict())
    assert not any(m.delayed for m in linears)
    assert float(linears[0].input_state().history.abs().sum()) == 0
    assert strategy("dynamic").post_step is None  # nothing to roll with dynamic scales


@pytest.fixture
def captured(monkeypatch):
    """torch.compile through Dynamo's capture only (no Inductor): the set of op names of each
    graph Dynamo captures, in order; the eager step's compiled losses and Dynamo's caches are
    dropped afterwards, whatever the test did."""
    from dtrain.strategies import eager_step

    graphs = []

    def capture(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, backend=capture, **kw))
    eager_step._COMPILED.clear()
    torch._dynamo.reset()
    yield graphs
    eager_step._COMPILED.clear()
    torch._dynamo.reset()


def model_graphs(graphs) -> list:
    return [g for g in graphs if any("embedding" in t for t in g)]


def plain_block_and_loss(s: SingleStrategy) -> bool:
    from dtrain.model import lm_loss

    blocks = s.module.layers.values()
    return s.module.loss_fn is lm_loss and all("forward" not in b.__dict__ for b in blocks)


@pytest.mark.parametrize("first", ["eager", "compiled"])
def test_a_compiled_model_runs_its_dynamic_first_step_eagerly(captured, first):
    """Compiled, the first step (dynamic scales: no history yet) runs eagerly, as
    precision.fp8_first_step=eager (the default) has it: of the model only the loss is captured
    (compiled apart, dtrain/strategies/eager_step.py), so does an eval before it, its loss and
    gradients are the eager model's; the next step (delayed) is the first to capture the model,
    and the loop's slow-step notice and compiling step say so. After a load that restored no
    history: eager again. `compiled` captures the first step whole, as before. (Dynamo's
    capture only: what is counted is what Dynamo captures, not Inductor's kernels.)"""
    s, ref = strategy("delayed", compile=True, fp8_first_step=first), strategy("delayed")
    eager = lambda: s.step_mode is not None and s.step_mode.runs_eager()  # noqa: E731
    assert eager() is (first == "eager")
    slow = s.slow_steps(1)
    assert list(slow) == ([1, 2] if first == "eager" else [1])
    assert s.compiling_step(1) == max(slow)
    assert "torch.compile" in slow[max(slow)]
    assert ("eagerly" in slow[1]) is (first == "eager")
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    evaluated = s.eval_loss(x, x)  # trainer.eval_every's eval at step 0
    assert bool(model_graphs(captured)) is (first == "compiled")
    assert plain_block_and_loss(s)
    loss = s.forward_backward(x, x, last_micro=True, loss_div=1)
    if first == "eager":
        assert not model_graphs(captured)
        assert any(any("cross_entropy" in t for t in g) for g in captured)
        assert torch.equal(evaluated, ref.eval_loss(x, x))
        assert torch.equal(loss, ref.forward_backward(x, x, last_micro=True, loss_div=1))
        for p, q in zip(s.module.parameters(), ref.module.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        assert plain_block_and_loss(s)  # the blocks' own forward and the loss again
    else:
        assert model_graphs(captured)
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert not eager() and s.slow_steps(2) == {2: slow[max(slow)]} and s.compiling_step(2) == 2
    before = len(model_graphs(captured))
    s.forward_backward(x, x, last_micro=True, loss_div=1)  # delayed: captures the model
    assert len(model_graphs(captured)) > before
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    s.load_state_dict(s.state_dict())  # the model's state only: no history restored
    assert eager() is (first == "eager")


def test_the_eager_step_puts_the_model_back_when_a_step_fails(captured):
    from dtrain.strategies.eager_step import eager_step

    s = strategy("delayed", compile=True)
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="boom"):
        with eager_step(s.module):
            assert not plain_block_and_loss(s)
            s.module(x, x)
            raise RuntimeError("boom")
    assert plain_block_and_loss(s)
    assert not model_graphs(captured)
    s.model(x, x)  # the compiler's stance is back: the compiled model captures
    assert model_graphs(captured)


def test_only_whole_parameters_under_compile_get_an_eager_first_step():
    from dtrain.precision import precision_hooks

    assert strategy("delayed").step_mode is None  # nothing compiles: nothing to run eagerly
    assert strategy("dynamic", compile=True).step_mode is None  # no history to wait for
    s = strategy("delayed")
    hooks = [
        precision_hooks(s.precision, s.module, CPU, sharded=sharded, compiled=True)
        for sharded in (False, True)
    ]
    # sharded (fsdp): a recompute of a block's forward would skip its all-gather hooks
    assert hooks[0].step_mode is not None and hooks[1].step_mode is None
    assert hooks[1].rank_state is not None  # delayed all the same


def test_the_eager_step_keeps_each_blocks_input_only(monkeypatch):
    """The eager first step recomputes each block in backward: what autograd saves is a small
    part of what the plain eager step saves (the loss, compiled there, is a plain one here)."""
    from dtrain.strategies import eager_step

    monkeypatch.setattr(eager_step, "_compiled", lambda fn: fn)  # no Inductor on the CPU

    def saved_bytes(context) -> int:
        s = strategy("delayed")
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        s.module.loss_fn = lambda logits, y: logits.float().pow(2).mean()  # saves no logits copy
        x = torch.randint(0, TINY.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context(s.module):
            s.module(x, x).backward()
        return total

    plain = saved_bytes(lambda m: contextlib.nullcontext())
    checkpointed = saved_bytes(eager_step.eager_step)
    assert checkpointed < plain / 4, (checkpointed, plain)


def test_a_resume_restores_each_ranks_history_and_a_mismatch_starts_dynamic(caplog):
    s = strategy("delayed")
    x = torch.randint(0, TINY.vocab_size, (2, 16))
    s.forward_backward(x, x, last_micro=True, loss_div=1)
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    saved, mine = s.rank_state(), s.rank_local.states
    assert saved["precision"]["delayed"] is True
    assert len(saved["precision"]["history"]) == len(mine) == 11 * TINY.n_layer
    assert "layers.0.attn.wq.fp8_input" in saved["precision"]["history"]

    def resumed(*, rank_state, **precision):
        other = strategy("delayed", **precision)
        other.load_state_dict(s.state_dict())
        other.load_rank_state(rank_state)
        return other

    back = resumed(rank_state=saved)
    assert all(m.delayed for m in back.rank_local.linears)
    for a, b in zip(back.rank_local.states, mine, strict=True):
        assert torch.equal(a.history, b.history) and float(a.amax) == 0
    # The next step of both is the same, bit for bit: the scales are the saved history's.
    losses = []
    for run in (s, back):
        losses.append(run.forward_backward(x, x, last_micro=True, loss_div=1))
        run.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a.history, b.history) for a, b in zip(back.rank_local.states, mine))

    def edited(name: str, value) -> dict:
        history = dict(saved["precision"]["history"])
        history[name] = value
        return {"precision": {**saved["precision"], "history": history}}

    site = "layers.0.attn.wq.fp8_input"
    bad = saved["precision"]["history"][site].clone()
    bad[3] = float("nan")
    renamed = dict(saved["precision"]["history"])
    renamed["layers.9.attn.wq.fp8_input"] = renamed.pop(site)
    caplog.set_level("INFO", logger="dtrain")
    for rank_state, history, why in [
        (None, 16, "holds no amax history for this rank"),
        (saved, 8, f"history for {site} is not 8 fp32 values (precision.fp8_amax_history=8)"),
        (edited(site, bad), 16, f"history for {site} holds a negative or non-finite value"),
        (edited(site, bad.abs().to_sparse()), 16, f"history for {site} is not 16 fp32 values"),
        (edited(site, -1 - saved["precision"]["history"][site]), 16, "negative or non-finite"),
        ({"precision": {"delayed": True, "history": renamed}}, 16, "another model's (22 cast"),
        ({"precision": [1, 2]}, 16, "holds no amax history for this rank"),
    ]:
        caplog.clear()
        other = resumed(rank_state=rank_state, fp8_amax_history=history)
        assert not any(m.delayed for m in other.rank_local.linears)
        assert all(float(st.history.abs().sum()) == 0 for st in other.rank_local.states)
        assert "the first step after the resume scales dynamically" in caplog.text
        assert why in caplog.text, caplog.text


def test_history_names_are_the_state_dicts_whatever_wraps_the_blocks():
    """fsdp wraps each block for activation checkpointing and torch.compile in modules of their
    own: the histories keep the names the model's state dict has, so they load either way."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    block, _ = fp8_block()
    plain, _ = delayed_twin(block)
    wrapped = copy.deepcopy(plain)
    wrapped.attn = checkpoint_wrapper(wrapped.attn)
    wrapped.ffn = torch.compile(wrapped.ffn)
    names = fp8_delayed.DelayedScaling.of(wrapped, CPU, compiled=False).names
    assert any("_checkpoint_wrapped_module" in n for n in fp8_delayed.state_buffer_names(wrapped))
    assert names == fp8_delayed.DelayedScaling.of(plain, CPU, compiled=False).names
    assert "attn.wq.fp8_input" in names and "ffn.w2.fp8_grad" in names


def test_delayed_fp8_trains_and_resumes_from_the_command_line(tmp_path):
    from tests.test_precision import STEPS, train

    opts = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_scaling=delayed"]
    every = [*STEPS, "trainer.log_every=1"]
    losses = [loss for _, loss in train(tmp_path / "d", *opts, *every)["losses"]]
    dynamic_opts = [*opts[:2], "precision.fp8_scaling=dynamic"]
    dynamic = [loss for _, loss in train(tmp_path / "s", *dynamic_opts, *every)["losses"]]
    # precision.fp8_scaling=auto, the default, is delayed on one rank: the same losses
    default = [loss for _, loss in train(tmp_path / "a", *opts[:2], *every)["losses"]]
    assert default == losses
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] == dynamic[0] and losses[1] != dynamic[1]  # step 1 dynamic, then delayed
    assert abs(losses[-1] - dynamic[-1]) / dynamic[-1] < 0.05, (losses, dynamic)
    # Stopped after step 2 and resumed: the amax histories come back with the weights, so
    # steps 3 and 4 are the uninterrupted run's, bit for bit (a dynamic step 3 would differ,
    # as step 2 differs above).
    train(tmp_path / "r", *opts, *every, "trainer.stop_at_step=2")
    resumed = train(tmp_path / "r", *opts, *every)["losses"]
    assert resumed == [(3, losses[2]), (4, losses[3])], (resumed, losses)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_delayed_fp8_trains_on_two_ranks(tmp_path, strategy):
    """ddp (each rank's amaxes its own: DDP does not broadcast them) and fsdp (the state is
    materialised by fsdp's to_empty, then reset): the same global batch trains as on one rank,
    to fp8's noise (each rank scales its own half of the batch), and resumes bit for bit."""
    from tests.conftest import FAST, launch, train_losses

    steps = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]
    steps += ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_scaling=delayed"]
    one = launch(*FAST, *steps, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/s")
    assert one.returncode == 0, one.stderr[-3000:]
    two = launch(
        *FAST,
        *steps,
        f"strategy={strategy}",
        "trainer.micro_batch_size=4",
        f"hydra.run.dir={tmp_path}/d",
        nproc=2,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = train_losses(tmp_path / "s"), train_losses(tmp_path / "d")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[1] == pytest.approx(b[1], rel=1e-3)  # step 1: dynamic scales
    for step in (2, 3):
        assert a[step] == pytest.approx(b[step], rel=0.02), (a, b)
    # Stopped after step 2 and resumed on both ranks: each rank's histories come back from its
    # own file of the checkpoint, so step 3 is the uninterrupted run's, bit for bit.
    for extra in ("trainer.stop_at_step=2", "resume=auto"):
        again = launch(
            *FAST,
            *steps,
            f"strategy={strategy}",
            "trainer.micro_batch_size=4",
            f"hydra.run.dir={tmp_path}/r",
            extra,
            nproc=2,
        )
        assert again.returncode == 0, again.stderr[-3000:]
    assert train_losses(tmp_path / "r")[3] == b[3]
    assert "scales dynamically" not in again.stderr
    # On one rank from the two ranks' checkpoint: rank 0's histories, delayed from the start.
    ckpt = f"resume={tmp_path}/r/checkpoints/step_0000002"
    single = launch(
        *FAST, *steps, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/1", ckpt
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert "amax histories come from rank 0 of the checkpoint" in single.stderr, single.stderr
    assert "scales dynamically" not in single.stderr
    assert train_losses(tmp_path / "1")[3] == pytest.approx(b[3], rel=0.02)


def test_ddp_leaves_each_ranks_amaxes_alone_and_fsdp_zeroes_them(monkeypatch):
    """DDP broadcasts rank 0's buffers before every forward unless told not to: the delayed
    state is on its ignore list (and nothing else is). fsdp's state starts at zero."""
    import torch.distributed as dist

    from dtrain.strategies.ddp import DDPStrategy
    from dtrain.strategies.fsdp import FSDPStrategy
    from tests.netns import _free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cfg = PrecisionConfig(name="fp8", fp8_emulate=True, fp8_scaling="delayed")
        env = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU)
        s = DDPStrategy(StrategyConfig(name="ddp", compile=False), build_precision(cfg, CPU), env)
        s.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
        ignored = set(s.module._ddp_params_and_buffers_to_ignore)
        assert ignored == set(fp8_delayed.state_buffer_names(s.module))
        assert len(ignored) == 2 * (4 + 7) * TINY.n_layer  # amax and history of each state
        assert "rope_cache" not in ignored
        # fsdp builds on the meta device and materialises with to_empty (memory left unset):
        # the states are zeroed once the model is real, on the compute device.
        fsdp = FSDPStrategy(StrategyConfig(name="fsdp", compile=False), s.precision, env)
        fsdp.setup(TINY, OptimConfig(warmup_steps=0), seed=0)
        states = [m for m in fsdp.module.modules() if isinstance(m, fp8_delayed._Fp8State)]
        assert len(states) == (4 + 7) * TINY.n_layer and fsdp.post_load is not None
        for state in states:
            assert state.amax.device == CPU and not state.amax.is_meta
            assert float(state.amax) == 0 and float(state.history.abs().sum()) == 0
    finally:
        dist.destroy_process_group()


def test_a_linear_with_bias_adds_it_as_torchaos_does():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig())
    twin = copy.deepcopy(model)
    fp8_delayed.DelayedScaling(fp8_delayed.install_delayed_scaling(twin, 4), "cpu", compiled=False)
    x = torch.randn(16, 64)
    assert torch.equal(twin(x), model(x))  # first step dynamic: torchao's bits, bias included


def test_fp8_scaling_auto_is_delayed_where_parameters_are_whole():
    """precision.fp8_scaling=auto (the default) takes delayed scaling under the strategies that
    keep whole parameters (single, ddp) with tensorwise scales, dynamic under those that shard
    them (fsdp, hsdp, zero3) or with rowwise scales; a value set is kept; every precision but
    fp8 reads it as dynamic (none). One start-up line says what auto became."""
    from dtrain.precision import fp8_scaling_note
    from dtrain.strategies import STRATEGIES

    sharded = {name for name, cls in STRATEGIES.items() if cls.shards_params(name)}
    assert sharded == {"fsdp", "hsdp", "zero3"}
    fp8 = PrecisionConfig(name="fp8", fp8_emulate=True)
    cpu = torch.device("cpu")
    for name in STRATEGIES:
        p = build_precision(fp8, cpu, shards_params=name in sharded)
        assert p.fp8_scaling == ("dynamic" if name in sharded else "delayed"), name
    rowwise = build_precision(replace(fp8, fp8_recipe="rowwise"), cpu)
    assert rowwise.fp8_scaling == "dynamic"
    for scaling in ("dynamic", "delayed"):
        for shards in (False, True):
            set_ = build_precision(replace(fp8, fp8_scaling=scaling), cpu, shards_params=shards)
            assert set_.fp8_scaling == scaling
    assert build_precision(PrecisionConfig(name="bf16"), cpu).fp8_scaling == "dynamic"
    whole = build_precision(fp8, cpu)
    assert fp8_scaling_note(fp8, whole, False) == (
        "precision.fp8_scaling=auto: delayed (parameters whole, tensorwise scales; "
        'docs/precision.md, "Delayed scaling")'
    )
    note = fp8_scaling_note(fp8, build_precision(fp8, cpu, shards_params=True), True)
    assert note.startswith("precision.fp8_scaling=auto: dynamic (parameters sharded")
    assert fp8_scaling_note(replace(fp8, fp8_scaling="delayed"), whole, False) is None
    # under fsdp a history length is refused: auto scales dynamically there
    with pytest.raises(ConfigError, match="applies to precision.fp8_scaling=delayed only"):
        build_precision(replace(fp8, fp8_amax_history=4), cpu, shards_params=True)
    build_precision(replace(fp8, fp8_amax_history=4), cpu)  # delayed on one rank: taken


def test_a_non_finite_first_step_runs_eagerly_again_and_the_log_says_so(captured):
    """A first step whose amaxes are not finite resets the scales (no history to start from),
    so the next step is dynamic too and runs eagerly again: the loop's slow-step plan
    (dtrain/run/slow_step.py) moves with it, naming step 2 eager and step 3 the compiling one,
    and the collector's schedule (which asks it) collects after step 3."""
    from dtrain.run.gc_schedule import GcSchedule
    from dtrain.run.slow_step import SlowSteps

    s = strategy("delayed", compile=True, fp8_first_step="eager")
    slow = SlowSteps(s, 1)
    assert "eagerly" in slow.what(1) and 1 in slow and 2 in slow
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    params = [p.detach().clone() for p in s.module.parameters()]
    with torch.no_grad():  # a non-finite activation: every amax of the first step is NaN
        s.module.tok_embeddings.weight[x[0, 0]] = float("nan")
    s.forward_backward(x, x, last_micro=True, loss_div=1)
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert s.step_mode.runs_eager()  # the scales were reset: step 2 is dynamic again
    with torch.no_grad():  # finite weights again (as a skipped step would have kept them)
        for p, kept in zip(s.module.parameters(), params, strict=True):
            p.copy_(kept)
    assert "eagerly" in slow.what(2) and 2 in slow
    s.forward_backward(x, x, last_micro=True, loss_div=1)
    s.clip_and_step(lr=1e-3, grad_clip=1.0)
    assert not model_graphs(captured)  # steps 1 and 2 both eager
    assert "torch.compile" in slow.what(3) and 3 in slow and 4 not in slow
    # (step 1's NaN stays in the optimizer's moments, so the weights are NaN again from step
    # 3: harmless here, where only what Dynamo captures is checked)
    s.forward_backward(x, x, last_micro=True, loss_div=1)
    assert model_graphs(captured)  # step 3 compiles, as said
    collected = []
    with GcSchedule(every=1000, compiling=slow) as gc_schedule:
        gc_schedule.take()
        for done in (1, 2, 3, 4):
            gc_schedule.step_done(done)
            collected.append(gc_schedule.take() > 0)
    assert collected == [True, True, True, False]  # the first step, then each slow one

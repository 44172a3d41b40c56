"""Predicted memory: exact model-state bytes against what the strategies measure, the ZeRO
table, the plan CLI, the prediction logged by every run, and compare over real runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.memory import (
    MemorySetup,
    autocast_weight_bytes,
    head_activation_bytes,
    largest_micro_batch,
    layer_activation_bytes,
    model_state_bytes,
    param_shapes,
    plan_memory,
    setup_from_config,
)
from dtrain.model import GPT, ModelConfig, build_model
from dtrain.precision import PRECISIONS
from tests.conftest import (
    FAST,
    ROOT,
    cli_env,
    compose,
    launch,
    read_jsonl,
    torchrun_script,
    train,
)

STEPS = ["trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=0"]
F32, BF16 = PRECISIONS["fp32"], PRECISIONS["bf16"]


def _registered(name: str) -> bool:
    from dtrain.strategies import STRATEGIES

    return name in STRATEGIES


# --- the planner alone ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"vocab_size": 320},
        {"vocab_size": 320, "n_kv_head": 2, "tie_embeddings": True, "ffn_hidden": 100},
        {"vocab_size": 1000, "n_layer": 2, "n_head": 8, "d_model": 128},
    ],
)
def test_param_shapes_are_the_models(kw):
    cfg = ModelConfig(**kw)
    with torch.device("meta"):
        model = GPT(cfg)
    assert param_shapes(cfg) == [tuple(p.shape) for p in model.parameters()]


def _saved_bytes(fn, skip: set[int]) -> int:
    """Bytes of every tensor autograd keeps for backward while `fn` runs, deduplicated by
    storage, leaving out the storages in `skip` (parameters, buffers)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(v for k, v in saved.items() if k not in skip)


def _quantized_model(cfg: ModelConfig, precision: str, native: bool, fp8_recipe="tensorwise"):
    """The model as a strategy hands it to training: the blocks' linears swapped for the
    precision, and in bf16 throughout where `native` (FSDP's MixedPrecisionPolicy)."""
    from dtrain.precision import apply_precision

    pr = PRECISIONS[precision]
    if pr.quantize == "fp8":
        pytest.importorskip("torchao")
        pr = replace(pr, fp8_emulate=True, fp8_recipe=fp8_recipe)
    model = build_model(cfg, "cpu")
    apply_precision(model, pr)
    if native:
        model.to(torch.bfloat16)
    return model, pr


# Autocast (single, DDP) in fp32, bf16 and int8; computing natively in bf16 (FSDP's param_dtype)
# in bf16, int8 and fp8. fp8 under autocast is left out: on CPU Float8Linear does not cast its
# input (it asks CUDA's autocast), so CPU would not show what CUDA saves.
CASES = [("fp32", False), ("bf16", False), ("int8", False)]
CASES += [("bf16", True), ("int8", True), ("fp8", True)]


@pytest.mark.parametrize(
    "precision,native", CASES, ids=[f"{p}-{'native' if n else 'autocast'}" for p, n in CASES]
)
@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 2, "tie_embeddings": True}], ids=["mha", "gqa"])
def test_activation_count_is_what_autograd_saves(precision, native, kw):
    """Every tensor autograd keeps for backward (deduplicated by storage, parameters left
    out) in one eager forward on CPU, against the planner's count."""
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, ffn_hidden=192, vocab_size=320, **kw)
    model, pr = _quantized_model(cfg, precision, native)
    b, s = 2, 64
    x, y = torch.randint(0, 320, (b, s)), torch.randint(0, 320, (b, s))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope_cache.untyped_storage().data_ptr())

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pr.mixed and not native):
            model(x, y)

    got = _saved_bytes(forward, skip)
    setup = MemorySetup("fsdp" if native else "single", pr, 1, b, s, device="cpu")
    want = (
        cfg.n_layer * layer_activation_bytes(cfg, setup)
        + head_activation_bytes(cfg, setup)
        + autocast_weight_bytes(cfg, setup)
    )
    assert got == want


@pytest.mark.slow  # inductor compiles a block per case: ~20-40 s each on a busy CPU
@pytest.mark.parametrize("precision", ["bf16", "int8", "fp8", "fp8-rowwise"])
def test_compiled_block_saves_what_the_plan_counts(precision):
    """One block compiled the way the fsdp strategy compiles it (per block, computing in
    bf16): the tensors its compiled forward saves for backward, the block's input included
    (it is the previous block's output, kept for this block), against the compiled count."""
    cfg = ModelConfig(n_layer=1, n_head=4, d_model=64, ffn_hidden=192, vocab_size=320)
    name, _, recipe = precision.partition("-")
    model, pr = _quantized_model(cfg, name, native=True, fp8_recipe=recipe or "tensorwise")
    block = model.layers["0"]
    b, s = 2, 64
    rope = model.rope_cache[:s]
    fn = torch.compile(lambda t: block(t, rope)[0])
    x = torch.randn(b, s, cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    fn(x)  # compile outside the hooks
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.rope_cache.untyped_storage().data_ptr())
    got = _saved_bytes(lambda: fn(x), skip)
    setup = MemorySetup("fsdp", pr, 1, b, s, compile=True, device="cpu")
    assert got == layer_activation_bytes(cfg, setup)


def _cfg() -> ModelConfig:
    # Every dim divisible by 2 x 4 ranks: no padding, so the ZeRO table holds exactly.
    return ModelConfig(n_layer=2, n_head=4, d_model=64, ffn_hidden=128, vocab_size=512)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_state_follows_the_zero_paper_table(precision):
    cfg, n = _cfg(), 4
    shapes = param_shapes(cfg)
    psi, steps = sum(torch.Size(s).numel() for s in shapes), 4 * len(shapes)
    pr = PRECISIONS[precision]

    def state(strategy, world):
        st = model_state_bytes(shapes, MemorySetup(strategy, pr, world))
        return st.params, st.grads, st.optim + st.master

    # torch AdamW under autocast: fp32 params, fp32 grads, two fp32 moments (+ step scalars).
    assert state("ddp", n) == state("single", 1) == (4 * psi, 4 * psi, 8 * psi + steps)
    assert state("fsdp", n) == (4 * psi // n, 4 * psi // n, 8 * psi // n + steps)
    # DeepSpeed: with 16-bit compute the module is cast (2 bytes); an fp32 master partition
    # joins the moments in every precision (K = 12).
    p, k = (2, 12) if precision == "bf16" else (4, 12)
    ds_steps = 2 * 4  # one step tensor per flat param group
    # ZeRO-1 and -2 as DeepSpeed runs them: after backward each rank keeps the gradients of
    # the parameters overlapping its partition, whole (a little over 1/N).
    # (ZeRO-1 only with overlap_comm, i.e. on CUDA, and without gradient accumulation.)
    for stage in ("zero1", "zero2"):
        params, grads, optim = state(stage, n)
        assert (params, optim) == (p * psi, k * psi // n + ds_steps)
        assert p * psi // n <= grads <= p * psi // n + 2 * p * max(map(math.prod, shapes))
    # Otherwise ZeRO-1 holds the full gradients, the ZeRO paper's 2Ψ (at 16 bits).
    for setup in (
        MemorySetup("zero1", pr, n, device="cpu"),
        MemorySetup("zero1", pr, n, grad_accum_steps=2),
        MemorySetup("zero1", pr, n, ds_overlap_comm=False),
    ):
        assert model_state_bytes(shapes, setup).grads == p * psi
    assert state("zero3", n) == (p * psi // n, p * psi // n, k * psi // n + ds_steps)


def test_zero1_plans_as_zero2_on_cuda_unless_it_accumulates():
    """On CUDA (overlap_comm) without accumulation DeepSpeed's stage 1 and 2 hold the same
    memory (2x H200, 1b, bf16: both peaked at 45.32 GiB allocated); with accumulation ZeRO-1
    carries the full gradients into the last micro-step's backward."""
    cfg = ModelConfig(**{**_cfg().__dict__, "vocab_size": 50304})
    base = MemorySetup("zero1", BF16, 2, micro_batch_size=4, seq_len=512)
    z1, z2 = plan_memory(cfg, base), plan_memory(cfg, replace(base, strategy="zero2"))
    assert z1.total_bytes == z2.total_bytes and z1.at_peak == z2.at_peak
    psi = sum(math.prod(sh) for sh in param_shapes(cfg))
    acc = plan_memory(cfg, replace(base, grad_accum_steps=2))
    assert acc.phase == "backward" and acc.at_peak["grads"] == acc.grads_bytes == 2 * psi
    assert acc.total_bytes - z1.total_bytes == 2 * psi


def _state3(shapes, setup) -> tuple[int, int, int]:
    st = model_state_bytes(shapes, setup)
    return st.params, st.grads, st.optim


def test_fsdp_pads_dim0_and_the_last_rank_holds_less():
    shapes = [(5, 7), (3,), (1, 4)]
    s0, s1 = (_state3(shapes, MemorySetup("fsdp", F32, 2, rank=r)) for r in (0, 1))
    padded = 3 * 7 + 2 + 1 * 4  # ceil(dim0 / 2) rows of each tensor, on every rank
    assert s0[:2] == s1[:2] == (4 * padded, 4 * padded)
    assert s0[2] == 8 * (3 * 7 + 2 + 4) + 12  # real rows only in AdamW's states
    assert s1[2] == 8 * (2 * 7 + 1 + 0) + 12
    # HSDP 2 x 2: shards within groups of 2, so the same as 2 ranks.
    hsdp = MemorySetup("fsdp", F32, 4, replicate_degree=2, rank=3)
    assert _state3(shapes, hsdp) == s1


def test_more_micro_batch_more_memory_and_the_largest_that_fits():
    cfg = ModelConfig(**{**_cfg().__dict__, "vocab_size": 50304})
    setup = MemorySetup("ddp", BF16, 2, micro_batch_size=1, seq_len=512)
    totals = [plan_memory(cfg, replace(setup, micro_batch_size=b)).total_bytes for b in (1, 2, 4)]
    assert totals[0] < totals[1] < totals[2]
    cap = 2 * 1024**3
    best = largest_micro_batch(cfg, setup, cap)
    assert best >= 1
    assert plan_memory(cfg, replace(setup, micro_batch_size=best)).total_bytes <= cap
    assert plan_memory(cfg, replace(setup, micro_batch_size=best + 1)).total_bytes > cap


def test_sharding_and_checkpointing_cut_memory():
    cfg = ModelConfig(**{**_cfg().__dict__, "vocab_size": 50304})
    base = MemorySetup("ddp", BF16, 8, micro_batch_size=4, seq_len=1024)
    ddp = plan_memory(cfg, base)
    fsdp = plan_memory(cfg, replace(base, strategy="fsdp"))
    assert fsdp.model_state_bytes < ddp.model_state_bytes / 4
    # Full checkpointing keeps only each block's input (the head's loss is not checkpointed).
    full = replace(base, activation_checkpointing="full")
    sel = replace(base, activation_checkpointing="selective")
    per_layer = [layer_activation_bytes(cfg, s) for s in (base, sel, full)]
    assert per_layer[0] > per_layer[1] > per_layer[2] == 4 * 4 * 1024 * cfg.d_model
    offload = plan_memory(cfg, replace(base, strategy="fsdp", cpu_offload=True))
    assert offload.model_state_bytes == 0 and offload.host_bytes == fsdp.model_state_bytes


def test_a_new_strategy_is_planned_from_the_facts_it_declares(monkeypatch, tmp_path):
    """Adding a strategy touches its own file (here, this test), its conf/strategy YAML and its
    tests: registered, it is composed, checked and planned from what it declares, with no
    change to dtrain.memory, dtrain.precision or dtrain.config."""
    import shutil

    from dtrain.config import CONF_DIR
    from dtrain.config import compose as compose_from
    from dtrain.memory import setup_from_config, summary_text
    from dtrain.strategies import STRATEGIES
    from dtrain.strategies.base import MemoryFacts, Strategy

    class AutocastFSDP(Strategy):
        """FSDP2's layout, with autocast doing the casting instead of FSDP's policy."""

        name = "autocast-fsdp"
        names = ("autocast-fsdp",)
        needs_distributed = True
        options = ("reshard_after_forward",)
        memory = MemoryFacts(shards=frozenset({"params", "grads", "optim"}), partition="dim0")

    monkeypatch.setitem(STRATEGIES, AutocastFSDP.name, AutocastFSDP)
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=64, vocab_size=320)
    setup = MemorySetup(AutocastFSDP.name, BF16, 4, 2, 64)
    new = plan_memory(cfg, setup)
    fsdp = plan_memory(cfg, replace(setup, strategy="fsdp"))
    ddp = plan_memory(cfg, replace(setup, strategy="ddp"))
    state = ("params_bytes", "grads_bytes", "optim_bytes")
    assert [getattr(new, k) for k in state] == [getattr(fsdp, k) for k in state]
    assert new.activations_bytes == ddp.activations_bytes != fsdp.activations_bytes
    assert "Sharding over 4 ranks" in summary_text(new, setup, cfg)

    # Its YAML lists what differs from the base; the options it honours reach the planner and
    # the checks read its facts.
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "strategy/autocast-fsdp.yaml").write_text(
        "defaults:\n  - /strategy_base@_here_\nname: autocast-fsdp\nreshard_after_forward: false\n"
    )
    run = compose_from(["strategy=autocast-fsdp", "model.n_layer=4", "model.vocab_size=320"], conf)
    st, cfg = run.strategy, run.model
    reduced = replace(BF16, reduce_override=True)  # needs a strategy that reduces gradients
    AutocastFSDP.check_config(st, reduced, "cuda")
    with pytest.raises(ConfigError, match="does not apply to strategy=autocast-fsdp"):
        AutocastFSDP.check_config(replace(st, cpu_offload=True), BF16, "cuda")
    from_config = setup_from_config(run, BF16, 4, device="cpu")
    assert (from_config.strategy, from_config.reshard_after_forward) == (AutocastFSDP.name, False)
    resharded = replace(from_config, reshard_after_forward=True)
    assert (
        plan_memory(cfg, from_config).transient_bytes > plan_memory(cfg, resharded).transient_bytes
    )


def test_the_planner_and_the_precision_checks_never_name_a_strategy():
    """They ask the strategy for its facts; a strategy's name is only ever a registry key."""
    import ast

    from dtrain.strategies import STRATEGIES

    names = {*STRATEGIES, "zero", "deepspeed"}
    files = [*(ROOT / "dtrain/memory").glob("*.py"), ROOT / "dtrain/precision.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                raise AssertionError(f"{path.name}:{node.lineno} compares a strategy name")


# --- a real run: the prediction logged, and exact against the measured bytes ----------------


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    train(run_dir, *STEPS)
    return run_dir


def _per_rank_plans(run_dir: Path, overrides: list[str], world: int) -> list:
    from dtrain.memory import resolve_vocab

    cfg = compose(*FAST, *overrides, f"hydra.run.dir={run_dir}")
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=resolve_vocab(cfg)))
    plans = []
    for r in range(world):
        setup = setup_from_config(cfg, PRECISIONS[cfg.precision.name], world, "cpu", rank=r)
        plans.append(plan_memory(cfg.model, setup))
    return plans


def _assert_exact(run_dir: Path, overrides: list[str], world: int) -> None:
    recs = read_jsonl(run_dir / "metrics.jsonl")
    pred = next(r["memory_predicted"] for r in recs if "memory_predicted" in r)
    measured = [r for r in recs if "memory_per_rank" in r][-1]["memory_per_rank"]
    assert len(measured) == world
    for r, plan in enumerate(_per_rank_plans(run_dir, overrides, world)):
        keys = ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes")
        got = {k: measured[r].get(k, 0) for k in keys}
        want = {k: getattr(plan, k) for k in keys}
        assert got == want, (r, got, want)
    for k in ("params_bytes", "grads_bytes", "optim_bytes"):  # the run logged rank 0's plan
        assert pred[k] == measured[0][k]
    errors = [r["memory_prediction_error_pct"] for r in recs if "memory_prediction_error_pct" in r]
    assert errors and all(e == 0.0 for e in errors)


def test_a_run_logs_its_prediction(single_run):
    recs = read_jsonl(single_run / "metrics.jsonl")
    first = recs[0]
    assert first["run"]["strategy"] == "single" and first["run"]["model"] == "tiny"
    pred = first["memory_predicted"]
    for k in ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes", "total_bytes"):
        assert isinstance(pred[k], int) and pred[k] > 0, k
    assert pred["total_bytes"] == sum(pred["at_peak"].values())
    assert all(r["memory_prediction_compares"] == "model_state" for r in recs if "loss" in r)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(single_run / "tensorboard" / "single-fp32-w1-tiny"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    # The prediction beside the measured quantity at every logged step (GiB), not once.
    assert "memory/predicted/model_state_gib" in scalars
    # A CPU model-state comparison has its own tag, apart from the GPU peak's.
    assert "memory/prediction_error_pct_model_state" in scalars
    assert "memory/prediction_error_pct" not in scalars
    assert "memory/predicted/text_summary" in acc.Tags()["tensors"]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]


def test_single_is_exact(single_run):
    _assert_exact(single_run, STEPS, 1)


def test_ddp_one_rank_is_exact(tmp_path):
    train(tmp_path, *STEPS, "strategy=ddp")
    _assert_exact(tmp_path, [*STEPS, "strategy=ddp"], 1)


MULTI = [
    pytest.param(["strategy=ddp"], id="ddp"),
    pytest.param(["strategy=fsdp", "strategy.reshard_after_forward=true"], id="fsdp"),
    # The default, auto: the host's memory holds the blocks kept gathered, so false.
    pytest.param(["strategy=fsdp"], id="fsdp-auto-noreshard"),
    # On CPU (no overlap_comm) ZeRO-1 holds the full gradients until the boundary reduction.
    pytest.param(["strategy=zero1"], id="zero1"),
    pytest.param(["strategy=zero2"], id="zero2"),
    pytest.param(["strategy=zero3"], id="zero3"),
]


@pytest.mark.parametrize("extra", MULTI)
def test_two_ranks_are_exact(tmp_path, extra):
    name = extra[0].split("=")[1]
    if not _registered(name):
        pytest.skip(f"strategy {name} is not registered yet")
    if name.startswith("zero"):
        pytest.importorskip("deepspeed")
    res = launch(*FAST, *STEPS, *extra, f"hydra.run.dir={tmp_path}", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_exact(tmp_path, [*STEPS, *extra], 2)
    if extra == ["strategy=fsdp"]:
        assert "strategy.reshard_after_forward=auto: false" in res.stderr + res.stdout


FSDP_WORKER = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from dtrain.strategies.base import optimizer_tensors, tensor_bytes
    dist.init_process_group("gloo")
    shapes = [(5, 7), (3, 5), (3,), (1, 6)]
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(7, 5, bias=False)  # (5, 7)
            self.b = nn.Linear(5, 3)  # (3, 5) and (3,)
            self.c = nn.Parameter(torch.randn(1, 6))
        def forward(self, x):
            return self.b(self.a(x)).sum() + self.c.sum()
    m = M()
    fully_shard(m.a); fully_shard(m.b); fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    m(torch.randn(4, 7)).backward()
    opt.step()
    ps = list(m.parameters())
    got = [tensor_bytes(ps), tensor_bytes(p.grad for p in ps),
           tensor_bytes(optimizer_tensors(opt))]
    out = [None, None]
    dist.all_gather_object(out, got)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"shapes": shapes, "bytes": out}))
    # Both ranks past every collective before either tears gloo down: in one fast-tier run
    # (2026-11-26) rank 1 aborted in teardown ("terminate called without an active exception").
    # A guard, not a proven fix: the same abort hit bench/plain_loop.py's fsdp smoke once, and
    # neither reproduced in 20 runs on their own, loaded or not.
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_fsdp2_layout_is_what_fully_shard_does(tmp_path):
    """The planner's FSDP2 layout (padded dim-0 shards, unpadded optimizer states) against
    fully_shard itself on uneven shapes: runs before the fsdp strategy exists."""
    script = tmp_path / "worker.py"
    script.write_text(FSDP_WORKER)
    res = torchrun_script(script, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    data = json.loads(line[len("RESULT ") :])
    shapes = [tuple(s) for s in data["shapes"]]
    for r in range(2):
        plan = _state3(shapes, MemorySetup("fsdp", F32, 2, rank=r))
        assert list(plan) == data["bytes"][r], (r, plan, data["bytes"][r])


ZERO1_WORKER = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from dtrain.config import OptimConfig, StrategyConfig
    from dtrain.dist import init_distributed
    from dtrain.model import ModelConfig
    from dtrain.precision import PRECISIONS
    from dtrain.strategies.base import tensor_bytes
    from dtrain.strategies.deepspeed import DeepSpeedStrategy

    env = init_distributed("cpu")
    model = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=128, ffn_hidden=384,
                        vocab_size=512, max_seq_len=32)
    results = []
    for case in json.loads(sys.argv[1]):
        s = DeepSpeedStrategy(StrategyConfig(name="zero1", bucket_cap_mb=case["bucket_mb"]),
                              PRECISIONS[case["precision"]], env)
        make = s.ds_config
        def forced(m, make=make, overlap=case["overlap"]):  # the CUDA setting, on CPU
            cfg = make(m)
            cfg["zero_optimization"]["overlap_comm"] = overlap
            return cfg
        s.ds_config = forced
        ga = case["ga"]
        s.configure(micro_batch_size=2, grad_accum_steps=ga, grad_clip=1.0)
        s.setup(model, OptimConfig(), 0)
        opt, seen = s.engine.optimizer, {"buckets": 0, "step_fp32": 0}
        watched = s.engine.allreduce_gradients
        def reduction(*a, **k):  # the buckets allocated as a backward hands over
            bufs = [b for bk in opt.ipg_buckets.values() for b in bk.buffer]
            seen["buckets"] = max(seen["buckets"], tensor_bytes(bufs))
            return watched(*a, **k)
        s.engine.allreduce_gradients = reduction
        clip = opt.unscale_and_clip_grads
        def step_copy(groups, norm):  # one group's flat fp32 gradient partition
            seen["step_fp32"] = max(seen["step_fp32"], tensor_bytes(groups))
            return clip(groups, norm)
        opt.unscale_and_clip_grads = step_copy
        torch.manual_seed(env.rank)
        for micro in range(ga):
            x, y = (torch.randint(0, model.vocab_size, (2, 16)) for _ in "xy")
            s.forward_backward(x, y, last_micro=micro == ga - 1, loss_div=ga)
        s.clip_and_step(1e-3, 1.0)
        results.append({"grads": s._state_bytes.grads_bytes, **seen})
    out = [None] * env.world_size
    dist.all_gather_object(out, results)
    if env.rank == 0:
        print("RESULT " + json.dumps({"model": model.__dict__, "ranks": out}))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_zero1_holds_what_the_plan_says_on_each_path(tmp_path):
    """ZeRO-1's gradients under overlap_comm (dtrain's setting on CUDA, forced here on CPU):
    the partition buffer only, over several bucket reductions and with one bucket for all;
    with accumulation the full gradients again. And the buckets and the optimizer step's
    fp32 gradient partition that the plan holds as transients."""
    pytest.importorskip("deepspeed")
    from dtrain.memory import (
        ds_reduce_bucket_bytes,
        zero_partition,
        zero_step_copy_bytes,
    )

    cases = [  # 1 MB buckets: 262,144 elements, fewer than the model, more than any tensor
        {"overlap": True, "ga": 1, "precision": "fp32", "bucket_mb": 1},
        {"overlap": True, "ga": 1, "precision": "bf16", "bucket_mb": 2000},
        {"overlap": True, "ga": 2, "precision": "bf16", "bucket_mb": 1},
        {"overlap": False, "ga": 2, "precision": "bf16", "bucket_mb": 1},
    ]
    script = tmp_path / "worker.py"
    script.write_text(ZERO1_WORKER)
    res = torchrun_script(script, json.dumps(cases))
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    data = json.loads(line[len("RESULT ") :])
    cfg = ModelConfig(**data["model"])
    shapes = param_shapes(cfg)
    psi = sum(math.prod(sh) for sh in shapes)
    for i, case in enumerate(cases):
        pr = PRECISIONS[case["precision"]]
        g = 2 if case["precision"] == "bf16" else 4
        for r in range(2):
            setup = MemorySetup(
                "zero1",
                pr,
                2,
                device="cpu",
                rank=r,
                grad_accum_steps=case["ga"],
                ds_overlap_comm=case["overlap"],
                ds_bucket_elements=case["bucket_mb"] * 2**20 // 4,
            )
            got, zp = data["ranks"][r][i], zero_partition(shapes, setup)
            want = model_state_bytes(shapes, setup).grads
            assert got["grads"] == want, (case, r, got, want)
            if case["ga"] > 1 or not case["overlap"]:
                assert want == psi * g  # the full gradients
            else:
                assert want == zp.overlap_elements * g < psi * g  # the partition buffer
            assert got["buckets"] == ds_reduce_bucket_bytes(setup), (case, r, got)
            # The step's fp32 partition (the plan adds the 16-bit flat copy it is made from).
            assert got["step_fp32"] == 4 * max(zp.group_elements), (case, r, got)
            assert zero_step_copy_bytes(zp, setup) == (4 + 2 * (g == 2)) * max(zp.group_elements)


# --- the plan CLI --------------------------------------------------------------------------


def _plan(*args: str) -> dict:
    from dtrain.cli.plan import build_plan

    return build_plan([*args, "format=json"])


def test_plan_json_has_the_documented_keys():
    p = _plan("model=1b", "strategy=ddp", "precision=bf16", "world_size=2", "gpu=h100-80gb")
    for k in (
        "params_bytes",
        "grads_bytes",
        "optim_bytes",
        "activations_bytes",
        "total_bytes",
        "n_params",
        "flops_per_token",
        "chinchilla_tokens",
    ):
        assert k in p, k
    assert p["chinchilla_tokens"] == 20 * p["n_params"]
    assert p["fits"] == (p["total_bytes"] <= p["gpu_memory_bytes"])
    assert p["chinchilla"]["gpu_hours"] > 0 and "rule of thumb" in p["summary"].lower()
    # Unsharded AdamW under autocast: 16 bytes per parameter, plus a 4-byte step per tensor
    # (1b: 24 blocks of 9 tensors, the tied embedding, the final norm).
    state = p["params_bytes"] + p["grads_bytes"] + p["optim_bytes"]
    assert state == 16 * p["n_params"] + 4 * (24 * 9 + 2)


def test_plan_is_for_the_gpu_named_not_this_machine():
    """fp16 and fp8 cannot train on this CPU, yet plan for an H100; fp8 saves activations."""
    args = ("model=1b", "strategy=fsdp", "world_size=2", "gpu=h100-80gb")
    bf16, fp16, fp8 = (_plan(*args, f"precision={p}") for p in ("bf16", "fp16", "fp8"))
    assert fp16["total_bytes"] == bf16["total_bytes"]
    assert fp8["activations_bytes"] < bf16["activations_bytes"]


def test_plan_text_says_fits_and_the_budget(capsys):
    from dtrain.cli.plan import main

    assert main(["model=350m", "strategy=ddp", "world_size=2", "gpu=a100-40gb"]) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch that fits" in out and "Chinchilla" in out and "GPU-hours" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["gpu=x100"], "unknown gpu 'x100'; valid choices: h200-141gb"),
        (["world_size=abc"], "world_size must be a number"),
        (["world_size=0"], "world_size must be >= 1"),
        (["format=xml"], "format='xml'; valid choices: text, json"),
        (["strategy=nope"], "unknown strategy 'nope'"),
        (["strategy=single", "world_size=2"], "strategy=single runs one process"),
        (["mfu=2"], "mfu must be in"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size must be > 0"),
        # what training refuses before it starts (Strategy.check_config)
        (["precision=bf16", "precision.reduce_dtype=bf16"], "strategy=single reduces none"),
        (["strategy=fsdp", "strategy.compile_scope=model"], "does not apply to strategy=fsdp"),
        (["strategy=zero2", "precision=int8", "world_size=2"], "cannot train precision=int8"),
        (["strategy=zero2", "strategy.stage=3", "world_size=2"], "use strategy=zero3"),
        (["strategy=zero1", "strategy.offload_params=true", "world_size=2"], "needs ZeRO stage 3"),
    ],
)
def test_plan_bad_input_is_one_line_and_exit_2(capsys, args, message):
    from dtrain.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_plan_cli_runs_as_a_module():
    res = subprocess.run(
        [sys.executable, "-m", "dtrain.cli.plan", "gpu=nope"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: unknown gpu")


# --- compare ---------------------------------------------------------------------------------


def test_compare_prints_the_table_and_writes_the_chart(single_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from dtrain.cli.compare import main

    png = tmp_path / "chart.png"
    assert main([str(single_run), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(single_run.name))
    assert " single " in row and " fp32 " in row and "+0.0%" in row
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_writes_no_chart_unless_asked_and_takes_key_value(
    single_run, tmp_path, capsys, monkeypatch
):
    pytest.importorskip("matplotlib")
    import shutil

    from dtrain.cli.compare import main

    for name in ("a", "b"):
        shutil.copytree(single_run, tmp_path / "sweep" / name)
    before = sorted(p.name for p in (tmp_path / "sweep").rglob("*"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main([str(tmp_path / "sweep/a"), str(tmp_path / "sweep/b")]) == 0
    assert sorted(p.name for p in (tmp_path / "sweep").rglob("*")) == before
    assert list(cwd.iterdir()) == []
    chart = tmp_path / "chart.png"
    assert main([f"runs=[{tmp_path / 'sweep/a'}]", f"png={chart}", "markdown=true"]) == 0
    captured = capsys.readouterr()
    assert "| run | strategy |" in captured.out
    assert captured.err.strip().splitlines()[-1] == f"chart: {chart}"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_reads_event_files_without_metrics_jsonl(single_run, tmp_path, capsys):
    import shutil

    from dtrain.cli.compare import main, read_run

    copy = tmp_path / "events_only"
    shutil.copytree(single_run / "tensorboard", copy / "tensorboard")
    a, b = read_run(single_run), read_run(copy)
    assert b.measured_bytes == pytest.approx(a.measured_bytes, rel=1e-6)  # GiB in float32
    assert b.predicted_bytes == pytest.approx(a.predicted_bytes, rel=1e-6)
    assert b.final_loss == pytest.approx(a.final_loss, rel=1e-6)
    assert main([str(copy), "--no-png", "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| run | strategy |")


def test_compare_refuses_a_dir_that_is_no_run(tmp_path, capsys):
    from dtrain.cli.compare import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--no-png"])
    assert e.value.code == 2 and "is not a run dir" in capsys.readouterr().err


# --- sweeps and the GPU check, on CPU -------------------------------------------------------


@pytest.mark.slow
def test_sweep_runs_a_grid_that_compare_takes(tmp_path):
    pytest.importorskip("matplotlib")
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "sweep.py"),
            "--out",
            str(tmp_path),
            "strategy=single,ddp",
            *FAST,
            *STEPS,
            "checkpoint.save_final=false",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert dirs == ["ddp-fp32-w1-tiny", "single-fp32-w1-tiny"]
    assert (tmp_path / "compare.png").exists()
    assert "2 done, 0 failed" in res.stdout


@pytest.mark.slow
def test_memory_check_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "memory_check.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--strategies",
            "single,ddp,nosuch",
            "--nprocs",
            "1",
            "--all-pairs",
            "--steps",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md = (tmp_path / "memory_check.md").read_text()
    assert "| tiny | single | fp32 | 1 |" in md and "| tiny | ddp | fp32 | 1 |" in md
    assert "not available" in md  # the unknown strategy is listed, not failed
    rows = json.loads((tmp_path / "memory_check.json").read_text())
    assert [r["error_pct"] for r in rows if r["status"] == "ok"] == [0.0, 0.0]
    assert (tmp_path / "memory_check.png").exists()


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_what_is_alive_at_the_peak_adds_up(strategy, micro_batch):
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=256, vocab_size=50304)
    world = 1 if strategy == "single" else 4
    for precision in (F32, BF16):
        plan = plan_memory(cfg, MemorySetup(strategy, precision, world, micro_batch, 512))
        assert sum(plan.at_peak.values()) == plan.total_bytes
        assert plan.total_bytes == plan.peak_bytes + plan.context_bytes


@pytest.mark.slow  # torchao compiles its 8-bit step: minutes on a busy CPU
def test_8bit_adamw_moments_are_what_torchao_keeps():
    """precision.optimizer_8bit: torchao's AdamW8bit quantizes the moments of tensors of at
    least 4096 elements (uint8 codes, a scale per 256, a lookup table); the rest stay plain."""
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit

    cfg = ModelConfig(n_layer=1, n_head=4, d_model=128, ffn_hidden=96, vocab_size=320)
    model = build_model(cfg, "cpu")
    opt = AdamW8bit(model.parameters())
    model(torch.randint(0, 320, (2, 16)), torch.randint(0, 320, (2, 16))).backward()
    opt.step()
    measured = 0
    for state in opt.state.values():
        for v in state.values():
            parts = [v.codes, v.scale, v.qmap] if hasattr(v, "codes") else [v]
            measured += sum(t.numel() * t.element_size() for t in parts)
    pr = replace(F32, optimizer_8bit=True)
    planned = model_state_bytes(param_shapes(cfg), MemorySetup("single", pr, 1)).optim
    assert planned == measured


def test_ddp_with_small_buckets_carries_its_measured_extra_gradient_buffers():
    """The empirical DDP term (memory.DDP_EXTRA_GRAD_BUFFERS): compiled DDP on CUDA with 2+
    ranks and buckets under DDP_SMALL_BUCKET_MB only, sized by the gradient bytes, named in the
    notes; dtrain's default 400 MB buckets (measured without it on GPU) carry none."""
    from dtrain.memory import DDP_EXTRA_GRAD_BUFFERS

    cfg = ModelConfig(n_layer=2, n_head=4, d_model=256, vocab_size=50304)
    base = MemorySetup("ddp", BF16, 2, 4, 512, device="cuda", compile=True, ddp_bucket_mb=25)
    ddp = plan_memory(cfg, base)
    one = plan_memory(cfg, replace(base, world_size=1))
    cpu = plan_memory(cfg, replace(base, device="cpu"))
    big = plan_memory(cfg, replace(base, ddp_bucket_mb=400))
    eager = plan_memory(cfg, replace(base, compile=False))
    assert ddp.transient_bytes - one.transient_bytes == DDP_EXTRA_GRAD_BUFFERS * ddp.grads_bytes
    assert big.transient_bytes == one.transient_bytes
    assert any("empirical" in n for n in ddp.notes)
    assert not any("empirical" in n for n in one.notes + cpu.notes + big.notes + eager.notes)
    # The run's own setup carries the configured bucket size.
    from dtrain.memory import setup_from_config

    assert setup_from_config(compose(*FAST, "strategy=ddp"), BF16, 2, "cuda").ddp_bucket_mb == 400


def test_plan_takes_hsdp_as_fsdp_within_groups():
    """strategy=hsdp (2 replicas x 2 shards on 4 GPUs) plans as fsdp sharded over 2 ranks."""
    from dtrain.cli.plan import build_plan

    hsdp = build_plan(["strategy=hsdp", "world_size=4", "format=json"])
    fsdp2 = build_plan(["strategy=fsdp", "world_size=2", "format=json"])
    assert hsdp["strategy"] == "hsdp"
    assert (
        hsdp["params_bytes"] == fsdp2["params_bytes"]
        and hsdp["optim_bytes"] == fsdp2["optim_bytes"]
    )


def _small_fsdp_on_two(precision: str) -> tuple[ModelConfig, MemorySetup]:
    """A small model under fsdp on 2 GPUs, for the planner's fsdp-only terms."""
    cfg = ModelConfig(vocab_size=32000, n_layer=4, d_model=512, n_head=8)
    setup = MemorySetup(
        strategy="fsdp",
        precision=PRECISIONS[precision],
        world_size=2,
        micro_batch_size=4,
        seq_len=512,
    )
    return cfg, setup


def test_fsdp_gradient_shards_add_a_pool_of_their_own_unless_on_the_compute_stream():
    # 8b on 2x H200 without it: 14.96 GiB of gradient shards reserved by the reduce-scatter
    # stream beside the compute stream's 90.74 GiB peak (docs/memory.md). With it (the
    # default, one replica group) the shards take what the backward frees.
    from dtrain.memory.plan import fsdp_grads_pool_apart

    cfg, base = _small_fsdp_on_two("bf16")
    plans = {
        name: plan_memory(cfg, replace(base, **kw))
        for name, kw in {
            "on": {},
            "off": {"grads_on_compute_stream": False},
            "hsdp": {"replicate_degree": 2},
            "cpu": {"device": "cpu", "grads_on_compute_stream": False},
        }.items()
    }
    on, off, hsdp = plans["on"], plans["off"], plans["hsdp"]
    assert on.phase == off.phase == "backward"
    assert on.at_peak["grads"] == 0 and off.at_peak["grads"] == off.grads_bytes > 0
    assert off.peak_bytes - on.peak_bytes == off.grads_bytes
    assert hsdp.at_peak["grads"] == hsdp.grads_bytes  # HSDP keeps FSDP2's own allocation
    assert plans["cpu"].at_peak["grads"] == 0  # no streams off CUDA
    assert not fsdp_grads_pool_apart(replace(base, strategy="ddp", grads_on_compute_stream=False))
    # Reduced in bf16, the shards are cast back to fp32 on FSDP2's stream: a pool apart again.
    bf16_reduce = replace(PRECISIONS["bf16"], reduce_dtype=torch.bfloat16)
    assert fsdp_grads_pool_apart(replace(base, precision=bf16_reduce))


def test_fp8_under_fsdp_plans_the_kept_fp8_weight_shards():
    # dtrain.lowp.fp8 casts each block-linear weight shard to fp8 once per step and keeps it
    # for the all-gathers: one byte per element of this rank's shards, counted at the peak.
    cfg, setup = _small_fsdp_on_two("fp8")
    shapes = param_shapes(cfg)
    linears = sum(math.prod(s) for s in shapes if len(s) == 2 and s[0] != cfg.vocab_size)
    with_cache = plan_memory(cfg, setup)
    assert any("fp8 copy" in n for n in with_cache.notes)
    rowwise = replace(PRECISIONS["fp8"], fp8_recipe="rowwise")  # gathers in bf16: no cache
    wide = replace(PRECISIONS["fp8"], fp8_all_gather=False)  # the same, told to
    for precision in (rowwise, wide):
        without = plan_memory(cfg, replace(setup, precision=precision))
        assert not any("fp8 copy" in n for n in without.notes)
    one_rank = plan_memory(cfg, replace(setup, world_size=1))
    assert not any("fp8 copy" in n for n in one_rank.notes)
    from dtrain.memory.plan import _fp8_shard_cache_bytes

    assert _fp8_shard_cache_bytes(cfg, setup) == math.ceil(linears / 2)
    assert with_cache.at_peak["transient"] >= math.ceil(linears / 2)

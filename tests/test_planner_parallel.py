"""The planner under parallel.tp and parallel.cp: model state split by tp, activations by tp
and cp, their collectives priced by the ring formula, the layouts searched by objective=fastest,
and the layouts that do not divide refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtrain.hardware import GPUS
from dtrain.memory import plan_memory, plan_speed, planned_config
from dtrain.memory.machine import datasheet_machine
from dtrain.memory.search import search
from tests.conftest import compose

H100 = GPUS["h100-80gb"]
SHAPE = ("model=8b", "model.vocab_size=128256", "strategy=fsdp", "precision=bf16")


def _setup(*overrides: str, world: int):
    cfg, _, setup = planned_config(compose(*SHAPE, *overrides), world, "cuda")
    return cfg, setup


def test_tp_splits_model_state_like_sharding_over_as_many_more_ranks():
    cfg, fsdp16 = _setup(world=16)
    _, tp2 = _setup("parallel.tp=2", world=16)
    _, tp2_alone = _setup("parallel.tp=2", world=2)
    _, one = _setup("strategy=single", world=1)
    a, b = plan_memory(cfg.model, fsdp16), plan_memory(cfg.model, tp2)
    assert b.params_bytes == pytest.approx(a.params_bytes, rel=1e-3)
    assert b.optim_bytes == pytest.approx(a.optim_bytes, rel=1e-3)
    assert plan_memory(cfg.model, tp2_alone).params_bytes == pytest.approx(
        plan_memory(cfg.model, one).params_bytes / 2, rel=1e-3
    )


def test_tp_and_cp_divide_the_activations():
    cfg, plain = _setup("trainer.seq_len=8192", "trainer.micro_batch_size=1", world=8)
    acts = plan_memory(cfg.model, plain).activations_bytes
    for layout in ("parallel.tp=2", "parallel.cp=2"):
        _, split = _setup("trainer.seq_len=8192", "trainer.micro_batch_size=1", layout, world=8)
        halved = plan_memory(cfg.model, split).activations_bytes
        assert 0.45 * acts < halved < 0.6 * acts, (layout, halved / acts)


def test_loss_parallel_keeps_the_logits_split():
    args = ("trainer.seq_len=8192", "trainer.micro_batch_size=1", "parallel.tp=2")
    cfg, split = _setup(*args, world=8)
    _, whole = _setup(*args, "parallel.loss_parallel=false", world=8)
    a, b = plan_memory(cfg.model, split), plan_memory(cfg.model, whole)
    logits = 8192 * cfg.model.vocab_size  # one fp32 copy of them is the least a loss keeps
    assert (
        b.activations_bytes + b.transient_bytes - a.activations_bytes - a.transient_bytes
        > 2 * logits
    )


def test_tp_gathers_and_reduces_the_residual_stream_four_times_per_block():
    cfg, setup = _setup("parallel.tp=2", "trainer.micro_batch_size=2", world=16)
    machine = datasheet_machine(H100)
    rows = [r for r in plan_speed(cfg.model, setup, machine).collectives if r["ranks"] == 2]
    m, t = cfg.model, setup
    per_block = t.micro_batch_size * t.seq_len * m.d_model * 2  # bf16
    assert {r["op"] for r in rows} == {"all_gather", "reduce_scatter"}
    bw, latency = machine.link("all_gather", inter=False)
    for r in rows:
        assert r["bytes"] == 4 * (m.n_layer + 1) * per_block
        ring = 4 * ((m.n_layer + 1) * per_block / 2 / bw + (m.n_layer + 1) * latency)
        assert r["seconds"] == pytest.approx(ring)
        assert r["exposed_s"] == r["seconds"]


def test_cp_gathers_keys_and_values_and_fsdp_shards_over_dp_x_cp():
    cfg, setup = _setup("parallel.cp=2", world=8)
    rows = plan_speed(cfg.model, setup, datasheet_machine(H100)).collectives
    groups = {(r["op"], r["tensor"]): r["ranks"] for r in rows}
    assert groups[("all_gather", "kv")] == groups[("reduce_scatter", "kv")] == 2
    assert groups[("all_gather", "params")] == 8  # dp 4 x cp 2


def test_tokens_per_gpu_count_each_gpu_once():
    cfg, plain = _setup("trainer.micro_batch_size=2", world=16)
    _, tp2 = _setup("trainer.micro_batch_size=2", "parallel.tp=2", world=16)
    machine = datasheet_machine(H100)
    a, b = plan_speed(cfg.model, plain, machine), plan_speed(cfg.model, tp2, machine)
    assert b.tokens_per_step == a.tokens_per_step // 2  # half as many replicas' tokens per GPU
    assert b.compute_s == pytest.approx(a.compute_s / 2)  # the loss split by vocabulary too
    _, gathered = _setup(
        "trainer.micro_batch_size=2", "parallel.tp=2", "parallel.loss_parallel=false", world=16
    )
    assert plan_speed(cfg.model, gathered, machine).compute_s > b.compute_s  # the loss twice


def test_fastest_searches_tp_and_cp_layouts():
    cfg, base = _setup("trainer.seq_len=32768", "model.max_seq_len=32768", world=8)
    machine = datasheet_machine(H100)
    fitting, ruled_out = search(cfg.model, base, machine, H100.memory_bytes, precisions=["bf16"])
    layouts = {(c.setup.tp, c.setup.cp) for c in fitting + ruled_out}
    assert {(2, 1), (1, 2), (2, 2), (8, 1)} <= layouts
    assert not any(c.setup.replicate_degree > 1 and c.setup.tp > 1 for c in fitting)


def test_plan_cli_reports_the_layout(capsys):
    from dtrain.cli.plan import main

    argv = ["model=8b", "strategy=fsdp", "parallel.tp=2", "world_size=16", "gpu=h100-80gb"]
    assert main([*argv, "profile=none"]) == 0
    out = capsys.readouterr().out
    assert "on 16 rank(s) (tp 2)" in out
    assert "all_gather of activations over 2 ranks" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["parallel.tp=3", "world_size=12"], "parallel.tp=3 does not divide model.n_head=32"),
        (["parallel.tp=3", "world_size=16"], "= 3 does not divide the world size 16"),
        (["parallel.cp=2", "world_size=16", "trainer.seq_len=1002"], "seq_len=1002 is not"),
        (["parallel.tp=2", "world_size=16", "strategy=ddp"], "strategy=ddp does not compose"),
    ],
)
def test_plan_refuses_a_layout_that_does_not_divide(capsys, args, message):
    from dtrain.cli.plan import main

    with pytest.raises(SystemExit) as e:
        main(["model=8b", "gpu=h100-80gb", "strategy=fsdp", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_a_plan_without_tp_or_cp_is_unchanged():
    cfg, setup = _setup(world=16)
    assert plan_memory(cfg.model, setup) == plan_memory(cfg.model, replace(setup, tp=1, cp=1))

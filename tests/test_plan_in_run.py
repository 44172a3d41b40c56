"""The planner inside a training run: trainer.micro_batch_size=auto, the predicted tokens/s
beside the measured, an out-of-memory error turned into advice, and the slow first step said."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
import torch

from dtrain.errors import FaultError
from dtrain.hardware import GPUS, GiB
from tests.conftest import FAST, compose, launch, read_jsonl, train

QUICK = ["trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]
H100 = GPUS["h100-80gb"]


def test_auto_micro_batch_is_the_largest_that_fits_and_divides_the_global_batch(tmp_path, capfd):
    out = train(tmp_path, *QUICK, "trainer.micro_batch_size=auto", "trainer.global_batch_size=8")
    run = next(r["run"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "run" in r)
    # The tiny model fits thousands of sequences in host memory: the global batch bounds it.
    assert run["micro_batch_size"] == 8 and run["grad_accum_steps"] == 1
    said = "trainer.micro_batch_size=auto: 8, the largest the memory plan fits on this cpu"
    assert said in capfd.readouterr().err
    assert out["step"] == 3


def test_auto_micro_batch_that_cannot_fit_is_one_line_exit_2(tmp_path, monkeypatch):
    import dtrain.memory.search as search

    monkeypatch.setattr(search, "device_capacity", lambda device: 1 * 2**20)  # 1 MiB of "memory"
    from dtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="micro_batch_size=auto: no micro-batch fits"):
        train(tmp_path, *QUICK, "trainer.micro_batch_size=auto")


def test_the_predicted_speed_is_logged_beside_the_measured(tmp_path, monkeypatch):
    import dtrain.run.build as build
    from dtrain.memory import run_speed_prediction

    # On CPU there is no GPU to price the run on: as if it ran on an H100.
    monkeypatch.setattr(
        build,
        "run_speed_prediction",
        lambda cfg, world, device, **kw: run_speed_prediction(cfg, world, device, gpu=H100, **kw),
    )
    out = train(tmp_path, *QUICK)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    start = next(r for r in records if "speed_predicted" in r)
    predicted = start["predicted_tokens_per_s_per_gpu"]
    assert start["step"] == 0 and predicted > 0
    assert start["speed_predicted"]["step_s"] == pytest.approx(
        start["speed_predicted"]["compute_s"]
        + start["speed_predicted"]["recompute_s"]
        + start["speed_predicted"]["exposed_comm_s"]
        + start["speed_predicted"]["optimizer_s"]
        + start["speed_predicted"]["other_s"]
    )
    steps = [r for r in records if "loss" in r]
    assert [r["predicted_tokens_per_s_per_gpu"] for r in steps] == [predicted] * 3
    assert out["summary"]["predicted_tokens_per_s_per_gpu"] == pytest.approx(predicted)


def test_no_speed_prediction_on_cpu(tmp_path):
    train(tmp_path, *QUICK)
    assert not any(
        "predicted_tokens_per_s_per_gpu" in r for r in read_jsonl(tmp_path / "metrics.jsonl")
    )


def test_out_of_memory_stops_with_the_plan_and_what_fits(tmp_path, monkeypatch, capfd):
    import dtrain.run.oom as oom

    monkeypatch.setattr(oom, "device_gpu", lambda device: (H100, 80 * GiB, "NVIDIA H100 80GB"))
    monkeypatch.setenv("DTRAIN_FAULT", "train.step=oom#2")
    with pytest.raises(FaultError) as e:
        train(tmp_path, *QUICK, "checkpoint.every_n_steps=1")
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 3
    assert msg.startswith("rank 0 ran out of memory: CUDA out of memory (injected")
    assert str(tmp_path / "oom_advice.txt") in msg
    advice = (tmp_path / "oom_advice.txt").read_text()
    assert advice.startswith("out of memory: ") and "per GPU" in advice
    assert "rank 0 ran out of memory; out of memory: " in capfd.readouterr().err
    # Nothing saved after the OOM; step 1's checkpoint is left complete, the resume point.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_0000001"]


def test_out_of_memory_through_the_cli_is_exit_3_one_line(tmp_path):
    res = launch(
        *FAST, *QUICK, f"hydra.run.dir={tmp_path}", env_extra={"DTRAIN_FAULT": "train.step=oom#1"}
    )
    assert res.returncode == 3, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "ran out of memory" in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    # On CPU the advice says why there is none, and where to plan a known card.
    assert "no memory plan for cpu" in (tmp_path / "oom_advice.txt").read_text()


def test_a_slow_step_says_what_it_is_doing(caplog):
    from dtrain.run.slow_step import SlowStepNotice

    caplog.set_level(logging.INFO, logger="dtrain")
    notice = SlowStepNotice(1, "compiling", after_s=0.05, every_s=0.05).start()
    time.sleep(0.3)
    notice.stop()
    said = [r.message for r in caplog.records if "still running" in r.message]
    assert said and said[0].startswith("step 1 still running after 0 s: compiling")
    n = len(said)
    time.sleep(0.2)
    assert len([r for r in caplog.records if "still running" in r.message]) == n  # stopped
    quiet = SlowStepNotice(1, None, after_s=0.0).start()  # nothing slow: no thread, no line
    assert quiet._thread is None


def test_a_step_that_fails_stops_its_notice(caplog):
    """The loop holds the notice in a `with`: an exception in the step (an OOM, a NaN stop)
    does not leave it saying "still running" through the teardown."""
    from dtrain.run.slow_step import SlowStepNotice

    caplog.set_level(logging.INFO, logger="dtrain")
    with pytest.raises(RuntimeError):
        with SlowStepNotice(1, "compiling", after_s=0.05, every_s=0.05) as notice:
            time.sleep(0.2)
            raise RuntimeError("step failed")
    n = len([r for r in caplog.records if "still running" in r.message])
    assert n >= 1 and notice._thread is None
    time.sleep(0.2)
    assert len([r for r in caplog.records if "still running" in r.message]) == n


def test_the_first_step_work_is_named_by_the_strategy():
    from dtrain.config import PrecisionConfig, StrategyConfig
    from dtrain.dist import DistEnv
    from dtrain.precision import build_precision
    from dtrain.strategies import build_strategy

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    precision = build_precision(PrecisionConfig(name="fp32"), torch.device("cpu"))
    eager = build_strategy(StrategyConfig(name="single", compile=False), precision, env)
    compiled = build_strategy(StrategyConfig(name="single", compile=True), precision, env)
    assert eager.first_step_work() is None
    assert "torch.compile" in compiled.first_step_work()


def test_every_slow_step_the_strategy_names_is_announced_while_it_runs(tmp_path, monkeypatch):
    """Not only the first step: the loop arms the notice for each step the strategy names
    (DeepCompile's second compile), with that step's words, and for no other step."""
    import dtrain.train as train_mod
    from dtrain.strategies.single import SingleStrategy

    armed = []

    class Recorder:
        def __init__(self, step, what):
            armed.append((step, what))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(train_mod, "SlowStepNotice", Recorder)
    monkeypatch.setattr(
        SingleStrategy, "slow_steps", lambda self, first: {first: "a", first + 2: "b"}
    )
    train(tmp_path / "run", "trainer.max_steps=4", "trainer.eval_every=0")
    assert armed == [(1, "a"), (2, None), (3, "b"), (4, None)]


def test_the_slow_steps_move_with_an_eager_step_and_keep_what_comes_later(caplog):
    """Where the strategy's step mode still runs the planned compiling step eagerly (fp8's
    first step was not finite), the plan from that step moves by one and says so in the log;
    a slow step the first plan put later (DeepSpeed's second compile, counted from the
    process's first step) stays where it was."""
    from dtrain.run.slow_step import SlowSteps

    class Planned:
        eager = {10}  # the steps where the step mode runs eagerly

        def compiling_step(self, first):
            return first + 1 if first in self.eager else first

        def slow_steps(self, first):
            steps = {first: "eager", first + 1: "compile"} if first in self.eager else {}
            return steps | {self.compiling_step(first): "compile", first + 50: "again"}

    strategy = Planned()
    slow = SlowSteps(strategy, 10)
    assert slow.what(10) == "eager" and slow.compiling_at == 11
    strategy.eager = {11}  # step 10 was not finite: step 11 runs eagerly too
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert slow.what(11) == "eager"
    assert "step 11 runs eagerly as well" in caplog.text and "step 12 compiles" in caplog.text
    assert slow.what(12) == "compile" and slow.steps == {11: "eager", 12: "compile", 60: "again"}
    assert 12 in slow and 13 not in slow and 61 not in slow


def test_deepcompiles_second_compile_is_a_named_slow_step():
    """DeepSpeed's default schedule compiles again after WARMUP optimizer steps of this
    process (a resumed run counts from its own first step); the `once` schedule does not."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    from deepspeed.compile.init_z3 import WARMUP

    from dtrain.dist import DistEnv
    from dtrain.precision import PRECISIONS
    from dtrain.strategies import build_strategy
    from tests.conftest import compose

    cuda = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))
    for schedule, later in (("deepspeed", True), ("once", False)):
        cfg = compose(*FAST, "strategy=zero3", f"strategy.deepcompile_schedule={schedule}")
        s = build_strategy(cfg.strategy, PRECISIONS["bf16"], cuda)  # checks read the device type
        steps = s.slow_steps(31)
        assert "DeepCompile" in steps[31]
        assert (31 + WARMUP in steps) == later
        if later:
            assert "compiling the model again" in steps[31 + WARMUP]


def test_auto_resharding_builds_fsdp_as_decided(tmp_path, monkeypatch, capfd):
    """The decision reaches FSDP itself: the host's memory holds the tiny model's blocks kept
    gathered, so every block is sharded with reshard_after_forward=False."""
    import torch.distributed.fsdp as fsdp

    seen = []
    real = fsdp.fully_shard

    def recording(module, **kw):
        seen.append(kw["reshard_after_forward"])
        return real(module, **kw)

    monkeypatch.setattr(fsdp, "fully_shard", recording)
    train(tmp_path, *QUICK, "strategy=fsdp")
    assert seen and not any(seen), seen
    assert capfd.readouterr().err.count("strategy.reshard_after_forward=auto: false") == 1


def test_auto_options_are_decided_for_the_smallest_card_of_the_world(monkeypatch):
    """Each rank reads its own card; with cards of different sizes every rank must still
    decide the same (FSDP built differently on two ranks would hang its first collective)."""
    import dtrain.memory.search as search
    from dtrain import dist as ddist
    from dtrain.run.build import with_auto_options

    cfg = compose(*FAST, *QUICK, "strategy=fsdp", "trainer.micro_batch_size=auto")
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=256))
    env = ddist.DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    # This rank has plenty; the other has 64 MiB, too little to keep the blocks gathered at
    # the micro-batch that fills it.
    monkeypatch.setattr(search, "device_capacity", lambda device: 64 * 2**30)
    monkeypatch.setattr(ddist, "all_gather_object", lambda obj: [obj, 64 * 2**20])
    alone = search.resolve_auto_options(cfg, 2, env.device, capacity_bytes=64 * 2**30)[0]
    small = search.resolve_auto_options(cfg, 2, env.device, capacity_bytes=64 * 2**20)[0]
    assert alone.trainer.micro_batch_size != small.trainer.micro_batch_size
    decided = with_auto_options(cfg, env)
    assert decided.trainer.micro_batch_size == small.trainer.micro_batch_size
    assert decided.strategy.reshard_after_forward == small.strategy.reshard_after_forward


def test_out_of_memory_advice_plans_the_run_as_it_was_resolved(tmp_path, monkeypatch, capfd):
    """fsdp with its auto options and a vocab the tokenizer decides: the advice plans the run
    as built (not the raw config, whose vocab is unknown), and the auto decision is logged once."""
    import dtrain.run.oom as oom

    monkeypatch.setattr(oom, "device_gpu", lambda device: (H100, 80 * GiB, "NVIDIA H100 80GB"))
    monkeypatch.setenv("DTRAIN_FAULT", "train.step=oom#2")
    cfg = compose(*FAST, *QUICK, "strategy=fsdp", "trainer.micro_batch_size=auto")
    assert cfg.model.vocab_size is None
    planned = []
    real_advice = oom.advice_text
    monkeypatch.setattr(
        oom, "advice_text", lambda cfg, env: planned.append(cfg) or real_advice(cfg, env)
    )
    with pytest.raises(FaultError) as e:
        train(tmp_path, *QUICK, "strategy=fsdp", "trainer.micro_batch_size=auto")
    assert e.value.exit_code == 3
    advice = (tmp_path / "oom_advice.txt").read_text()
    assert advice.startswith("out of memory: ") and "per GPU" in advice, advice
    err = capfd.readouterr().err
    assert err.count("strategy.reshard_after_forward=auto:") == 1
    assert err.count("trainer.micro_batch_size=auto:") == 1
    # what the advice was given: the run as built, not the raw config
    (given,) = planned
    assert given.model.vocab_size is not None
    assert isinstance(given.trainer.micro_batch_size, int)
    assert isinstance(given.strategy.reshard_after_forward, bool)


def test_nothing_to_decide_needs_no_collective(monkeypatch):
    """No auto option to decide, no capacity gathered: ddp's reshard_after_forward=auto (it
    does not honour it) and fsdp's pinned one, each with a fixed micro-batch."""
    from dtrain import dist as ddist
    from dtrain.run.build import with_auto_options

    def no_collective(obj):
        raise AssertionError("a collective with nothing to decide")

    monkeypatch.setattr(ddist, "all_gather_object", no_collective)
    env = ddist.DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"))
    for extra in (["strategy=ddp"], ["strategy=fsdp", "strategy.reshard_after_forward=true"]):
        cfg = compose(*FAST, *extra)
        assert with_auto_options(cfg, env) is cfg
    with pytest.raises(AssertionError, match="nothing to decide"):  # fsdp's default: auto
        with_auto_options(compose(*FAST, "strategy=fsdp"), env)

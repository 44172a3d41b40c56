"""Strategy options: the YAML presets compose, bad values fail with one line (exit code 2)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dtrain.dist import DistEnv
from dtrain.errors import CheckpointError, ConfigError
from dtrain.precision import PRECISIONS
from dtrain.strategies import build_strategy
from tests.conftest import FAST, compose, launch, train


def env(world: int) -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=world, device=torch.device("cpu"))


def strategy(overrides: list[str], world: int = 2):
    cfg = compose(*FAST, *overrides)
    return build_strategy(cfg.strategy, PRECISIONS[cfg.precision.name], env(world))


@pytest.mark.parametrize("name", ["fsdp", "hsdp", "zero1", "zero2", "zero3", "deepspeed"])
def test_presets_compose_to_their_strategy(name):
    cfg = compose(*FAST, f"strategy={name}")
    assert cfg.strategy.name == name
    if name == "hsdp":
        assert cfg.strategy.replicate_degree == 2
    if name.startswith("zero"):
        assert cfg.strategy.stage == int(name[-1])


def test_zero_stage_comes_from_the_name_or_the_stage_key():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    assert strategy(["strategy=zero3"]).stage == 3
    s = strategy(["strategy=deepspeed", "strategy.stage=1"])
    assert (s.stage, s.name) == (1, "zero1")


BAD = [
    (["strategy=fsdp", "strategy.replicate_degree=3"], 2, "does not divide the world size 2"),
    (["strategy=ddp", "strategy.offload_optimizer=true"], 2, "does not apply to strategy=ddp"),
    (["strategy=fsdp", "strategy.offload_params=true"], 2, "does not apply to strategy=fsdp"),
    (["strategy=single", "strategy.cpu_offload=true"], 1, "does not apply to strategy=single"),
    # written as on the command line, not as Python prints a bool
    (["strategy=ddp", "strategy.reshard_after_forward=false"], 2, "reshard_after_forward=false "),
    (["strategy=zero2", "strategy.stage=3"], 2, "use strategy=zero3"),
    (["strategy=zero2", "strategy.offload_params=true"], 2, "needs ZeRO stage 3"),
    (["strategy=fsdp", "strategy.compile_scope=model"], 2, "does not apply to strategy=fsdp"),
    (["strategy=ddp", "strategy.deepcompile=true"], 2, "does not apply to strategy=ddp"),
    (["strategy=zero2", "strategy.deepcompile=true"], 2, "stages 1 and 3 only"),
    (["strategy=zero3", "strategy.deepcompile=true"], 2, "needs CUDA"),
    (["strategy=fsdp", "strategy.deepcompile_schedule=once"], 2, "does not apply to strategy=fsdp"),
    # on CPU zero3 runs without DeepCompile: a schedule for its passes would be ignored
    (["strategy=zero3", "strategy.deepcompile_schedule=once"], 2, "does not use them"),
    (["strategy=zero1", "strategy.deepcompile_schedule=resident"], 2, "does not use them"),
    (
        ["strategy=zero3", "strategy.deepcompile=true", "strategy.compile=false"],
        2,
        "cannot go with strategy.compile=false",
    ),
]


def test_resharding_pinned_true_is_no_request_of_a_strategy_that_does_not_shard():
    """true was the default before auto: sweeps that pin it over every strategy still run."""
    names = [("single", 1), ("ddp", 2)]
    if importlib.util.find_spec("deepspeed") is not None:
        names.append(("zero2", 2))
    for name, world in names:
        s = strategy([f"strategy={name}", "strategy.reshard_after_forward=true"], world)
        assert s.cfg.reshard_after_forward is True


@pytest.mark.parametrize("overrides,world,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_strategy_options_are_refused(overrides, world, message):
    if "zero" in overrides[0] and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    with pytest.raises(ConfigError, match=message):
        strategy(overrides, world)


@pytest.mark.parametrize(
    "args,message",
    [
        (["strategy=deepspeed", "strategy.stage=4"], "strategy.stage=4 is not a ZeRO stage"),
        (["strategy=fsdp", "strategy.activation_checkpointing=some"], "choose none, full"),
        (["strategy=ddp", "strategy.compile_scope=graph"], "choose model, blocks"),
    ],
)
def test_bad_values_exit_2_with_one_line(tmp_path, args, message):
    res = launch(*FAST, *args, f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_deepcompile_schedules_are_valid_deepspeed_schedules():
    """Every strategy.deepcompile_schedule is a choice of the config and a schedule DeepSpeed's
    own contract check accepts (each pass's requirements met within its step)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    import typing

    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile
    from deepspeed.compile.passes.contract import register_pass_contract, validate_schedule

    from dtrain.config import DeepCompileSchedule
    from dtrain.strategies.deepspeed import DEEPCOMPILE_SCHEDULES

    assert set(DEEPCOMPILE_SCHEDULES) == set(typing.get_args(DeepCompileSchedule))
    registry = {
        zero3_compile.NAME: zero3_compile.add_z3_gather_release,
        prefetch.NAME: prefetch.schedule_prefetch,
        selective_gather.NAME: selective_gather.selective_gather,
    }
    for mod in (zero3_compile, prefetch, selective_gather):  # as the engine registers them
        register_pass_contract(mod.NAME, mod.CONTRACT)
    for name, schedule in DEEPCOMPILE_SCHEDULES.items():
        if schedule is None:
            continue
        validate_schedule(schedule, registry)
        assert all(p in registry for _, passes in schedule for p in passes), name
    with pytest.raises(Exception, match="prefetch"):  # the check does catch a broken one
        validate_schedule([(0, ["prefetch"])], registry)


def test_a_fixed_deepcompile_schedule_is_refused_with_offload():
    """With offload DeepSpeed adds offload passes to its own schedule; a fixed one drops them."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    import torch

    from dtrain.dist import DistEnv

    cuda = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))
    cfg = compose(
        *FAST,
        "strategy=zero3",
        "strategy.deepcompile=true",
        "strategy.offload_optimizer=true",
        "strategy.deepcompile_schedule=once",
    )
    with pytest.raises(ConfigError, match="no offload"):
        build_strategy(cfg.strategy, PRECISIONS["bf16"], cuda)
    cfg.strategy.deepcompile_schedule = "deepspeed"  # DeepSpeed's own: allowed
    assert build_strategy(cfg.strategy, PRECISIONS["bf16"], cuda).deepcompile


def test_the_deepcompile_schedule_reaches_engine_compile(monkeypatch):
    """zero3 with DeepCompile hands the chosen schedule to DeepSpeed's engine.compile."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    import torch

    from dtrain.dist import DistEnv
    from dtrain.strategies.deepspeed import DEEPCOMPILE_SCHEDULES

    cuda = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))
    cfg = compose(
        *FAST, "strategy=zero3", "precision=bf16", "strategy.deepcompile_schedule=resident"
    )
    s = build_strategy(cfg.strategy, PRECISIONS["bf16"], cuda)  # the checks read the device type
    assert s.deepcompile
    seen = []

    class Engine:
        def compile(self, **kwargs):
            seen.append(kwargs)

    s.engine = Engine()
    s._compile_engine()
    assert seen == [{"schedule": DEEPCOMPILE_SCHEDULES["resident"]}]


def test_deepcompile_goes_into_deepspeeds_config():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    cfg = compose(*FAST, "strategy=zero3")
    s = build_strategy(cfg.strategy, PRECISIONS["bf16"], env(2))
    assert "compile" not in s.ds_config(cfg.model) and not s.compile_enabled
    s.cfg.deepcompile = True  # what strategy.deepcompile=true gives on CUDA
    assert s.ds_config(cfg.model)["compile"] == {"deepcompile": True} and s.compile_enabled


@pytest.mark.parametrize(
    "name,scope,whole,blocks",
    [
        ("single", None, True, False),
        ("single", "blocks", False, True),
        ("ddp", None, True, False),
        ("ddp", "blocks", False, True),
    ],
)
def test_compile_scope_decides_what_is_compiled(monkeypatch, name, scope, whole, blocks):
    """`model` compiles one graph (ddp: the wrapped model, so DDPOptimizer sees the buckets);
    `blocks` compiles each block in place and the loss apart."""
    import torch.distributed as dist

    from dtrain.model import lm_loss

    compiled = []

    def fake_compile(obj=None, **kw):
        compiled.append(obj)
        return obj

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(self))
    overrides = [f"strategy={name}", "strategy.compile=true"]
    if scope:
        overrides.append(f"strategy.compile_scope={scope}")
    cfg = compose(*FAST, *overrides)
    s = build_strategy(cfg.strategy, PRECISIONS["fp32"], env(1))
    if name == "ddp":
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(
            "dtrain.strategies.ddp.DDP", lambda module, **kw: compiled.append("ddp") or module
        )
    cfg.model.vocab_size = 64
    s.setup(cfg.model, cfg.optim, seed=0)
    layers = list(s.module.layers.values())
    assert (s.module in compiled) == whole
    assert all(b in compiled for b in layers) == blocks
    assert (lm_loss in compiled) == blocks
    if name == "ddp" and whole:  # wrapped first, then compiled
        assert [c for c in compiled if c is s.module or c == "ddp"] == ["ddp", s.module]


def test_without_deepspeed_zero_says_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a)
    )
    with pytest.raises(ConfigError) as e:
        strategy(["strategy=zero2"])
    assert str(e.value) == "strategy=zero2 needs DeepSpeed: pip install 'dtrain[deepspeed]'"
    # A run says so before it builds (and maybe downloads or tokenizes) its data: the data
    # named here does not exist, and it is not what the run stops on.
    with pytest.raises(ConfigError, match="needs DeepSpeed"):
        train(tmp_path, "strategy=zero2", "data=local", f"data.files={tmp_path}/none.txt")


def test_a_native_deepspeed_checkpoint_is_refused_with_what_to_run(tmp_path):
    from dtrain.checkpoint import CheckpointManager

    (tmp_path / "global_step10").mkdir()
    (tmp_path / "latest").write_text("global_step10")
    with pytest.raises(CheckpointError, match="zero_to_fp32.py"):
        CheckpointManager.read_manifest(tmp_path)


@pytest.mark.parametrize("name", ["ddp", "single", "fsdp", "hsdp"])
def test_ddp_bucket_default_is_one_number(name):
    """The presets' bucket_cap_mb is config.DDP_BUCKET_MB (what code building StrategyConfig
    and the memory plan use), not a second copy that could drift."""
    from dtrain.config import DDP_BUCKET_MB, StrategyConfig
    from dtrain.memory import MemorySetup

    assert compose(*FAST, f"strategy={name}").strategy.bucket_cap_mb == DDP_BUCKET_MB
    assert StrategyConfig().bucket_cap_mb == DDP_BUCKET_MB
    assert MemorySetup("ddp", PRECISIONS["bf16"]).ddp_bucket_mb == DDP_BUCKET_MB

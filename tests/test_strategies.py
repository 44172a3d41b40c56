"""FSDP, HSDP and DeepSpeed ZeRO-1/2/3 under torchrun (gloo, CPU): parity with single,
exact model-state accounting, bit-exact resume and checkpoints that move between strategies.

Runs are shared between assertions: each configuration trains once (20 steps, a checkpoint at
step 10) in a module-scoped folder, and every test reads what it needs from it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import FAST, launch, read_jsonl, train, train_losses

STEPS = [
    *FAST,
    "trainer.max_steps=20",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint.every_n_steps=10",
    "checkpoint.keep_last=0",
]
# The same global batch of 8 sequences on 1, 2 and 4 ranks.
MICRO = {1: "trainer.micro_batch_size=8", 2: "trainer.micro_batch_size=4"}
MICRO[4] = "trainer.micro_batch_size=2"
TIED = "model.tie_embeddings=true"

# name -> (world size, overrides)
RUNS = {
    "single": (1, []),
    "single_tied": (1, [TIED]),
    "ddp": (2, ["strategy=ddp"]),
    "fsdp": (2, ["strategy=fsdp"]),
    # The other FSDP options in one run: no reshard, tied embeddings, full activation
    # checkpointing (a wrapper around each block), parameters and optimizer on the host.
    "fsdp_options": (
        2,
        [
            "strategy=fsdp",
            "strategy.reshard_after_forward=false",
            "strategy.activation_checkpointing=full",
            "strategy.cpu_offload=true",
            TIED,
        ],
    ),
    "hsdp": (4, ["strategy=hsdp", "strategy.replicate_degree=2"]),
    "zero1": (2, ["strategy=zero1"]),
    "zero2": (2, ["strategy=zero2"]),
    "zero3": (2, ["strategy=zero3"]),
}

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)
# fp32 on CPU: the strategies sum the same gradients in another order (reduce-scatter vs one
# backward over the whole batch), so losses agree to rounding, not bit for bit. 1e-5 relative
# is ~100x the float32 epsilon: a wrong averaging, clipping or weight would miss it by far.
RTOL = 1e-5


def _ok(res) -> None:
    assert res.returncode == 0, res.stderr[-4000:]


class Runs:
    """Each configuration trained at most once per test module, on first use."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[str, Path] = {}
        self.stderr: dict[str, str] = {}  # of the torchrun runs

    def get(self, name: str, *extra: str, like: str | None = None) -> Path:
        if name not in self.done:
            nproc, overrides = RUNS[like or name]
            run_dir = self.root / name
            args = [*STEPS, MICRO[nproc], *overrides, *extra, f"hydra.run.dir={run_dir}"]
            if nproc == 1:
                train(run_dir, *args)
            else:
                res = launch(*args, nproc=nproc)
                _ok(res)
                self.stderr[name] = res.stderr
            self.done[name] = run_dir
        return self.done[name]

    def ckpt(self, name: str, step: int = 10) -> Path:
        return self.get(name) / "checkpoints" / f"step_{step:07d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("strategies"))


def assert_close(a: dict, b: dict, steps, rtol: float = RTOL) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= rtol * abs(a[s]), (s, a[s], b[s])


def memory(run_dir: Path) -> list[dict]:
    """memory_per_rank of the last logged step."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "memory_per_rank" in r][-1][
        "memory_per_rank"
    ]


def assert_zero_picture(run_dir: Path, full: dict, expect: dict) -> None:
    """Every rank holds `expect[kind]` (1 or 1/2) of the single-device bytes of each kind,
    within 3% (padding of shards to equal sizes, AdamW's per-tensor step counters)."""
    for rank, mem in enumerate(memory(run_dir)):
        for kind, share in expect.items():
            want = share * full[kind]
            got = mem[kind]
            assert abs(got - want) <= 0.03 * want, (rank, kind, got, want, share)


# --- parity --------------------------------------------------------------------------------


def test_fsdp_matches_single_and_shards_all_three(runs):
    single, fsdp = runs.get("single"), runs.get("fsdp")
    a, b = train_losses(single), train_losses(fsdp)
    assert sorted(b) == list(range(1, 21))
    assert_close(a, b, range(1, 21))
    full = memory(single)[0]
    assert full["master_bytes"] == 0 and full["params_bytes"] > 0
    half = {"params_bytes": 0.5, "grads_bytes": 0.5, "optim_bytes": 0.5}
    assert_zero_picture(fsdp, full, half)


def test_fsdp_blocks_return_no_view_tensors(runs):
    # A block returned its kv cache (views of k, v) even in training, and FSDP2 warned on
    # every run that an in-place op on such a view would skip its pre-backward hook.
    runs.get("fsdp")
    assert "returned a view tensor" not in runs.stderr["fsdp"]


def test_fsdp_checkpoint_moves_to_single(runs, tmp_path):
    # FSDP(2 ranks) saved at step 10; one process resumes it and trains like single did.
    moved = tmp_path / "single_from_fsdp"
    train(moved, *STEPS, MICRO[1], f"resume={runs.ckpt('fsdp')}")
    assert_close(train_losses(runs.get("single")), train_losses(moved), range(11, 21))


@pytest.mark.slow
def test_single_checkpoint_moves_to_fsdp_and_fsdp_resumes_bit_exactly(runs, tmp_path):
    args = [*STEPS, MICRO[2], "strategy=fsdp"]
    _ok(launch(*args, f"resume={runs.ckpt('single')}", f"hydra.run.dir={tmp_path}/a", nproc=2))
    assert_close(train_losses(runs.get("single")), train_losses(tmp_path / "a"), range(11, 21))
    # Same strategy, same world size: stop at 10, then resume=auto continues bit for bit.
    run = tmp_path / "b"
    _ok(launch(*args, "trainer.stop_at_step=10", f"hydra.run.dir={run}", nproc=2))
    _ok(launch(*args, f"hydra.run.dir={run}", nproc=2))
    straight, resumed = train_losses(runs.get("fsdp")), train_losses(run)
    assert sorted(resumed) == list(range(1, 21))
    for s in range(11, 21):
        assert straight[s] == resumed[s], (s, straight[s], resumed[s])


@pytest.mark.slow
def test_fsdp_options_match_single_and_their_checkpoint_moves_to_single(runs, tmp_path):
    single = runs.get("single_tied")
    assert_close(train_losses(single), train_losses(runs.get("fsdp_options")), range(1, 21))
    # The checkpoint wrapper's name prefix does not reach the file: single loads it.
    moved = tmp_path / "single_from_fsdp_options"
    train(moved, *STEPS, MICRO[1], TIED, f"resume={runs.ckpt('fsdp_options')}")
    assert_close(train_losses(single), train_losses(moved), range(11, 21))


@pytest.mark.slow
def test_hsdp_2x2_matches_single(runs):
    assert_close(train_losses(runs.get("single")), train_losses(runs.get("hsdp")), range(1, 21))
    # 2 replicas x 2 shards: each rank holds half (its shard group has 2 ranks).
    full = memory(runs.get("single"))[0]
    half = {"params_bytes": 0.5, "grads_bytes": 0.5, "optim_bytes": 0.5}
    assert_zero_picture(runs.get("hsdp"), full, half)


@pytest.mark.slow
def test_ddp_checkpoint_moves_to_fsdp(runs, tmp_path):
    ddp = runs.get("ddp")
    full = memory(runs.get("single"))[0]
    assert_zero_picture(ddp, full, {"params_bytes": 1, "grads_bytes": 1, "optim_bytes": 1})
    run = tmp_path / "fsdp_from_ddp"
    _ok(
        launch(
            *STEPS,
            MICRO[2],
            "strategy=fsdp",
            f"resume={runs.ckpt('ddp')}",
            f"hydra.run.dir={run}",
            nproc=2,
        )
    )
    assert_close(train_losses(ddp), train_losses(run), range(11, 21))


# --- DeepSpeed ZeRO ---------------------------------------------------------------------------

# What each stage shards (2 ranks: a sharded kind is half per rank). The fp32 master copy ZeRO
# keeps beside the parameters is always sharded like the optimizer states.
ZERO_PICTURE = {
    "zero1": {"params_bytes": 1, "grads_bytes": 1, "optim_bytes": 0.5},
    "zero2": {"params_bytes": 1, "grads_bytes": 0.5, "optim_bytes": 0.5},
    "zero3": {"params_bytes": 0.5, "grads_bytes": 0.5, "optim_bytes": 0.5},
}


@needs_deepspeed
@pytest.mark.parametrize(
    "stage",
    [
        "zero2",
        pytest.param("zero1", marks=pytest.mark.slow),
        pytest.param("zero3", marks=pytest.mark.slow),
    ],
)
def test_zero_matches_single_and_shows_the_zero_picture(runs, stage):
    single, run = runs.get("single"), runs.get(stage)
    assert_close(train_losses(single), train_losses(run), range(1, 21))
    full = memory(single)[0]
    # The master copy is half of the fp32 parameters' bytes on each of the 2 ranks.
    full = {**full, "master_bytes": full["params_bytes"]}
    assert_zero_picture(run, full, {**ZERO_PICTURE[stage], "master_bytes": 0.5})


@needs_deepspeed
@pytest.mark.slow
def test_zero_checkpoint_moves_to_single_and_resumes_bit_exactly(runs, tmp_path):
    moved = tmp_path / "single_from_zero2"
    train(moved, *STEPS, MICRO[1], f"resume={runs.ckpt('zero2')}")
    assert_close(train_losses(runs.get("single")), train_losses(moved), range(11, 21))
    assert_resumes_bit_exactly(runs, "zero2", tmp_path)


def assert_resumes_bit_exactly(runs, name: str, tmp_path) -> None:
    """RUNS[name] (2 ranks) resumed from its own step-10 checkpoint: steps 11-20 bitwise as
    the straight run's."""
    run = tmp_path / f"{name}_resumed"
    _ok(
        launch(
            *STEPS,
            MICRO[2],
            *RUNS[name][1],
            f"resume={runs.ckpt(name)}",
            f"hydra.run.dir={run}",
            nproc=2,
        )
    )
    straight, resumed = train_losses(runs.get(name)), train_losses(run)
    for s in range(11, 21):
        assert straight[s] == resumed[s], (s, straight[s], resumed[s])


@needs_deepspeed
@pytest.mark.slow
def test_zero3_resumes_bit_exactly(runs, tmp_path):
    """ZeRO-3 binds its optimizer's partitions only while stepping: a resumed run must still
    create the moments to load into (found on 2 H200s by tests/gpu, a KeyError before)."""
    assert_resumes_bit_exactly(runs, "zero3", tmp_path)


@needs_deepspeed
@pytest.mark.slow
def test_zero3_checkpoint_moves_to_fsdp(runs, tmp_path):
    run = tmp_path / "fsdp_from_zero3"
    _ok(
        launch(
            *STEPS,
            MICRO[2],
            "strategy=fsdp",
            f"resume={runs.ckpt('zero3')}",
            f"hydra.run.dir={run}",
            nproc=2,
        )
    )
    assert_close(train_losses(runs.get("zero3")), train_losses(run), range(11, 21))


@needs_deepspeed
def test_zero_runs_as_one_process_without_torchrun(tmp_path):
    """`python launch/train.py strategy=zero2`: a group of one, with the LOCAL_RANK that
    DeepSpeed's engine asserts a launcher set (it crashed without it)."""
    res = launch(*FAST, "strategy=zero2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    _ok(res)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1] == 2

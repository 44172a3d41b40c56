"""Tensor, sequence and context parallelism under torchrun (gloo, CPU): the same losses as
strategy=single over 20 steps, bit-exact resume, and checkpoints moving between layouts.

Tolerance: 1e-5 relative (fp32). The math is the same but not its order: tensor parallelism
sums each row-split matmul over ranks, context parallelism takes one softmax over gathered keys
in another order, and FSDP averages gradients over its ranks.
"""

import pytest

from tests.conftest import FAST, launch, train, train_losses

STEPS = ["trainer.max_steps=20", "trainer.log_every=1", "trainer.eval_every=0"]
RTOL = 1e-5


def _ok(res):
    assert res.returncode == 0, res.stderr[-3000:]


def assert_close(a: dict, b: dict, steps) -> None:
    for step in steps:
        assert abs(a[step] - b[step]) <= RTOL * abs(a[step]), (step, a[step], b[step])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """strategy=single, micro-batch 4 (one data-parallel replica) and 8 (two)."""
    tmp = tmp_path_factory.mktemp("single")
    for micro in (4, 8):
        train(tmp / f"micro{micro}", *STEPS, f"trainer.micro_batch_size={micro}")
    return {4: train_losses(tmp / "micro4"), 8: train_losses(tmp / "micro8")}


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.cp=2"])
def test_tp2_and_cp2_match_single(single, tmp_path, layout):
    _ok(launch(*FAST, *STEPS, "strategy=fsdp", layout, f"hydra.run.dir={tmp_path}", nproc=2))
    losses = train_losses(tmp_path)
    assert sorted(losses) == list(range(1, 21))
    assert_close(single[4], losses, range(1, 21))


@pytest.mark.slow
def test_fsdp2_x_tp2_matches_single_and_resumes_from_fsdp4(single, tmp_path):
    # Two replicas of micro-batch 4 against single's micro-batch 8, the logits gathered whole
    # (the other tests split the loss by vocabulary); then a checkpoint of fsdp on 4 ranks
    # (micro-batch 2: the same global batch) resumed as fsdp 2 x tp 2.
    args = [*FAST, *STEPS, "strategy=fsdp"]
    gathered = ["parallel.tp=2", "parallel.loss_parallel=false"]
    _ok(launch(*args, *gathered, f"hydra.run.dir={tmp_path}/fsdp2tp2", nproc=4))
    assert_close(single[8], train_losses(tmp_path / "fsdp2tp2"), range(1, 21))
    micro2 = ["trainer.micro_batch_size=2", "trainer.stop_at_step=10"]
    _ok(launch(*args, *micro2, f"hydra.run.dir={tmp_path}/fsdp4", nproc=4))
    ckpt = tmp_path / "fsdp4" / "checkpoints" / "step_0000010"
    moved = tmp_path / "moved"
    _ok(launch(*args, "parallel.tp=2", f"resume={ckpt}", f"hydra.run.dir={moved}", nproc=4))
    assert_close(single[8], train_losses(moved), range(11, 21))


@pytest.mark.slow
def test_tp2_resumes_bit_exactly_and_moves_to_single(single, tmp_path):
    args = [*FAST, *STEPS, "strategy=fsdp", "parallel.tp=2"]
    _ok(launch(*args, f"hydra.run.dir={tmp_path}/straight", nproc=2))
    _ok(launch(*args, "trainer.stop_at_step=10", f"hydra.run.dir={tmp_path}/resumed", nproc=2))
    _ok(launch(*args, f"hydra.run.dir={tmp_path}/resumed", nproc=2))
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert [resumed[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]
    ckpt = tmp_path / "resumed" / "checkpoints" / "step_0000010"
    train(tmp_path / "single", *STEPS, f"resume={ckpt}")
    assert_close(single[4], train_losses(tmp_path / "single"), range(11, 21))


@pytest.mark.slow
def test_tp2_x_cp2_with_tied_embeddings_matches_single(tmp_path):
    tied = [*FAST, *STEPS, "model.tie_embeddings=true"]
    train(tmp_path / "single", *tied)
    _ok(
        launch(
            *tied,
            "strategy=fsdp",
            "parallel.tp=2",
            "parallel.cp=2",
            f"hydra.run.dir={tmp_path}/tp2cp2",
            nproc=4,
        )
    )
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "tp2cp2")
    assert_close(a, b, range(1, 21))

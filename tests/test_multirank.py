"""DDP under torchrun (2 ranks, gloo, CPU): parity with single and bit-exact resume."""

import pytest

from tests.conftest import FAST, launch, train_losses

STEPS = ["trainer.max_steps=20", "trainer.log_every=1", "trainer.eval_every=0"]


def _ok(res):
    assert res.returncode == 0, res.stderr[-3000:]


def test_ddp_matches_single_with_the_same_global_batch(tmp_path):
    _ok(launch(*FAST, *STEPS, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/single"))
    _ok(
        launch(
            *FAST,
            *STEPS,
            "strategy=ddp",
            "trainer.micro_batch_size=4",
            f"hydra.run.dir={tmp_path}/ddp",
            nproc=2,
        )
    )
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


def test_ddp_grad_accumulation_matches_single(tmp_path):
    # 2 ranks x micro 2 x accum 2 == single micro 8: no_sync on the first micro-step.
    steps = ["trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=0"]
    _ok(launch(*FAST, *steps, "trainer.micro_batch_size=8", f"hydra.run.dir={tmp_path}/single"))
    _ok(
        launch(
            *FAST,
            *steps,
            "strategy=ddp",
            "trainer.micro_batch_size=2",
            "trainer.global_batch_size=8",
            f"hydra.run.dir={tmp_path}/ddp",
            nproc=2,
        )
    )
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


@pytest.mark.slow
def test_ddp_resume_is_bit_exact(tmp_path):
    args = [
        *FAST,
        "strategy=ddp",
        "trainer.max_steps=10",
        "trainer.log_every=1",
        "trainer.eval_every=0",
    ]
    _ok(launch(*args, f"hydra.run.dir={tmp_path}/straight", nproc=2))
    _ok(launch(*args, "trainer.stop_at_step=5", f"hydra.run.dir={tmp_path}/resumed", nproc=2))
    _ok(launch(*args, f"hydra.run.dir={tmp_path}/resumed", nproc=2))
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(b) == list(range(1, 11))
    for step in range(6, 11):
        assert a[step] == b[step], (step, a[step], b[step])


def test_checkpoint_moves_from_ddp_to_single(tmp_path):
    # DDP(2 ranks, micro 4) saves; single (micro 8, same global batch) resumes and matches.
    args = [*FAST, "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=0"]
    _ok(
        launch(
            *args,
            "strategy=ddp",
            "trainer.micro_batch_size=4",
            f"hydra.run.dir={tmp_path}/ddp",
            nproc=2,
        )
    )
    _ok(
        launch(
            *args,
            "strategy=ddp",
            "trainer.micro_batch_size=4",
            "trainer.stop_at_step=4",
            f"hydra.run.dir={tmp_path}/moved",
            nproc=2,
        )
    )
    _ok(
        launch(
            *args,
            "trainer.micro_batch_size=8",
            f"resume={tmp_path}/moved/checkpoints/step_0000004",
            f"hydra.run.dir={tmp_path}/single",
        )
    )
    a, b = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "single")
    for step in range(5, 9):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])

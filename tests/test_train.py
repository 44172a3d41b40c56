"""The loop end to end on CPU: metrics, TensorBoard, checkpoints, bit-exact resume, signals."""

import io
import logging
import os
import signal
import sys
import threading

import pytest

from tests.conftest import read_jsonl, train, train_losses


def test_metrics_jsonl_has_the_documented_keys(tmp_path):
    out = train(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=2")
    assert out["step"] == 4
    recs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        for key in (
            "step",
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "tokens_per_s_per_gpu",
            "mfu",
            "memory_per_rank",
        ):
            assert key in r, key
        (mem,) = r["memory_per_rank"]
        for key in ("params_bytes", "grads_bytes", "optim_bytes", "rss_bytes"):
            assert mem[key] > 0, key
        n = out["n_params"]
        assert mem["params_bytes"] == 4 * n
        assert mem["grads_bytes"] == 4 * n
        # AdamW: two fp32 moments per parameter plus one step counter per parameter tensor.
        assert 8 * n <= mem["optim_bytes"] <= 8 * n + 8 * 64
    evals = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]


def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=2")
    # One TensorBoard run per run dir, named by its configuration.
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "single-fp32-w1-tiny"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "eval/loss",
        "eval/ppl",
        "perf/tokens_per_s",
        "perf/tokens_per_s_per_gpu",
        "memory/rank0/params_gib",
        "memory/rank0/grads_gib",
        "memory/rank0/optim_gib",
        "memory/rank0/rss_gib",
        "checkpoint/stall_s",  # the final save: the time the loop was blocked by it
        "checkpoint/save_s",
    ):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in acc.Scalars("checkpoint/stall_s")] == [4]
    assert "perf/mfu" not in tags  # a CPU has no real peak to divide by


def test_cpu_mfu_is_na_unless_a_peak_is_given(tmp_path, capsys):
    args = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=0"]
    train(tmp_path / "cpu", *args)
    recs = [r for r in read_jsonl(tmp_path / "cpu/metrics.jsonl") if "loss" in r]
    assert recs and all(r["mfu"] is None for r in recs)
    err = capsys.readouterr().err
    assert err.count("mfu n/a") == 1  # said once, not on every step line
    assert "per GPU" not in err and "cuda" not in err.lower()
    first = next(line for line in err.splitlines() if " dtrain] " in line)
    assert len(first) < 200, first
    # The CPU memory comparison says what it compared.
    assert "memory prediction vs measured (model state only, CPU): +0.0%" in err
    train(tmp_path / "peak", *args, "metrics.peak_tflops=1")
    recs = [r for r in read_jsonl(tmp_path / "peak/metrics.jsonl") if "loss" in r]
    assert all(isinstance(r["mfu"], float) and r["mfu"] > 0 for r in recs)
    assert "mfu n/a" not in capsys.readouterr().err


def test_resume_is_bit_exact(tmp_path):
    args = ["trainer.max_steps=12", "trainer.log_every=1", "trainer.eval_every=0"]
    train(tmp_path / "straight", *args)
    train(tmp_path / "stopped", *args, "trainer.stop_at_step=6")
    assert (tmp_path / "stopped/checkpoints/step_0000006/COMPLETE").exists()
    out = train(tmp_path / "stopped", *args)  # resume=auto picks up step 6
    assert out["step"] == 12
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "stopped")
    assert sorted(b) == list(range(1, 13))  # records after the checkpoint were replaced
    for step in range(7, 13):
        assert a[step] == b[step], (step, a[step], b[step])


def test_checkpoint_every_n_and_keep_last(tmp_path):
    train(
        tmp_path,
        "trainer.max_steps=8",
        "trainer.eval_every=0",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=2",
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_0000006", "step_0000008"]


def test_partial_checkpoint_is_ignored_by_resume(tmp_path):
    args = ["trainer.max_steps=6", "trainer.eval_every=0", "trainer.log_every=1"]
    train(tmp_path, *args, "trainer.stop_at_step=3")
    # A crash mid-save leaves a .partial folder and a folder without its marker.
    (tmp_path / "checkpoints/step_0000005.partial").mkdir()
    broken = tmp_path / "checkpoints/step_0000004"
    broken.mkdir()
    (broken / "manifest.json").write_text("{}")
    out = train(tmp_path, *args)
    assert out["losses"][0][0] == 4  # resumed at step 3, not 4 or 5


def test_sigterm_saves_and_stops(tmp_path):
    args = ["trainer.max_steps=500", "trainer.eval_every=0", "trainer.log_every=1"]
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        out = train(tmp_path, *args)
    finally:
        timer.cancel()
    assert out["stopped_by_signal"]
    assert 0 < out["step"] < 500
    assert (tmp_path / f"checkpoints/step_{out['step']:07d}/COMPLETE").exists()
    # Handlers are restored once the run ends.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_global_batch_size_sets_accumulation(tmp_path):
    from dtrain.config import resolve_grad_accum
    from dtrain.errors import ConfigError
    from tests.conftest import compose

    cfg = compose("trainer.micro_batch_size=4", "trainer.global_batch_size=16")
    assert resolve_grad_accum(cfg.trainer, 2) == 2
    with pytest.raises(ConfigError, match="cannot be served"):
        resolve_grad_accum(cfg.trainer, 3)


def test_max_steps_below_warmup_warns_and_trains(tmp_path, capsys):
    # setup_logging's basicConfig(force=True) drops caplog's handler: read stderr instead.
    out = train(tmp_path, "trainer.max_steps=3", "optim.warmup_steps=10", "trainer.eval_every=0")
    assert out["step"] == 3  # a warning, not an error
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "warmup_steps" in x]
    assert "trainer.max_steps=3 is below optim.warmup_steps=10" in line
    assert "never reaches its peak" in line
    train(tmp_path / "ok", "trainer.max_steps=3", "optim.warmup_steps=3", "trainer.eval_every=0")
    assert "warmup_steps" not in capsys.readouterr().err


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_postfix_and_log_lines_above_it(capsys):
    from dtrain.train import Progress, bar_postfix

    info = {"loss": 2.5, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_s": 1234.4, "mfu": None}
    assert bar_postfix(info) == {"loss": "2.5000", "lr": "3.00e-04", "tok/s": "1234"}
    assert bar_postfix({**info, "mfu": 0.4})["mfu"] == "40.0%"

    stream = _FakeTTY()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [logging.StreamHandler(sys.stderr)]  # as setup_logging's basicConfig
    try:
        progress = Progress(True, 0, 4, stream=stream)
        assert progress.bar is not None
        progress.update(1, info)
        logging.getLogger("dtrain").warning("checkpoint saved")
        # The line went through tqdm.write (its own line), not through the original handler.
        assert type(root.handlers[0]).__name__ == "_TqdmLoggingHandler"
        assert "checkpoint saved\n" in capsys.readouterr().err
        assert "lr=3.00e-04" in str(progress.bar)
        progress.close()
        assert type(root.handlers[0]) is logging.StreamHandler  # restored after the bar
    finally:
        root.handlers = saved

"""The bad-input catalogue: malformed invocations of launch/train.py, each answered by one line
that names the problem (and the valid choices), exit code 2, no traceback, and no existing
file changed. Complements tests/test_cli.py (whose cases are not repeated here).

Each case runs launch/train.py's own path in-process (check_overrides, then dtrain.train.run)
because a subprocess costs seconds of start-up; a representative subset also runs as a real
subprocess to pin the exit code, the single stderr line and the untouched files.
"""

import json
import os
import shutil

import pytest
import torch

from dtrain.errors import UserError
from dtrain.run.preflight import check_overrides
from dtrain.train import run
from tests.conftest import FAST, launch, train
from tests.faults.helpers import one_error_line, snapshot

CATALOGUE = [
    # unknown groups and keys
    (["optim=sgd"], "unknown optim 'sgd'; valid choices: adamw"),
    (["checkpoint=sometimes"], "unknown checkpoint 'sometimes'; valid choices: default, frequent"),
    (["model.n_layers=2"], "unknown config key 'model.n_layers'"),
    (["checkpoint.every=5"], "unknown config key 'checkpoint.every'"),
    (["foo=1"], "unknown config key 'foo'"),
    (["debug.kill_at=3"], "unknown config key 'debug.kill_at'"),
    (["+trainer.bogus=1"], "unknown config key 'trainer.bogus'; valid keys under trainer:"),
    (["+extra=1"], "unknown config key 'extra'; valid keys under the top level:"),
    # wrong types
    (["trainer.seq_len=1.5"], "trainer.seq_len must be an integer, got 1.5"),
    (["trainer.progress_bar=maybe"], "trainer.progress_bar must be true/false, got 'maybe'"),
    (
        ["checkpoint.async_save=maybe"],  # optional: null is one of the valid choices
        "checkpoint.async_save must be true/false or null, got 'maybe'",
    ),
    (["optim.lr=fast"], "optim.lr must be a number, got 'fast'"),
    (["model.n_layer=[1,2]"], "model.n_layer must be an integer, got [1, 2]"),
    (["trainer.stop_signals=SIGTERM"], "trainer.stop_signals must be a list, got 'SIGTERM'"),
    (["seed=abc"], "seed must be an integer, got 'abc'"),
    (["checkpoint.keep_last=true"], "checkpoint.keep_last must be an integer, got true"),
    (["trainer.collective_timeout_s=soon"], "trainer.collective_timeout_s must be a number"),
    # impossible sizes and values
    (["trainer.seq_len=0"], "trainer.seq_len must be > 0, got 0"),
    (["model.d_model=0"], "model.d_model must be > 0, got 0"),
    (["model.n_kv_head=3"], "model.n_head=4 must be divisible by n_kv_head=3"),
    (["model.d_model=36"], "model head dim 9 must be even for RoPE"),
    (["model.max_seq_len=32"], "trainer.seq_len=64 exceeds model.max_seq_len=32"),
    (["trainer.eval_steps=-1"], "trainer.eval_steps must be >= 0, got -1"),
    (["trainer.log_every=0"], "trainer.log_every must be > 0, got 0"),
    (["trainer.stop_at_step=0"], "trainer.stop_at_step must be > 0, got 0"),
    (["trainer.max_steps=-1"], "trainer.max_steps must be > 0, got -1"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size must be > 0, got 0"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip must be >= 0, got -1.0"),
    (["optim.lr=0"], "optim.lr must be > 0, got 0.0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0, got -1"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio must be in [0, 1], got 2.0"),
    (["optim.beta1=-0.1"], "optim.beta1 must be in [0, 1), got -0.1"),
    # non-finite numbers (once a NaN run saved a "last good state" of NaN tensors)
    (["optim.lr=nan"], "optim.lr must be a finite number > 0, got nan"),
    (["optim.lr=inf"], "optim.lr must be a finite number > 0, got inf"),
    (["optim.weight_decay=nan"], "optim.weight_decay must be a finite number >= 0, got nan"),
    (["data.eval_fraction=1.5"], "data.eval_fraction must be in (0, 1), got 1.5"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last must be >= 0, got -1"),
    (["checkpoint.every_n_steps=-5"], "checkpoint.every_n_steps must be >= 0, got -5"),
    # fault-handling keys
    (["trainer.collective_timeout_s=0"], "trainer.collective_timeout_s must be > 0"),
    (
        ["trainer.on_nonfinite=ignore"],
        "trainer.on_nonfinite='ignore' is not valid; choose skip or stop",
    ),
    (
        ["checkpoint.on_error=retry"],
        "checkpoint.on_error='retry' is not valid; choose stop or continue",
    ),
    (
        ["trainer.stop_signals=[SIGFOO]"],
        "'SIGFOO' is not a signal this process can catch; valid names:",
    ),
    (["trainer.stop_signals=[SIGKILL]"], "'SIGKILL' is not a signal this process can catch"),
    (["debug.inject_nonfinite_at_step=0"], "debug.inject_nonfinite_at_step must be > 0, got 0"),
    # data and tokenizer
    (["data=synthetic", "data.vocab_size=1"], "data.vocab_size must be >= 2 for synthetic data"),
    (["data.tokenizer=gpt2"], "data.tokenizer 'gpt2' not found: not byte or bpe"),
    (["data=local", "data.files=/no/such/*.txt"], "matches no file"),
    (["data.max_bytes=-5"], "data.max_bytes must be > 0, got -5"),
    # optimizer and device, checked when built
    (["optim.name=sgd"], "unknown optimizer 'sgd'; valid choices: adamw"),
    pytest.param(
        ["trainer.device=cuda"],
        "trainer.device=cuda but no CUDA device is visible",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
    ),
    # checkpoints: missing, incomplete, corrupt, of another model
    (["resume={tmp}/a_file"], "is a file; a checkpoint is a checkpoints/step_NNNNNNN folder"),
    (["resume={partial}"], "is incomplete (no COMPLETE marker)"),
    (["resume={corrupt}"], "__0_0.distcp is corrupt (sha256 differs from manifest.json)"),
    (["resume={badmanifest}"], "manifest.json was edited or is corrupt (its sha256 differs"),
    (["resume={steplie}"], "manifest.json was edited or is corrupt (its sha256 differs"),
    (["resume={nomanifest}"], "manifest.json is missing (its COMPLETE marker is there"),
    (["resume={renamed}"], "manifest.json says step 2 but the folder is step_0000003"),
    (
        ["resume={newer}/checkpoints/step_0000002", "hydra.run.dir={newer}"],
        "holds newer checkpoints (step_0000004) that this run would overwrite or prune",
    ),
    (["resume={ckpt}", "model.n_layer=3"], "was saved with model.n_layer=4 but this run has"),
    (["resume={ckpt}", "trainer.seq_len=32"], "was saved with trainer.seq_len=64"),
    (
        ["resume={ckpt}", "data=synthetic", "data.vocab_size=257"],
        "was saved with data.source='embedded' but this run has data.source='synthetic'",
    ),
    (["hydra.run.dir={saved}", "model.d_model=128"], "was saved with model.d_model=64"),
    # the run dir
    (["hydra.run.dir={tmp}/a_file/run"], "is a file, not a directory; choose another"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Files the cases point at; none may change. {saved} holds a real checkpoint run."""
    tmp = tmp_path_factory.mktemp("bad")
    saved = tmp / "saved"
    train(saved, "trainer.max_steps=2", "trainer.eval_every=0")
    ckpt = saved / "checkpoints" / "step_0000002"
    corrupt = tmp / "corrupt" / "step_0000002"
    shutil.copytree(ckpt, corrupt)
    shard = corrupt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    badmanifest = tmp / "badmanifest" / "step_0000002"
    shutil.copytree(ckpt, badmanifest)
    (badmanifest / "manifest.json").write_text('{"step": 2,')
    steplie = tmp / "steplie" / "step_0000002"  # the user's edit: step 2 -> 1, re-serialised
    shutil.copytree(ckpt, steplie)
    manifest = json.loads((steplie / "manifest.json").read_text())
    (steplie / "manifest.json").write_text(json.dumps({**manifest, "step": 1}, indent=1))
    nomanifest = tmp / "nomanifest" / "step_0000002"
    shutil.copytree(ckpt, nomanifest)
    (nomanifest / "manifest.json").unlink()
    renamed = tmp / "renamed" / "step_0000003"
    shutil.copytree(ckpt, renamed)
    newer = tmp / "newer" / "checkpoints"  # a run dir with a checkpoint past the resume point
    shutil.copytree(ckpt, newer / "step_0000002")
    shutil.copytree(ckpt, newer / "step_0000004")
    partial = tmp / "partial" / "step_0000002.partial"
    shutil.copytree(ckpt, partial)
    (partial / "COMPLETE").unlink()
    (tmp / "a_file").write_text("not a folder\n")
    names = {"tmp": tmp, "saved": saved, "ckpt": ckpt, "corrupt": corrupt}
    names.update(badmanifest=badmanifest, partial=partial, steplie=steplie)
    names.update(nomanifest=nomanifest, renamed=renamed, newer=newer.parent)
    return names


def _fill(args, world, tmp_path):
    args = [a.format(**world) for a in args]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={tmp_path}/run")
    return [*FAST, "trainer.max_steps=3", "trainer.eval_every=0", *args]


def invoke(argv: list[str], accept_ok: bool = False) -> str | None:
    """launch/train.py's path without a new interpreter: returns the UserError's message
    (None if the run is accepted and accept_ok). Anything else raised is a bug and fails the
    test with its traceback."""
    try:
        cfg = check_overrides(argv)
        run(cfg)
    except UserError as e:
        assert e.exit_code == 2
        return str(e)
    if accept_ok:
        return None
    raise AssertionError(f"accepted: {argv}")


def _args(case) -> list[str]:
    return case.values[0] if hasattr(case, "values") else case[0]  # pytest.param or tuple


def _ids(case):
    return " ".join(_args(case))


@pytest.mark.parametrize("args,message", CATALOGUE, ids=[_ids(c) for c in CATALOGUE])
def test_catalogue_in_process(world, tmp_path, args, message):
    before = snapshot(world["tmp"])
    msg = invoke(_fill(args, world, tmp_path))
    assert message in msg, msg
    assert "\n" not in msg.strip()
    assert snapshot(world["tmp"]) == before
    assert not (tmp_path / "run").exists()  # a refused run leaves no run dir behind


def test_catalogue_is_at_least_40_cases_and_none_repeats_test_cli():
    from tests.test_cli import BAD

    assert len(CATALOGUE) >= 40
    theirs = {tuple(a) for a, _ in BAD}
    ours = [tuple(_args(c)) for c in CATALOGUE]
    assert not theirs & set(ours) and len(set(ours)) == len(ours)


def test_every_strategy_x_precision_that_cannot_work_is_refused(tmp_path):
    # Generated from the registries, so it grows with them (fp16, int8, fp8, ZeRO, ...).
    from dtrain.config import group_choices
    from dtrain.strategies import STRATEGIES

    refused = 0
    for name, cls in STRATEGIES.items():
        for precision in group_choices("precision"):
            if precision in cls.precisions:
                continue
            msg = invoke(_fill([f"strategy={name}", f"precision={precision}"], {}, tmp_path))
            # A precision this CPU cannot run at all (fp16, fp8 without emulation) is refused
            # for that reason first, whatever the strategy: the message single gives.
            on_cpu = invoke(_fill([f"precision={precision}"], {}, tmp_path), accept_ok=True)
            if on_cpu is not None and msg == on_cpu:
                continue
            assert f"cannot train precision={precision}" in msg and "valid precisions" in msg
            refused += 1
    if refused == 0:
        pytest.skip("every registered strategy trains every registered precision")


@pytest.mark.skipif(os.access("/sys", os.W_OK), reason="/sys is writable here")
def test_read_only_run_dir(world, tmp_path):
    msg = invoke(_fill(["hydra.run.dir=/sys/dtrain-run"], world, tmp_path))
    assert "is not writable" in msg


SUBPROCESS = [
    ["optim=sgd"],
    ["trainer.seq_len=1.5"],
    ["optim.lr=nan"],
    ["trainer.on_nonfinite=ignore"],
    ["data=local", "data.files=/no/such/*.txt"],
    ["resume={corrupt}"],
    ["resume={steplie}"],
    ["resume={newer}/checkpoints/step_0000002", "hydra.run.dir={newer}"],
    ["resume={ckpt}", "model.n_layer=3"],
    ["hydra.run.dir={tmp}/a_file/run"],
]


@pytest.mark.parametrize("args", SUBPROCESS, ids=[" ".join(a) for a in SUBPROCESS])
def test_representative_cases_as_real_processes(world, tmp_path, args):
    message = next(c[1] for c in CATALOGUE if not hasattr(c, "values") and c[0] == args)
    before = snapshot(world["tmp"])
    res = launch(*_fill(args, world, tmp_path))
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [one_error_line(res.stderr)], res.stderr
    assert message in res.stderr
    assert snapshot(world["tmp"]) == before
    assert not (tmp_path / "run").exists()  # Hydra's .hydra/ and the lock removed too

"""A run refused for bad input writes nothing: no run dir where there was none (no .hydra/, no
.lock, no metrics.jsonl, tensorboard/ or tokenizer.json), and an existing run dir left exactly
as it was. The refusals here come after Hydra has written .hydra/ and the lock is taken, so
they are run as real processes (launch/train.py), except DeepSpeed's absence, simulated."""

import importlib.util
import threading

import pytest

from dtrain.errors import ConfigError, DataError
from dtrain.run.preflight import check_overrides
from dtrain.train import run
from tests.conftest import FAST, launch, train
from tests.faults.helpers import one_error_line, snapshot

BASE = [*FAST, "trainer.max_steps=2", "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "notext.jsonl").write_text('{"body": "hello world"}\n{"body": "more words"}\n')
    (d / "small.txt").write_text("hello there. " * 40 + "\n")
    return d


CASES = {
    "fp16 on CPU": (["precision=fp16"], "precision=fp16 needs a CUDA GPU"),
    "jsonl without text": (
        ["data=local", "data.files={d}/notext.jsonl"],
        "has no field 'text' (data.text_field); its fields: body",
    ),
    "eval set too small": (
        ["data=local", "data.files={d}/small.txt", "trainer.eval_every=1"],
        "the eval set has fewer than 65 tokens",
    ),
    "bpe on missing files": (
        ["data=local", "data.files={d}/none/*.txt", "data.tokenizer=bpe"],
        "matches no file",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_run_leaves_no_run_dir(files, tmp_path, name):
    args, message = CASES[name]
    run_dir = tmp_path / "run"
    res = launch(*BASE, *[a.format(d=files) for a in args], f"hydra.run.dir={run_dir}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert message in one_error_line(res.stderr)
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


def test_a_run_refused_after_tensorboard_opened_leaves_no_writer_thread(files, tmp_path):
    """The eval set is found too small after the writer has started: it is closed on the way
    out, so its thread is not writing when the launcher removes the run dir."""
    before = set(threading.enumerate())
    args = ["data=local", f"data.files={files}/small.txt", "trainer.eval_every=1"]
    with pytest.raises(DataError, match="the eval set has fewer than 65 tokens"):
        train(tmp_path / "run", "trainer.max_steps=2", *args)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not [t for t in left if type(t).__name__ == "_AsyncWriterThread"], left


def test_refused_run_leaves_an_existing_run_dir_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "trainer.max_steps=2", "trainer.eval_every=0")
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("the first run's config\n")
    before = snapshot(run_dir)
    res = launch(*BASE, "precision=fp16", f"hydra.run.dir={run_dir}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "precision=fp16 needs a CUDA GPU" in one_error_line(res.stderr)
    assert snapshot(run_dir) == before
    assert {p.name for p in run_dir.iterdir()} == {p.split("/")[0] for p in before}


def test_missing_deepspeed_leaves_no_run_dir(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a)
    )
    run_dir = tmp_path / "run"
    cfg = check_overrides([*BASE, "strategy=zero2", f"hydra.run.dir={run_dir}"])
    with pytest.raises(ConfigError, match="strategy=zero2 needs DeepSpeed"):
        run(cfg)
    assert not run_dir.exists()


def test_an_error_after_the_first_step_keeps_what_the_run_wrote(tmp_path, monkeypatch):
    """Only a run refused before it trained is undone: one that trained keeps its files."""
    import dtrain.train as train_mod

    real = train_mod.one_step

    def second_step_fails(r, report, step, heartbeat):
        if step == 1:
            raise ConfigError("refused at step 2")
        return real(r, report, step, heartbeat)

    monkeypatch.setattr(train_mod, "one_step", second_step_fails)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="refused at step 2"):
        train(run_dir, "trainer.max_steps=3", "trainer.eval_every=0", "trainer.log_every=1")
    assert (run_dir / "metrics.jsonl").is_file()

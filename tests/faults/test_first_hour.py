"""What a new user meets in the first hour on CPU, and bad outputs of a finished run: running the
default run dir again with another config, a run already trained to its end, NaN weights
exported or sampled, a metrics.jsonl line nested too deeply, an export into a read-only folder,
and compare's key=value spelling."""

import json
import subprocess
import types

import pytest
import torch

from dtrain.errors import ConfigError, UserError
from dtrain.run.preflight import check_overrides
from dtrain.train import run
from tests.conftest import FAST, cli_env, launch_cmd, train
from tests.faults.helpers import snapshot

QUICK = [*FAST, "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fh") / "run"
    train(run_dir, "trainer.max_steps=2", "trainer.eval_every=0")
    return run_dir


# --- the default run dir, run again ------------------------------------------------------


def _in(cwd, *args):
    return subprocess.run(
        launch_cmd([*QUICK, *args]),
        capture_output=True, text=True, env=cli_env(), cwd=cwd, timeout=300,
    )  # fmt: skip


def test_the_default_run_dir_with_more_steps_goes_to_a_new_one(tmp_path):
    first = _in(tmp_path, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    base = tmp_path / "outputs" / "single-fp32-w1-tiny"
    assert (base / ".hydra" / "config.yaml").is_file()
    before = snapshot(base)
    second = _in(tmp_path, "trainer.max_steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    line = next(ln for ln in second.stderr.splitlines() if "this run goes to" in ln)
    assert line == (
        "outputs/single-fp32-w1-tiny was made by a run with another config "
        "(trainer.max_steps 2 -> 3); this run goes to outputs/single-fp32-w1-tiny-2 "
        "(pass hydra.run.dir=DIR to choose)"
    )
    new = tmp_path / "outputs" / "single-fp32-w1-tiny-2"
    assert (new / "checkpoints" / "step_0000003" / "COMPLETE").is_file()
    assert "max_steps: 3" in (new / ".hydra" / "config.yaml").read_text()
    assert snapshot(base) == before


def test_the_default_run_dir_follows_the_checkpoint_without_hydras_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # in-process runs leave no .hydra/: the manifest tells
    run(check_overrides([*QUICK, "trainer.max_steps=2"]))
    assert check_overrides([*QUICK, "trainer.max_steps=2"]).run_dir.endswith("w1-tiny")
    assert check_overrides([*QUICK, "trainer.max_steps=2", "trainer.log_every=1"]).run_dir.endswith(
        "w1-tiny"
    )  # how a run reports is not what it trains
    moved = check_overrides([*QUICK, "trainer.max_steps=2", "data.max_bytes=200000"])
    assert moved.run_dir.endswith("w1-tiny-2")
    explicit = f"hydra.run.dir={tmp_path / 'outputs' / 'single-fp32-w1-tiny'}"
    with pytest.raises(UserError, match="was saved with model.n_layer=4"):
        run(check_overrides([*QUICK, "trainer.max_steps=2", "model.n_layer=2", explicit]))


def test_a_run_already_trained_to_its_end_says_so(trained, capfd):
    out = train(trained, "trainer.max_steps=2", "trainer.eval_every=0")
    assert out["step"] == 2
    said = [ln.split("] ", 1)[1] for ln in capfd.readouterr().err.splitlines() if "nothing" in ln]
    assert said == [
        f"{trained} is already trained to step 2 (trainer.max_steps=2): nothing to train; to "
        f"train it further pass a larger trainer.max_steps with hydra.run.dir={trained}"
    ]


# --- NaN weights, exported or sampled --------------------------------------------------------


@pytest.fixture
def nan_weights(monkeypatch):
    """The checkpoint's weights as loaded, with a NaN in one tensor."""
    import dtrain.checkpoint.weights as weights

    real = weights.load_checkpoint

    def poisoned(path, device="cpu"):
        loaded = real(path, device)
        with torch.no_grad():
            next(loaded.model.parameters())[0, 0] = float("nan")
        return loaded

    monkeypatch.setattr(weights, "load_checkpoint", poisoned)


def test_export_refuses_nan_weights_unless_allowed(trained, tmp_path, nan_weights):
    from dtrain.cli.export import main

    with pytest.raises(ConfigError, match="holds NaN or inf in 1 weight tensor"):
        main([f"checkpoint={trained}", f"out={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()
    main([f"checkpoint={trained}", f"out={tmp_path / 'hf'}", "allow_nonfinite=true"])
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_export_torch_refuses_nan_weights(trained, tmp_path, monkeypatch):
    import dtrain.checkpoint.weights as weights
    from dtrain.cli.export import main

    real = weights.consolidate

    def poisoned(path, out):
        real(path, out)
        state = torch.load(out, weights_only=True)
        next(iter(state["model"].values())).fill_(float("inf"))
        torch.save(state, out)

    monkeypatch.setattr(weights, "consolidate", poisoned)
    with pytest.raises(ConfigError, match="holds NaN or inf"):
        main([f"checkpoint={trained}", f"out={tmp_path / 'm.pt'}", "format=torch"])
    assert list(tmp_path.iterdir()) == []


def test_generate_refuses_nan_weights_unless_allowed(trained, nan_weights, capsys):
    from dtrain.cli.generate import main

    with pytest.raises(ConfigError, match="allow_nonfinite=true"):
        main([f"checkpoint={trained}", "max_new_tokens=2"])
    main([f"checkpoint={trained}", "max_new_tokens=2", "allow_nonfinite=true"])


# --- compare and export on odd inputs and outputs ---------------------------------------------


def test_compare_skips_a_line_nested_too_deeply(trained, tmp_path, capsys):
    import shutil

    from dtrain.cli.compare import main

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    with open(copy / "metrics.jsonl", "a") as f:
        f.write("[" * 200_000 + "]" * 200_000 + "\n")
    assert main([str(copy)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[2].startswith("run ")
    lines = captured.err.strip().splitlines()
    assert lines == [
        f"warning: {copy / 'metrics.jsonl'}:{_n_lines(copy)} is nested too deeply; skipped"
    ]


def _n_lines(run_dir) -> int:
    return len((run_dir / "metrics.jsonl").read_text().splitlines())


def test_compare_takes_key_value_and_refuses_unknown_keys(trained, capsys):
    from dtrain.cli.compare import main

    assert main([f"runs=[{trained}]", "json=true"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["strategy"] == "single"
    with pytest.raises(SystemExit) as e:
        main([str(trained), "pgn=x.png"])
    assert e.value.code == 2
    assert "pgn" in capsys.readouterr().err


@pytest.mark.parametrize("fmt,name", [("hf", "hf"), ("torch", "m.pt")])
def test_export_into_a_read_only_folder_is_one_line(trained, tmp_path, monkeypatch, fmt, name):
    import dtrain.reliability.safe_write as safe_write
    from dtrain.cli.export import main

    def read_only(*a, **k):  # what mkdtemp meets in a read-only folder (root ignores modes)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safe_write, "tempfile", types.SimpleNamespace(mkdtemp=read_only))
    with pytest.raises(ConfigError) as e:
        main([f"checkpoint={trained}", f"out={tmp_path / name}", f"format={fmt}"])
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(
        f"cannot write {tmp_path / name}"
    ) and "Permission denied" in str(e.value)
    assert [p.name for p in tmp_path.rglob("*")] in ([], ["hf"])

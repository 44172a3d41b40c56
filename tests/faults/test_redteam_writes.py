"""What an attacker with write access to an output folder tries, by whole classes.

Links: each CLI and a tiny training run are run once normally and every path they create is
recorded; then, for each path, a symbolic link to a victim file is planted at exactly that name
(and at the temp names older versions used) and the command is run again. The victim must be
unchanged, and the command either refuses in one line (exit 2) or writes around the link.

Sizes: values no device can hold are refused before anything is built, one line naming the
value, with no run dir left behind.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.errors import UserError
from dtrain.run.preflight import check_overrides
from dtrain.train import run
from tests.conftest import FAST, ROOT, cli_env, launch, train
from tests.faults.helpers import one_error_line

VICTIM = "precious: not dtrain's to write\n"
RUN = ["trainer.max_steps=2", "trainer.eval_every=2", "data.tokenizer=bpe", "data.vocab_size=300"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run (BPE, so it saves tokenizer.json) and every path it created."""
    run_dir = tmp_path_factory.mktemp("rt") / "run"
    train(run_dir, *RUN)
    made = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    return run_dir, made


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(VICTIM)
    return v


def _plant(at: Path, victim: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)


def _refused_or_around(call, victim: Path) -> str | None:
    """Runs call(); returns the refusal's message (one line) or None if it wrote around."""
    try:
        call()
    except UserError as e:
        assert "\n" not in str(e).strip(), str(e)
        return str(e)
    finally:
        assert victim.read_text() == VICTIM
    return None


# --- training: a link at every path a run writes -----------------------------------------

HYDRA = [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"]
RUN_FILES = [".lock", "metrics.jsonl", "tokenizer.json", "oom_advice.txt", "tensorboard"]


def test_a_link_anywhere_a_run_writes_is_refused(trained, tmp_path):
    _, made = trained
    assert {"metrics.jsonl", "tokenizer.json", ".lock", "tensorboard"} <= set(made)
    assert any(p.startswith("checkpoints/step_0000002/") for p in made)
    victim = _victim(tmp_path)
    for i, rel in enumerate(sorted(set(made + HYDRA + RUN_FILES))):
        run_dir = tmp_path / f"run{i}"
        _plant(run_dir / rel, victim)
        argv = [*FAST, *RUN, f"hydra.run.dir={run_dir}"]
        msg = _refused_or_around(lambda argv=argv: run(check_overrides(argv)), victim)
        assert msg is not None and "symbolic link" in msg, (rel, msg)


def test_a_link_at_hydras_config_is_refused_before_hydra_writes(tmp_path):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "run"
    _plant(run_dir / ".hydra" / "config.yaml", victim)
    res = launch(*FAST, "trainer.max_steps=2", f"hydra.run.dir={run_dir}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "holds a symbolic link" in one_error_line(res.stderr)
    assert res.stderr.strip().splitlines() == [one_error_line(res.stderr)]
    assert victim.read_text() == VICTIM
    assert sorted(p.name for p in run_dir.rglob("*")) == [".hydra", "config.yaml"]


# --- export and compare: a link at every output name, and at the old temp names ------------


def _export(*args: str):
    from dtrain.cli.export import main

    return main(list(args))


def test_export_hf_never_writes_through_a_link(trained, tmp_path):
    run_dir, _ = trained
    normal = tmp_path / "normal"
    _export(f"checkpoint={run_dir}", f"out={normal}")
    outputs = sorted(p.name for p in normal.iterdir())
    assert {"model.safetensors", "config.json"} <= set(outputs)
    victim = _victim(tmp_path)
    olds = ["model.safetensors.tmp", "config.json.tmp", "model.safetensors.index.json"]
    for i, name in enumerate(outputs + olds):
        out = tmp_path / f"out{i}"
        _plant(out / name, victim)
        msg = _refused_or_around(
            lambda out=out: _export(f"checkpoint={run_dir}", f"out={out}"), victim
        )
        if name in outputs or name.endswith("index.json"):
            assert msg is not None and "is a symbolic link" in msg, (name, msg)
        else:  # a name no longer used: the export goes through, around the link
            assert msg is None and (out / "model.safetensors").is_file(), (name, msg)
    # overwrite=true replaces files, never a link's target
    out = tmp_path / "over"
    _plant(out / "config.json", victim)
    msg = _refused_or_around(
        lambda: _export(f"checkpoint={run_dir}", f"out={out}", "overwrite=true"), victim
    )
    assert msg is not None and "is a symbolic link" in msg
    # out itself a link to a folder
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked_out").symlink_to(tmp_path / "elsewhere")
    msg = _refused_or_around(
        lambda: _export(f"checkpoint={run_dir}", f"out={tmp_path / 'linked_out'}"), victim
    )
    assert msg is not None and "is a symbolic link" in msg
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_export_torch_never_writes_through_a_link(trained, tmp_path):
    run_dir, _ = trained
    victim = _victim(tmp_path)
    for name, refused in [("model.pt", True), ("model.pt.tmp", False)]:
        folder = tmp_path / name
        _plant(folder / name, victim)
        out = folder / "model.pt"
        call = lambda out=out: _export(f"checkpoint={run_dir}", f"out={out}", "format=torch")
        msg = _refused_or_around(call, victim)
        assert (msg is not None) == refused, (name, msg)
    dangling = tmp_path / "dangling"
    _plant(dangling / "model.pt", tmp_path / "not_yet")  # would create the victim
    msg = _refused_or_around(
        lambda: _export(f"checkpoint={run_dir}", f"out={dangling / 'model.pt'}", "format=torch"),
        victim,
    )
    assert msg is not None and not (tmp_path / "not_yet").exists()


def test_export_as_a_process_refuses_a_link_in_one_line(trained, tmp_path):
    run_dir, _ = trained
    victim = _victim(tmp_path)
    _plant(tmp_path / "out" / "model.safetensors", victim)
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "dtrain.cli.export", f"checkpoint={run_dir}", f"out={out}"],
        capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [one_error_line(res.stderr)]
    assert "model.safetensors is a symbolic link" in res.stderr
    assert victim.read_text() == VICTIM


def test_compare_never_writes_its_chart_through_a_link(trained, tmp_path):
    pytest.importorskip("matplotlib")
    from dtrain.cli.compare import main

    run_dir, _ = trained
    victim = _victim(tmp_path)
    for name, refused in [("chart.png", True), ("chart.png.tmp.png", False)]:
        folder = tmp_path / name
        _plant(folder / name, victim)
        png = folder / "chart.png"
        try:
            main([str(run_dir), f"png={png}"])
            outcome = None
        except SystemExit as e:
            outcome = e.code
        assert victim.read_text() == VICTIM
        assert outcome == (2 if refused else None), name
    # and an existing chart is not replaced unless asked
    png = tmp_path / "mine.png"
    png.write_text("mine\n")
    with pytest.raises(SystemExit):
        main([str(run_dir), f"png={png}"])
    assert png.read_text() == "mine\n"
    main([str(run_dir), f"png={png}", "overwrite=true"])
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- impossible sizes -------------------------------------------------------------------

SIZES = [
    (["trainer.seq_len=1000000000", "model.max_seq_len=1000000000"], "trainer.seq_len=1000000000"),
    (["trainer.micro_batch_size=1000000000"], "trainer.micro_batch_size=1000000000 needs"),
    (["model.d_model=1048576"], "model.d_model=1048576"),
    (["model.n_layer=100000", "model.d_model=4096"], "for its weights, gradients and optimizer"),
    (["optim.lr=1e300"], "optim.lr=1e+300 is past any rate AdamW trains at"),
]


@pytest.mark.parametrize("args,message", SIZES, ids=[" ".join(a) for a, _ in SIZES])
def test_impossible_sizes_are_refused_before_anything_is_built(tmp_path, args, message):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as e:
        check_overrides([*FAST, *args, f"hydra.run.dir={run_dir}"])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not run_dir.exists()


def test_an_impossible_size_is_one_line_from_launch(tmp_path):
    res = launch(*FAST, "trainer.micro_batch_size=1000000000", f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert res.stderr.strip().splitlines() == [line]
    assert "more than this machine's" in line and "at most trainer.micro_batch_size=" in line
    assert not (tmp_path / "run").exists()


def test_generate_refuses_more_samples_than_fit(trained):
    from dtrain.cli.generate import main

    run_dir, _ = trained
    with pytest.raises(
        UserError, match=r"num_samples=1000000000 needs about .* at most num_samples="
    ):
        main([f"checkpoint={run_dir}", "num_samples=1000000000", "max_new_tokens=4"])


def test_the_links_wandb_makes_in_its_own_folder_do_not_refuse_the_next_run(tmp_path):
    """wandb keeps `wandb/latest-run` pointing at its newest run: a second run in the same run
    dir goes on; the same link anywhere dtrain writes, or `wandb` itself a link, is refused."""
    from dtrain.errors import ConfigError
    from dtrain.reliability.safe_write import check_tree

    (tmp_path / "wandb" / "offline-run-1").mkdir(parents=True)
    (tmp_path / "wandb" / "latest-run").symlink_to("offline-run-1")
    check_tree(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "latest-run").symlink_to(tmp_path / "wandb" / "offline-run-1")
    with pytest.raises(ConfigError, match="holds a symbolic link"):
        check_tree(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "wandb").symlink_to(tmp_path / "wandb")
    with pytest.raises(ConfigError, match="holds a symbolic link"):
        check_tree(other)

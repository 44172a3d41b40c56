"""Red team: crafted files and fields in a checkpoint folder, against every loader.

Every special file type (FIFO, socket, symbolic link to /dev/zero, symbolic link to a copy of
the file outside the folder, directory, character device where mknod is allowed) is put at
every name a loader opens (each file of a real checkpoint, and a shard that `.metadata` names
but the manifest does not list), the manifest and COMPLETE re-signed as an attacker would.
Each loader (resume=PATH, resume=auto, generate and export's loaders) must refuse it in one line
without blocking (an alarm fails the test after a few seconds instead of hanging it), and
resume=auto must fall back to the previous good checkpoint. Then malformed but signed fields
(the manifest's types, a rank's RNG state, the saved model config), and the writer facing
links it did not make.
"""

import json
import os
import shutil
import signal
import socket
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import CheckpointManager, sha256_file
from dtrain.checkpoint.weights import consolidate, load_checkpoint
from dtrain.config import CheckpointConfig
from dtrain.errors import CheckpointError
from tests.conftest import FAST, train
from tests.faults.helpers import (
    edit_manifest,
    one_error_line,
    replace_signed,
    run_command,
    snapshot,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run with complete checkpoints at steps 2 and 4 (copied per case)."""
    run = tmp_path_factory.mktemp("redteam_loaders") / "run"
    train(run, "trainer.max_steps=4", "trainer.eval_every=0", "checkpoint.every_n_steps=2")
    return run


@contextmanager
def deadline(seconds: int = 10):
    """Fail instead of hanging: SIGALRM interrupts a blocking open or read in this thread. The
    test fails even where a loader turns the interruption into an error of its own."""
    fired = []

    def fire(*_):
        fired.append(True)
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        assert not fired, f"blocked for {seconds} s"


def _fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path, outside: Path) -> None:
    cwd = os.getcwd()
    os.chdir(path.parent)  # a relative name: socket paths are limited to 108 bytes
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)  # the file stays after the socket is closed
    finally:
        os.chdir(cwd)


def _link_to_dev_zero(path: Path, outside: Path) -> None:
    os.symlink("/dev/zero", path)


def _link_outside(path: Path, outside: Path) -> None:
    """The same bytes, outside the folder: its sha256 still matches the manifest."""
    outside.mkdir(exist_ok=True)
    os.replace(path, outside / path.name)
    os.symlink(outside / path.name, path)


def _directory(path: Path, outside: Path) -> None:
    path.mkdir()


def _device(path: Path, outside: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("mknod needs root")


KINDS = [_fifo, _socket, _link_to_dev_zero, _link_outside, _directory, _device]
NAMES = [".metadata", "__0_0.distcp", "extra_rank0.pt", "manifest.json", "COMPLETE", "unlisted"]


def _plant(run: Path, name: str, kind) -> Path:
    """Step 4 of `run` with `name` replaced by `kind`; "unlisted": a new shard file that
    .metadata names for every tensor, which the manifest does not list."""
    ckpt = run / "checkpoints" / "step_0000004"
    outside = run.parent / "outside"
    if name == "unlisted":
        _point_metadata_at(ckpt, "__9_0.distcp")
        name = "__9_0.distcp"
        if kind is _link_outside:  # the real shard's bytes, under a name nobody signed
            shutil.copy(ckpt / "__0_0.distcp", ckpt / name)
    elif kind is not _link_outside:
        (ckpt / name).unlink()
    kind(ckpt / name, outside)
    return ckpt


def _point_metadata_at(ckpt: Path, shard: str) -> None:
    """Rewrite .metadata (with DCP's own classes, as dcp.save would) so every item lives in
    `shard`, and re-sign the manifest to match."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata()  # our own file: safe to read
    for info in meta.storage_data.values():
        info.relative_path = shard
    replace_signed(ckpt, ".metadata", pickle.dumps(meta))


def _loaders(run: Path, bad: Path, out: Path) -> dict:
    from dtrain.checkpoint.safe_load import load_all

    manager = CheckpointManager(run, CheckpointConfig(), rank=0, world_size=1)
    template = load_all(run / "checkpoints" / "step_0000002")
    return {
        "resume": lambda: (manager.read_manifest(bad), manager.load(bad, template)),
        "generate/export-hf": lambda: load_checkpoint(bad),
        "export-torch": lambda: consolidate(bad, out),
    }


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__.strip("_"))
def test_every_special_file_at_every_name_is_refused_and_auto_falls_back(saved, tmp_path, kind):
    for name in NAMES:
        run = tmp_path / name.strip("._") / "run"
        shutil.copytree(saved, run, symlinks=True)
        bad = _plant(run, name, kind)
        before = snapshot(run.parent / "outside") if (run.parent / "outside").exists() else {}
        out = tmp_path / "out.pt"
        for loader, load in _loaders(run, bad, out).items():
            with deadline(), pytest.raises(CheckpointError) as e:
                load()
            msg = str(e.value)
            assert "\n" not in msg and str(bad) in msg, (name, loader, msg)
            assert not out.exists()
        manager = CheckpointManager(run, CheckpointConfig(), rank=0, world_size=1)
        with deadline():
            found, _ = manager.find_resumable()
        assert found.name == "step_0000002", (name, found)
        if before:
            assert snapshot(run.parent / "outside") == before


def test_the_checksum_pass_never_opens_a_special_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero")
    for name in ("fifo", "zero"):
        with deadline(5), pytest.raises(CheckpointError, match=f"{name} is a"):
            sha256_file(tmp_path / name)


def test_a_fifo_shard_is_one_line_and_no_hang_for_every_command(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    bad = _plant(run, "__0_0.distcp", _fifo)
    cli = [sys.executable, "-m"]
    commands = {
        "resume": [sys.executable, "launch/train.py", *FAST, "trainer.max_steps=5",
                   "trainer.eval_every=0", f"resume={bad}", f"hydra.run.dir={tmp_path}/o"],
        "generate": [*cli, "dtrain.cli.generate", f"checkpoint={bad}", "prompt=a",
                     "max_new_tokens=1"],
        "export": [*cli, "dtrain.cli.export", f"checkpoint={bad}", f"out={tmp_path}/hf"],
    }  # fmt: skip
    for what, cmd in commands.items():
        res = run_command(cmd, timeout=40)
        assert res.returncode == 2, (what, res.stderr[-3000:])
        line = one_error_line(res.stderr)
        assert "__0_0.distcp is a FIFO" in line, (what, line)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "o" / "checkpoints").exists()


# --- malformed fields, signed ----------------------------------------------------------


def _edit(run: Path, where: str, value) -> Path:
    ckpt = run / "checkpoints" / "step_0000004"
    edit_manifest(ckpt, where, value)
    return ckpt


MANIFEST_FIELDS = {
    "sizes": ("abc", "'sizes' must map"),
    "files": (7, "'files' must map"),
    "world_size": ("2", "'world_size' must be an integer"),
    "config.model": ("tiny", "'config.model' must be a JSON object"),
}


@pytest.mark.parametrize("field", [*MANIFEST_FIELDS, "sizes-int"])
def test_a_malformed_manifest_field_is_named_and_auto_falls_back(saved, tmp_path, field):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    value, words = MANIFEST_FIELDS.get(field, (12, "'sizes' must map"))
    bad = _edit(run, field.split("-")[0], value)
    out = tmp_path / "out.pt"
    for load in _loaders(run, bad, out).values():
        with pytest.raises(CheckpointError, match=f"manifest.json is malformed: {words}"):
            load()
    manager = CheckpointManager(run, CheckpointConfig(), rank=0, world_size=1)
    assert manager.find_resumable()[0].name == "step_0000002"


def _rank_file(run: Path, value) -> Path:
    import io

    ckpt = run / "checkpoints" / "step_0000004"
    buf = io.BytesIO()
    torch.save(value, buf)
    replace_signed(ckpt, "extra_rank0.pt", buf.getvalue())
    return ckpt


RANK_STATES = {
    "short": ({"rng": {"torch": torch.zeros(10, dtype=torch.uint8)}}, "not 5056 uint8 bytes"),
    "float": ({"rng": {"torch": torch.zeros(5056)}}, "not 5056 uint8 bytes"),
    "missing": ({"rank": {}}, "RNG state is not a dict holding 'torch'"),
    "cuda-short": (
        {"rng": {"torch": torch.get_rng_state(), "cuda": torch.zeros(3, dtype=torch.uint8)}},
        "cuda RNG state is not 16 uint8 bytes",
    ),
    "not-a-dict": ([1, 2], "not a dict holding 'rng'"),
    "rank-list": ({"rng": {"torch": torch.get_rng_state()}, "rank": [1]}, "rank state is a list"),
}


@pytest.mark.parametrize("case", RANK_STATES)
def test_a_malformed_rank_state_is_refused_before_it_is_applied(saved, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    value, words = RANK_STATES[case]
    bad = _rank_file(run, value)
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=f"extra_rank0.pt is malformed: .*{words}"):
        _loaders(run, bad, tmp_path / "o")["resume"]()
    assert torch.equal(torch.get_rng_state(), rng)
    manager = CheckpointManager(run, CheckpointConfig(), rank=0, world_size=1)
    assert manager.find_resumable()[0].name == "step_0000002"


MODEL_CONFIGS = {
    "n_head=0": ({"n_head": 0}, "model.n_head must be > 0, got 0"),
    "n_layer=four": ({"n_layer": "four"}, "model.n_layer must be"),
    "huge": ({"n_layer": 4096, "d_model": 65536, "n_head": 64}, r"needs \d+\.\d GiB"),
    "d_model%n_head": ({"d_model": 30, "n_head": 4}, "must be divisible by n_head"),
}


@pytest.mark.parametrize("case", MODEL_CONFIGS)
def test_a_bad_saved_model_config_is_refused_before_allocating(saved, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt = run / "checkpoints" / "step_0000004"
    model = json.loads((ckpt / "manifest.json").read_text())["config"]["model"]
    change, words = MODEL_CONFIGS[case]
    bad = _edit(run, "config.model", {**model, **change})
    with deadline(), pytest.raises(CheckpointError, match=words) as e:
        load_checkpoint(bad)
    assert "\n" not in str(e.value)


def test_generate_refuses_a_terabyte_model_in_one_line(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt = run / "checkpoints" / "step_0000004"
    model = json.loads((ckpt / "manifest.json").read_text())["config"]["model"]
    bad = _edit(run, "config.model", {**model, "n_layer": 100000, "d_model": 65536})
    generate = [sys.executable, "-m", "dtrain.cli.generate", f"checkpoint={bad}", "prompt=a"]
    res = run_command(generate, timeout=40)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "refused to allocate it" in one_error_line(res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# --- the writer and links it did not make ----------------------------------------------


def _manager(run: Path, keep_last: int = 1) -> CheckpointManager:
    return CheckpointManager(run, CheckpointConfig(keep_last=keep_last), rank=0, world_size=1)


def _save(manager: CheckpointManager, step: int):
    return manager.save(step, {"model": {"w": torch.arange(4.0)}}, {"data": {}})


@pytest.mark.parametrize("where", ["step_0000002.partial", "step_0000002"])
def test_a_save_never_writes_through_a_planted_link(tmp_path, where):
    from dtrain.checkpoint import CheckpointSaveError

    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(target, run / "checkpoints" / where)
    with pytest.raises(CheckpointSaveError, match="symbolic link is in the way"):
        _save(_manager(run), 2)
    assert sorted(p.name for p in target.iterdir()) == ["keep"]
    assert (run / "checkpoints" / where).is_symlink()


def test_pruning_and_setting_aside_never_replace_what_they_did_not_make(tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.mkdir()
    run = tmp_path / "run"
    manager = _manager(run)
    _save(manager, 2)
    root = run / "checkpoints"
    os.symlink(target, root / "step_0000002.deleting")
    _save(manager, 4)  # would prune step 2 through the planted name
    assert (root / "step_0000002").is_dir() and (root / "step_0000004").is_dir()
    assert "could not remove old checkpoint" in caplog.text
    assert list(target.iterdir()) == []
    os.symlink(target, root / "step_0000004.rejected")
    manager.set_aside([root / "step_0000004"])
    assert (root / "step_0000004.rejected2" / "COMPLETE").is_file()
    assert list(target.iterdir()) == [] and (root / "step_0000004.rejected").is_symlink()


def test_new_files_are_never_written_through_a_link_or_over_a_file(tmp_path):
    from dtrain.checkpoint.files import create_new, write_atomic
    from dtrain.checkpoint.safe_load import RegularFiles

    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "link")
    with pytest.raises(FileExistsError), RegularFiles().create_stream(tmp_path / "link", "wb"):
        pass
    (tmp_path / "planted").write_text("theirs")
    with pytest.raises(FileExistsError):
        write_atomic(tmp_path / "planted", "ours")
    assert victim.read_text() == "precious" and (tmp_path / "planted").read_text() == "theirs"

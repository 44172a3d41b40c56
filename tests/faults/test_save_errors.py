"""Disk full or unwritable folder while saving: a clear message, checkpoint.on_error=stop|continue,
and nothing incomplete is ever marked complete (the previous checkpoint stays the resume point).

Injected with DTRAIN_FAULT at each stage of the save (root ignores permission bits, so chmod
cannot make a folder unwritable here), and once for real on a tiny tmpfs when mounting works.
"""

import errno
import os
import shutil
import subprocess
import uuid

import pytest

from dtrain.checkpoint import CheckpointSaveError, latest_complete, list_complete
from dtrain.errors import CheckpointError
from tests.conftest import train
from tests.faults.helpers import SAVES


def _assert_nothing_half_done(run, newest_complete: int):
    ckpts = run / "checkpoints"
    assert latest_complete(ckpts).name == f"step_{newest_complete:07d}"
    leftovers = [p.name for p in ckpts.iterdir() if not p.name.startswith("step_") or "." in p.name]
    assert leftovers == [], leftovers  # no .partial / .deleting left behind
    for _, ckpt in list_complete(ckpts):  # and every "complete" one really is
        train(run / "probe", "trainer.max_steps=8", f"resume={ckpt}", "trainer.stop_at_step=8")
        shutil.rmtree(run / "probe")


# checkpoint.async_save=true: the same failures in the background, the same outcome.
MODES = pytest.mark.parametrize("mode", ["sync", "async"])


@MODES
@pytest.mark.parametrize(
    "where,what",
    [
        ("ckpt.save.begin", "enospc"),
        ("ckpt.save.write", "eio"),
        ("ckpt.save.after_dcp", "enospc"),
        ("ckpt.save.after_extra", "eio"),
        ("ckpt.save.after_manifest", "erofs"),
        ("ckpt.save.after_marker", "enospc"),
    ],
)
def test_on_error_stop(tmp_path, monkeypatch, where, what, mode):
    monkeypatch.setenv("DTRAIN_FAULT", f"{where}={what}#4")
    run = tmp_path / "run"
    with pytest.raises(CheckpointSaveError) as e:
        train(run, "trainer.max_steps=6", *SAVES, f"checkpoint.async_save={mode == 'async'}")
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, CheckpointError)  # exit 2, one line
    assert (
        "step_0000004 could not be saved" in msg
        and os.strerror({"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS}[what])
        in msg
    ), msg
    assert "newest complete checkpoint is step_0000002" in msg
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002"]


@MODES
def test_on_error_continue_keeps_training_and_saves_later(tmp_path, monkeypatch, capfd, mode):
    monkeypatch.setenv("DTRAIN_FAULT", "ckpt.save.after_dcp=enospc#4")
    run = tmp_path / "run"
    out = train(
        run,
        "trainer.max_steps=6",
        "checkpoint.keep_last=0",
        "checkpoint.on_error=continue",
        f"checkpoint.async_save={mode == 'async'}",
        *SAVES,
    )
    assert out["step"] == 6 and out["save_failures"] == [4]
    assert "training continues (checkpoint.on_error=continue)" in capfd.readouterr().err
    assert [s for s, _ in list_complete(run / "checkpoints")] == [2, 6]
    _assert_nothing_half_done(run, 6)


def test_a_failed_final_save_is_an_error_even_with_continue(tmp_path, monkeypatch):
    # The end of the run (or a stop signal) has no later save to fall back on.
    monkeypatch.setenv("DTRAIN_FAULT", "ckpt.save.after_extra=enospc#4")
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        train(tmp_path / "run", "trainer.max_steps=4", "checkpoint.on_error=continue", *SAVES)
    assert latest_complete(tmp_path / "run" / "checkpoints").name == "step_0000002"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    # 4 MiB: room for one checkpoint of the tiny model (~3.2 MB), not two.
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_disk_full_on_tmpfs(tmp_path, tiny_tmpfs):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(tiny_tmpfs)
    with pytest.raises(CheckpointSaveError) as e:
        train(run, "trainer.max_steps=6", "checkpoint.keep_last=0", *SAVES)
    msg = str(e.value)
    assert "No space left on device" in msg and "step_0000004" in msg, msg
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["step_0000002"]
    _assert_nothing_half_done(run, 2)

"""Corrupted checkpoints: every file is checked against the manifest's sha256 before loading.

resume=auto skips a corrupt checkpoint with a warning naming the file and resumes from the
previous complete one; an explicit resume=<path> of a corrupt one is an error (exit 2).
"""

import json

import pytest

from dtrain.checkpoint import latest_complete, list_complete
from dtrain.errors import CheckpointError
from tests.conftest import FAST, launch, train
from tests.faults.helpers import SAVES, one_error_line, snapshot


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run with complete checkpoints at steps 2 and 4 (copied per test)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(run, "trainer.max_steps=4", "checkpoint.keep_last=0", *SAVES)
    assert [s for s, _ in list_complete(run / "checkpoints")] == [2, 4]
    return run


@pytest.fixture
def run(saved, tmp_path):
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


def _shard(ckpt):
    return sorted(ckpt.glob("__0_*.distcp"))[0]


def truncate(ckpt):
    f = _shard(ckpt)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f.name


def flip_byte(ckpt):
    f = _shard(ckpt)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: the size is unchanged, only the hash sees it
    f.write_bytes(bytes(data))
    return f.name


def delete_shard(ckpt):
    f = _shard(ckpt)
    f.unlink()
    return f.name


def alter_extra(ckpt):
    f = ckpt / "extra_rank0.pt"
    f.write_bytes(f.read_bytes() + b"\0")
    return f.name


def alter_metadata(ckpt):
    f = ckpt / ".metadata"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    return f.name


def garble_manifest(ckpt):
    (ckpt / "manifest.json").write_text("{ not json")
    return "manifest.json"


CORRUPTIONS = [truncate, flip_byte, delete_shard, alter_extra, alter_metadata, garble_manifest]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_auto_resume_falls_back_to_the_previous_checkpoint(run, corrupt, capfd):
    step4 = run / "checkpoints" / "step_0000004"
    name = corrupt(step4)
    capfd.readouterr()
    out = train(run, "trainer.max_steps=6", "checkpoint.keep_last=0", *SAVES)
    text = capfd.readouterr().err
    assert f"{name}" in text and "falling back to step_0000002" in text, text[-2000:]
    assert "resumed from" in text and "step_0000002 (step 2)" in text
    assert out["step"] == 6
    assert [s for s, _ in out["losses"]] == [3, 4, 5, 6]  # steps 3-4 were trained again


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_explicit_resume_of_a_corrupt_checkpoint_is_refused(run, corrupt, tmp_path):
    step4 = run / "checkpoints" / "step_0000004"
    name = corrupt(step4)
    before = snapshot(run)
    with pytest.raises(CheckpointError) as e:
        train(tmp_path / "other", "trainer.max_steps=6", f"resume={step4}")
    assert str(step4) in str(e.value) and name in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert snapshot(run) == before


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(run):
    for _, ckpt in list_complete(run / "checkpoints"):
        truncate(ckpt)
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_0000004.*step_0000002"):
        train(run, "trainer.max_steps=6")
    assert snapshot(run) == before


def test_verification_can_be_turned_off_and_dcp_still_refuses(run):
    # checkpoint.verify=false skips the hashes; a truncated shard then fails inside DCP,
    # still as one CheckpointError line (never a traceback, never silently wrong weights).
    truncate(run / "checkpoints" / "step_0000004")
    with pytest.raises(CheckpointError, match="could not be loaded"):
        train(
            run,
            "trainer.max_steps=6",
            "checkpoint.verify=false",
            f"resume={run}/checkpoints/step_0000004",
        )


def test_manifest_records_sha256_and_size_of_every_file(saved):
    ckpt = latest_complete(saved / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    on_disk = {p.name for p in ckpt.iterdir()} - {"manifest.json", "COMPLETE"}
    assert set(manifest["files"]) == on_disk == set(manifest["sizes"])
    assert all(len(h) == 64 for h in manifest["files"].values())


def test_cli_explicit_corrupt_resume_exits_2_naming_the_file(run, tmp_path):
    step4 = run / "checkpoints" / "step_0000004"
    name = flip_byte(step4)
    res = launch(*FAST, "trainer.max_steps=6", f"resume={step4}", f"hydra.run.dir={tmp_path}/x")
    assert res.returncode == 2, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert name in line and "corrupt" in line, line

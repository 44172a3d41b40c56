"""The manifest is signed by the COMPLETE marker, and a resume never overwrites newer checkpoints.

Found by a user: editing manifest.json's step from 6 to 3 made resume=auto start at step 3 and
overwrite the good step_0000004 and step_0000006; an edited data offset silently changed the
data. Now COMPLETE holds the manifest's sha256 and the manifest's step must match its folder:
resume=PATH refuses either (one line), resume=auto skips the folder naming why, falls back, and
keeps the skipped folder as `<name>.rejected`. resume=PATH to an older checkpoint of a run dir
that holds newer ones is refused unless checkpoint.overwrite_newer=true.
"""

import hashlib
import json
import shutil
import subprocess

import pytest

from dtrain.checkpoint import list_complete
from dtrain.errors import CheckpointError
from tests.conftest import train
from tests.faults.helpers import SAVES, snapshot, write_manifest

STEPS6 = ["trainer.max_steps=6", "checkpoint.keep_last=0", *SAVES]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run with complete checkpoints at steps 2, 4 and 6 (copied per test)."""
    run = tmp_path_factory.mktemp("trust") / "run"
    train(run, *STEPS6)
    assert [s for s, _ in list_complete(run / "checkpoints")] == [2, 4, 6]
    return run


@pytest.fixture
def run(saved, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


def edit_manifest(ckpt, change, resign: bool = False):
    """What the user did: load manifest.json, change(manifest), write it back (and, with
    resign, also rewrite COMPLETE to match, as a careful editor would)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    change(manifest)
    if resign:
        write_manifest(ckpt, manifest)
    else:
        (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_complete_holds_the_manifest_sha256_in_sha256sum_format(saved):
    ckpt = saved / "checkpoints" / "step_0000006"
    sha = hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest()
    assert (ckpt / "COMPLETE").read_text() == f"{sha}  manifest.json\n"
    if shutil.which("sha256sum"):  # the documented way to check it by hand
        subprocess.run(["sha256sum", "--quiet", "-c", "COMPLETE"], cwd=ckpt, check=True)


def test_user_edit_of_the_step_is_skipped_kept_and_never_overwritten(run, capfd):
    ckpts = run / "checkpoints"
    edit_manifest(ckpts / "step_0000006", lambda m: m.update(step=3))  # the user's edit
    bad = snapshot(ckpts / "step_0000006")
    capfd.readouterr()
    out = train(run, "trainer.max_steps=8", "checkpoint.keep_last=2", *SAVES)
    err = capfd.readouterr().err
    assert "step_0000006: manifest.json was edited or is corrupt" in err, err[-3000:]
    assert "falling back to step_0000004" in err
    assert "resumed from" in err and "step_0000004 (step 4)" in err
    assert "kept the skipped checkpoint step_0000006 as step_0000006.rejected" in err
    assert [s for s, _ in out["losses"]] == [5, 6, 7, 8]  # from 4, not from the edited 3
    # The evidence is kept as it was: not overwritten by the new step 6, nor pruned.
    assert snapshot(ckpts / "step_0000006.rejected") == bad
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step_0000006",
        "step_0000006.rejected",
        "step_0000008",
    ]


def test_edited_data_offset_is_refused(run, tmp_path):
    ckpt = run / "checkpoints" / "step_0000006"

    def skip_ahead(m):  # stream 0's position in its documents: the run would read other data
        m["data"]["streams"]["0"]["off"] += 64

    edit_manifest(ckpt, skip_ahead)
    before = snapshot(run)
    with pytest.raises(CheckpointError) as e:
        train(tmp_path / "other", "trainer.max_steps=8", f"resume={ckpt}")
    assert str(e.value) == (
        f"checkpoint {ckpt}: manifest.json was edited or is corrupt (its sha256 differs from "
        "the one in COMPLETE)"
    )
    assert snapshot(run) == before


def test_a_resigned_step_that_disagrees_with_its_folder_is_refused(run, tmp_path, capfd):
    ckpt = run / "checkpoints" / "step_0000006"
    edit_manifest(ckpt, lambda m: m.update(step=3), resign=True)
    with pytest.raises(CheckpointError) as e:
        train(tmp_path / "other", "trainer.max_steps=8", f"resume={ckpt}")
    assert "manifest.json says step 3 but the folder is step_0000006" in str(e.value)
    capfd.readouterr()
    train(run, "trainer.max_steps=8", *SAVES)
    err = capfd.readouterr().err
    assert "says step 3 but the folder is step_0000006; falling back to step_0000004" in err


def test_complete_without_a_manifest_is_named_not_called_unmarked(run, tmp_path, capfd):
    ckpt = run / "checkpoints" / "step_0000006"
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as e:
        train(tmp_path / "other", "trainer.max_steps=8", f"resume={ckpt}")
    assert "manifest.json is missing (its COMPLETE marker is there" in str(e.value)
    assert "no COMPLETE marker" not in str(e.value)
    capfd.readouterr()
    out = train(run, "trainer.max_steps=8", *SAVES)
    err = capfd.readouterr().err
    assert "step_0000006: manifest.json is missing" in err and "falling back to step_0000004" in err
    assert out["losses"][0][0] == 5


def test_legacy_marker_is_accepted_with_a_warning(run, capfd):
    ckpt = run / "checkpoints" / "step_0000006"
    (ckpt / "COMPLETE").write_text("ok\n")  # what dtrain wrote before the checksum
    capfd.readouterr()
    out = train(run, "trainer.max_steps=8", *SAVES)
    err = capfd.readouterr().err
    assert err.count("was saved by an older dtrain") == 1, err[-3000:]
    assert "step_0000006 (step 6)" in err and out["losses"][0][0] == 7


def test_resume_of_an_older_checkpoint_is_refused_while_newer_ones_exist(run):
    before = snapshot(run)
    with pytest.raises(CheckpointError) as e:
        train(run, "trainer.max_steps=6", f"resume={run}/checkpoints/step_0000002", *SAVES)
    msg = str(e.value)
    assert "starts at step 2" in msg and "(step_0000004, step_0000006)" in msg, msg
    assert "checkpoint.overwrite_newer=true" in msg and "\n" not in msg
    assert snapshot(run) == before


def test_overwrite_newer_deletes_them_and_the_run_goes_on_from_the_resume_point(run, capfd):
    ckpts = run / "checkpoints"
    old6 = snapshot(ckpts / "step_0000006")
    capfd.readouterr()
    out = train(
        run,
        *STEPS6,
        "optim.lr=1e-3",  # another timeline from step 4 on
        f"resume={ckpts}/step_0000004",
        "checkpoint.overwrite_newer=true",
    )
    err = capfd.readouterr().err
    assert "deleted checkpoint" in err and "step_0000006, newer than the resume point" in err
    assert [s for s, _ in out["losses"]] == [5, 6]
    assert [s for s, _ in list_complete(ckpts)] == [2, 4, 6]
    assert snapshot(ckpts / "step_0000006") != old6
    manifest = json.loads((ckpts / "step_0000006" / "manifest.json").read_text())
    assert manifest["config"]["optim"]["lr"] == 1e-3

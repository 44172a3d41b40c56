"""checkpoint.async_save: the loop goes on while a checkpoint is written, and every promise of the
synchronous save still holds (docs/reliability.md).

- What is saved is the state of the save's step, byte for byte what a synchronous save writes,
  and a run resumed from it trains on bit-exactly (one process, and fsdp on 2 ranks).
- COMPLETE is written only once every file the manifest lists is fsynced (sync and async).
- A kill -9 while an async save is being written resumes from the last complete checkpoint; the
  half-written folder is never loaded, and keep_last never removed its predecessor.
- A failed background write ends the run with the synchronous save's line and exit code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dtrain.checkpoint.host_memory as host_memory
import dtrain.checkpoint.manager as manager
from dtrain import host_staging
from dtrain.checkpoint import MANIFEST, MARKER, CheckpointManager, CheckpointSaveError
from dtrain.config import CheckpointConfig
from dtrain.errors import ConfigError
from dtrain.reliability import faults
from tests.conftest import FAST, ROOT, launch, read_jsonl, train, train_losses
from tests.faults.helpers import SAVES, check_and_resume, kill_tree, one_error_line, start

EVERY_4 = [
    "trainer.max_steps=8",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint.every_n_steps=4",
    "checkpoint.keep_last=0",
]
ASYNC = "checkpoint.async_save=true"


def shards(run: Path, step: int, suffix: str = "") -> dict[str, str]:
    """sha256 of a checkpoint's files ending in `suffix`, but .metadata (which names the
    folder it was written in)."""
    files = json.loads((run / f"checkpoints/step_{step:07d}" / MANIFEST).read_text())["files"]
    return {n: sha for n, sha in files.items() if n != ".metadata" and n.endswith(suffix)}


def checkpoint_records(run: Path) -> list[dict]:
    return [r["checkpoint"] for r in read_jsonl(run / "metrics.jsonl") if "checkpoint" in r]


def _logged_step(run: Path) -> int:
    """The last training step in metrics.jsonl, read while the run writes it."""
    path, step = run / "metrics.jsonl", 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        step = max(step, rec["step"] if "loss" in rec else 0)
    return step


# fp8's delayed scaling: each rank's amax histories, which steps 5 and 6 roll, are saved too.
FP8_DELAYED = ["precision=fp8", "precision.fp8_emulate=true", "precision.fp8_scaling=delayed"]


def histories(run: Path, step: int) -> torch.Tensor | None:
    """Rank 0's fp8 amax histories in the checkpoint of `step`, stacked; None where none."""
    path = run / f"checkpoints/step_{step:07d}/extra_rank0.pt"
    rank = torch.load(path, weights_only=True)["rank"]
    return torch.stack(list(rank["precision"]["history"].values())) if rank else None


@pytest.mark.parametrize("precision", [[], FP8_DELAYED], ids=["fp32", "fp8-delayed"])
def test_async_checkpoint_is_the_save_steps_state_while_the_loop_goes_on(
    tmp_path, monkeypatch, precision
):
    if precision and importlib.util.find_spec("torchao") is None:
        pytest.skip("fp8 needs torchao")
    train(tmp_path / "sync", *EVERY_4, *precision)

    # DCP is about to write step 4's shards: hold it until the loop has trained steps 5 and 6,
    # which change every weight and moment in place. A loop that waited for the write would
    # never get there (the test would fail after 60 s).
    real_point, writer_threads = faults.point, []

    def point(name: str, *, step: int | None = None) -> None:
        if name == "ckpt.save.write" and step == 4:
            writer_threads.append(threading.current_thread().name)
            deadline = time.time() + 60
            while _logged_step(tmp_path / "async") < 6 and time.time() < deadline:
                time.sleep(0.01)
        real_point(name, step=step)

    monkeypatch.setattr(faults, "point", point)
    train(tmp_path / "async", *EVERY_4, ASYNC, *precision)
    monkeypatch.setattr(faults, "point", real_point)
    assert writer_threads and writer_threads[0] != threading.main_thread().name
    recs = checkpoint_records(tmp_path / "async")
    assert [(r["path"], r["async"]) for r in recs] == [
        ("step_0000004", True),
        ("step_0000008", False),  # the end of the run has nothing to overlap: a plain save
    ]
    assert recs[0]["done_at_step"] >= 6
    assert all(r["stall_s"] > 0 and r["save_s"] > 0 for r in recs)
    for r in recs:  # the parts of the stall: taking and checking the state, DCP's call
        assert (
            0 < r["snapshot_s"] and 0 < r["dcp_s"] and r["snapshot_s"] + r["dcp_s"] <= r["stall_s"]
        )
    # The async save's stall at the save itself, before any later wait for its write.
    a = recs[0]
    assert a["snapshot_s"] + a["dcp_s"] <= a["at_save_s"] <= a["stall_s"]
    # Byte for byte what the synchronous save wrote: the shards, the RNG state, the data position.
    for step in (4, 8):
        assert shards(tmp_path / "async", step) == shards(tmp_path / "sync", step), step

    def position(run: str) -> dict:
        path = tmp_path / run / "checkpoints/step_0000004" / MANIFEST
        return json.loads(path.read_text())["data"]

    assert position("async") == position("sync")
    # The rank's own state (fp8: the histories as step 4 left them, not as steps 5-6 rolled them)
    for step in (4, 8):
        a, b = histories(tmp_path / "async", step), histories(tmp_path / "sync", step)
        assert (a is None) == (b is None) == (not precision)
        assert a is None or (torch.equal(a, b) and float(a.abs().sum()) > 0), step

    # Resumed from the async checkpoint, the run trains on exactly as the synchronous one did.
    resume = f"resume={tmp_path}/async/checkpoints/step_0000004"
    train(tmp_path / "resumed", *EVERY_4, ASYNC, resume, *precision)
    a, b = train_losses(tmp_path / "sync"), train_losses(tmp_path / "resumed")
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[s] == b[s] for s in b), (a, b)
    # The weights and moments (the RNG state is not restored bit-exactly by any resume: code
    # after the load draws from it again, and no training step uses it).
    assert shards(tmp_path / "resumed", 8, ".distcp") == shards(tmp_path / "sync", 8, ".distcp")

    # bench/ckpt_stall.py reads the same records (bench/async_ckpt.sh runs it on GPUs).
    spec = importlib.util.spec_from_file_location("ckpt_stall", ROOT / "bench/ckpt_stall.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.compare(tmp_path / "sync", tmp_path / "async")
    assert out["sync"]["async"] == [False, False] and out["async"]["async"] == [True, False]
    assert out["stall_ratio"] > 0


def test_async_saves_reuse_one_set_of_host_buffers(tmp_path, monkeypatch):
    # On CUDA every async save stages into the pinned host buffers made at the first one
    # (the writer's cache_staged_state_dict), made as one page-locked allocation. Here the
    # same path runs on CPU (page-locking made a no-op): two async saves, each the bytes a
    # synchronous save of its step writes, and the second copied into the first's buffers,
    # not into new ones.
    from torch.distributed.checkpoint.staging import BlockingAsyncStager
    from torch.utils._pytree import tree_leaves

    twelve = [a for a in EVERY_4 if not a.startswith("trainer.max_steps")]
    twelve.append("trainer.max_steps=12")
    train(tmp_path / "sync", *twelve)
    real_stage, staged = BlockingAsyncStager.stage, []

    def stage(self, state_dict):
        out = real_stage(self, state_dict)
        staged.append((id(self), self.cache_staged_state_dict, out))
        return out

    pinned = []
    monkeypatch.setattr(manager, "pinned_staging", lambda: True)
    monkeypatch.setattr(host_staging, "_pin", lambda flat: pinned.append(flat.numel()))
    monkeypatch.setattr(BlockingAsyncStager, "stage", stage)
    train(tmp_path / "async", *twelve, ASYNC)
    recs = checkpoint_records(tmp_path / "async")
    assert [(r["path"], r["async"]) for r in recs] == [
        ("step_0000004", True),
        ("step_0000008", True),
        ("step_0000012", False),
    ]
    assert len(staged) == 2 and staged[0][0] == staged[1][0]  # one writer
    assert staged[0][1]  # cache_staged_state_dict: its buffers, kept
    first, second = (
        [t.data_ptr() for t in tree_leaves(out) if torch.is_tensor(t)] for *_, out in staged
    )
    assert first == second and len(first) > 10
    # ... all of them views into the one buffer page-locked once (dtrain.host_staging)
    leaves = [t for t in tree_leaves(staged[0][2]) if torch.is_tensor(t) and t.dim()]
    storages = {t.untyped_storage().data_ptr() for t in leaves}
    assert len(pinned) == 1 and len(storages) == 1
    for step in (4, 8, 12):
        assert shards(tmp_path / "async", step) == shards(tmp_path / "sync", step), step


def test_fsdp_async_checkpoint_resumes_bit_exactly(tmp_path):
    # fsdp on 2 ranks: DTensor shards staged, written by DCP's thread on a gloo group of their
    # own while the loop's collectives go on; the write of step 4 is held back 1.5 s.
    args = [*FAST, "strategy=fsdp", *EVERY_4, ASYNC]
    slow = {"DTRAIN_FAULT": "ckpt.save.write=sleep#4", faults.SLEEP_ENV: "1.5"}
    res = launch(*args, f"hydra.run.dir={tmp_path}/straight", nproc=2, env_extra=slow)
    assert res.returncode == 0, res.stderr[-3000:]
    resume = f"resume={tmp_path}/straight/checkpoints/step_0000004"
    res = launch(*args, resume, f"hydra.run.dir={tmp_path}/resumed", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = checkpoint_records(tmp_path / "straight")
    assert [(r["path"], r["async"]) for r in recs] == [
        ("step_0000004", True),
        ("step_0000008", False),
    ]
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[s] == b[s] for s in b), (a, b)
    assert shards(tmp_path / "resumed", 8, ".distcp") == shards(tmp_path / "straight", 8, ".distcp")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_complete_is_written_only_once_every_file_is_on_disk(tmp_path, monkeypatch, mode):
    synced: dict[str, str] = {}  # path -> sha256 of its bytes when it was fsynced
    real_fsync, real_write = os.fsync, manager.write_atomic

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        is_file = os.path.isfile(path)
        synced[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest() if is_file else "dir"

    markers = []  # (folder, files whose bytes were not fsynced as the manifest lists them)

    def write_atomic(path: Path, text: str) -> None:
        if path.name == MARKER:
            folder = os.path.realpath(path.parent)
            files = json.loads((path.parent / MANIFEST).read_text())["files"]
            unsynced = [n for n, sha in files.items() if synced.get(f"{folder}/{n}") != sha]
            markers.append((path.parent.name, unsynced, synced.get(folder) == "dir"))
        real_write(path, text)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(manager, "write_atomic", write_atomic)
    extra = [ASYNC] if mode == "async" else []
    train(tmp_path / "run", "trainer.max_steps=6", "checkpoint.keep_last=0", *SAVES, *extra)
    names = [f"step_{s:07d}.partial" for s in (2, 4, 6)]
    assert markers == [(name, [], True) for name in names]


def test_kill_during_an_async_save_resumes_from_the_last_complete_one(tmp_path, capfd):
    # fsdp on 2 ranks, keep_last=1: the save of step 4 has written its shards and .metadata and
    # waits (its writer threads sleep) while the loop trains on; rank 1 is killed as its sleep
    # ends, before the save's commit. (Killed at a later step instead, rank 1 could die before
    # its writer had joined DCP's own gather, with no .metadata: a flake on a loaded box.)
    run = tmp_path / "run"
    spec = "ckpt.save.after_dcp=sleep#4,ckpt.save.after_dcp=kill@1#4"
    args = ["strategy=fsdp", "trainer.max_steps=8", "checkpoint.keep_last=1", ASYNC, *SAVES]
    env = {"DTRAIN_FAULT": spec, faults.SLEEP_ENV: "5"}
    proc = start(*args, f"hydra.run.dir={run}", nproc=2, env_extra=env)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode != 0, err[-2000:]
    assert "DTRAIN_FAULT: kill rank 1 at ckpt.save.after_dcp, step 4" in err, err[-3000:]
    assert 5 in train_losses(run)  # the loop went on while step 4 was being written
    partial = run / "checkpoints/step_0000004.partial"
    written = {p.name for p in partial.iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= written, written
    assert not written & {MANIFEST, MARKER}, written
    # keep_last=1 kept step 2 (the last complete one) and resume=auto takes it, not step 4.
    assert check_and_resume(run, capfd, full_resume=True) == 2


def test_a_background_write_error_is_the_sync_line_and_exit_code(tmp_path, monkeypatch):
    fault = {"DTRAIN_FAULT": "ckpt.save.after_dcp=enospc#4"}
    args = ["trainer.max_steps=6", *SAVES]
    monkeypatch.setenv("DTRAIN_FAULT", fault["DTRAIN_FAULT"])
    with pytest.raises(CheckpointSaveError) as sync_error:
        train(tmp_path / "sync", *args)
    monkeypatch.delenv("DTRAIN_FAULT")
    run = tmp_path / "async"
    res = launch(*FAST, *args, ASYNC, f"hydra.run.dir={run}", env_extra=fault, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]  # and it ended: nothing left waiting
    assert one_error_line(res.stderr) == f"error: {sync_error.value}"
    assert "step_0000004 could not be saved: [Errno 28] No space left" in str(sync_error.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002"]


def test_torch_without_async_save_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delattr(dcp, "async_save")
    with pytest.raises(ConfigError, match="checkpoint.async_save=true needs") as e:
        CheckpointManager(tmp_path, CheckpointConfig(async_save=True), rank=0, world_size=1)
    assert "\n" not in str(e.value)


def _refuse_pinning(flat):
    raise RuntimeError("cudaHostRegister of 0.00 GiB failed (2)")


@pytest.mark.parametrize("host_gib", [1024.0, 0.001], ids=["fits", "does-not-fit"])
def test_async_by_default_on_a_gpu_where_host_memory_holds_the_buffers(
    host_gib, tmp_path, monkeypatch, capfd
):
    # checkpoint.async_save unset: on a GPU (here: CPU made to look like one, page-locking a
    # no-op) periodic saves go in the background where the node's available memory holds the
    # pinned buffers, and stay synchronous, said in one warning, where it does not.
    monkeypatch.setattr(manager, "pinned_staging", lambda: True)
    monkeypatch.setattr(host_staging, "_pin", lambda flat: None)
    monkeypatch.setattr(manager, "available_host_bytes", lambda: int(host_gib * 1024**3))
    train(tmp_path, *EVERY_4)
    fits = host_gib > 1
    assert [r["async"] for r in checkpoint_records(tmp_path)] == [fits, False]  # 4, final 8
    out, err = capfd.readouterr()  # the run's own log handler writes there
    assert (out + err).count("checkpoints are written synchronously") == (0 if fits else 1)


def test_async_is_off_by_default_without_a_gpu(tmp_path):
    train(tmp_path, *EVERY_4)
    assert [r["async"] for r in checkpoint_records(tmp_path)] == [False, False]


def test_async_saves_fall_back_to_sync_where_pinning_fails(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(manager, "pinned_staging", lambda: True)
    monkeypatch.setattr(host_staging, "_pin", _refuse_pinning)
    train(tmp_path, *EVERY_4, ASYNC)  # asked for explicitly: still nothing pinned, nothing lost
    assert [r["async"] for r in checkpoint_records(tmp_path)] == [False, False]
    out, err = capfd.readouterr()
    assert (out + err).count("could not be pinned") == 1


def test_available_host_memory_is_the_cgroups_where_it_is_less(tmp_path, monkeypatch):
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(host_memory, "CGROUP_MEMORY", ((str(limit), str(usage)),))
    limit.write_text("max\n")  # no limit: the host's MemAvailable
    usage.write_text(str(5 * 2**30))
    host = host_memory.available_host_bytes()
    assert host is not None and host > 0
    limit.write_text(str(6 * 2**30))  # a 6 GiB limit with 5 used: 1 GiB left
    assert host_memory.available_host_bytes() == min(host, 2**30)

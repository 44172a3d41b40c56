"""Helpers shared by the fault-injection suite (see docs/reliability.md)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import FAST, ROOT, cli_env, launch_cmd, train

# A run that saves at steps 2 and 4 quickly, with every step logged.
SAVES = ["trainer.eval_every=0", "trainer.log_every=1", "checkpoint.every_n_steps=2"]


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under root -> (size, sha256): what "nothing changed" compares."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (
                p.stat().st_size,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return out


def write_manifest(ckpt: Path, manifest: dict) -> None:
    """Rewrite a checkpoint's manifest.json and sign it in COMPLETE, as dtrain does: what an
    attacker (or a careful hand editor) can always do, so the loader must not rely on it."""
    import json

    text = json.dumps(manifest, indent=1, sort_keys=True)
    (Path(ckpt) / "manifest.json").write_text(text)
    sha = hashlib.sha256(text.encode()).hexdigest()
    (Path(ckpt) / "COMPLETE").write_text(f"{sha}  manifest.json\n")


def edit_manifest(ckpt: Path, where: str, value) -> None:
    """Set the manifest's field at dotted path `where` (e.g. config.model) to `value`, and
    re-sign it."""
    import json

    manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
    *parents, last = where.split(".")
    node = manifest
    for key in parents:
        node = node[key]
    node[last] = value
    write_manifest(ckpt, manifest)


def replace_signed(ckpt: Path, name: str, data: bytes) -> None:
    """Replace the checkpoint's file `name` with `data` and re-sign its sha256 and size."""
    import json

    (Path(ckpt) / name).write_bytes(data)
    manifest = json.loads((Path(ckpt) / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    manifest["sizes"][name] = len(data)
    write_manifest(ckpt, manifest)


def run_command(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command as a user would (the repo's environment), to the end or `timeout`."""
    return subprocess.run(
        cmd, capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=timeout
    )


def start(*args: str, nproc: int = 1, env_extra: dict | None = None) -> subprocess.Popen:
    """Start launch/train.py (or torchrun with nproc ranks) without waiting for it."""
    cmd = launch_cmd([*FAST, *args], nproc)
    env = cli_env()
    env.update(env_extra or {})
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def descendants(pid: int) -> list[int]:
    """All processes below pid (torchrun's workers live in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL proc and everything below it, by pid (only what this test started)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until metrics.jsonl records `step` (the run is in its loop)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended early: {proc.returncode}\n{proc.stderr.read()[-3000:]}"
            )
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def check_and_resume(run: Path, capfd, full_resume: bool) -> int:
    """After a crash in a save: every folder that looks complete verifies, the newest complete
    one survives (keep_last never removed it first) and is what resume=auto picks; with
    `full_resume`, a run (single, micro-batch 8: the global batch of 2 ranks x 4) resumes from
    it to step 5. Returns its step."""
    from dtrain.checkpoint import CheckpointManager, is_complete, latest_complete, verify
    from dtrain.config import CheckpointConfig

    ckpts = run / "checkpoints"
    for p in ckpts.iterdir():
        if p.name.startswith("step_") and "." not in p.name:  # looks final: must be whole
            assert is_complete(p), p
            verify(p, CheckpointManager.read_manifest(p))
    latest = latest_complete(ckpts)
    assert latest is not None, "keep_last deleted the last complete checkpoint"
    step = int(latest.name.split("_")[1])
    # What resume=auto will pick (the same call the loop makes), checksums included.
    cfg = CheckpointConfig(keep_last=1)
    picked, _ = CheckpointManager(run, cfg, rank=0, world_size=1).find_resumable()
    assert picked == latest
    if not full_resume:
        return step
    capfd.readouterr()
    out = train(run, "trainer.max_steps=5", "trainer.micro_batch_size=8", *SAVES[:2])
    err = capfd.readouterr().err
    assert f"resumed from {latest} (step {step})" in err, err[-2000:]
    assert out["step"] == 5
    return step


def one_error_line(stderr: str) -> str:
    """The run's error line; asserts it is alone (no traceback) and well formed."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) >= 1, stderr[-3000:]
    return lines[0]


__all__ = [
    "ROOT",
    "SAVES",
    "snapshot",
    "start",
    "kill_tree",
    "descendants",
    "rank_of",
    "check_and_resume",
]

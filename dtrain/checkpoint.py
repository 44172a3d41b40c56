"""Checkpoints: when to save, atomic save, discovery of the newest complete one, resume.

Layout of one checkpoint (torch.distributed.checkpoint, one shard file per rank):

    checkpoints/step_0000100/
        __0_0.distcp ...      model + optimizer shards (DCP)
        .metadata             DCP's index of the shards
        extra_rank{r}.pt      per-rank RNG states (weights_only-loadable)
        manifest.json         step, run identity, data position, sha256 of every file
        COMPLETE              the marker, written last

A checkpoint is written under `step_NNNNNNN.partial/` and renamed to `step_NNNNNNN/` only after
every rank has finished and the manifest and marker are on disk: a crash at any point leaves
either the previous checkpoint set or a `.partial` folder that discovery ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from dtrain import dist as ddist
from dtrain import faults
from dtrain.config import CheckpointConfig
from dtrain.errors import CheckpointError

# DCP warns on every save/load without a process group; a single process is intended there.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / MANIFEST).is_file()


def list_complete(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ckpt_root, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_complete(ckpt_root: Path) -> Path | None:
    found = list_complete(ckpt_root)
    return found[-1][1] if found else None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, rank: int, world_size: int):
        self.root = Path(run_dir) / "checkpoints"
        self.cfg, self.rank, self.world_size = cfg, rank, world_size

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0

    # --- save --------------------------------------------------------------------------
    def save(self, step: int, state: dict, manifest: dict) -> Path:
        """Save `state` (DCP state dict) at `step`. Collective: every rank calls it."""
        import torch.distributed.checkpoint as dcp

        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # left by a crash: never part of a complete checkpoint
                shutil.rmtree(partial)
            partial.mkdir()
        ddist.barrier()
        dcp.save(state, checkpoint_id=str(partial))
        faults.point("ckpt.save.after_dcp", step=step)  # shards on disk, not yet complete
        extra_path = partial / f"extra_rank{self.rank}.pt"
        torch.save({"rng": rng_state()}, extra_path)
        # Each rank hashes the files it wrote; rank 0 gathers them into the manifest.
        mine = [extra_path] + sorted(partial.glob(f"__{self.rank}_*.distcp"))
        hashes = {p.name: sha256_file(p) for p in mine}
        all_hashes = ddist.all_gather_object(hashes)
        if self.rank == 0:
            faults.point("ckpt.save.after_hash", step=step)
            files = {}
            for h in all_hashes:
                files.update(h)
            if (partial / ".metadata").exists():
                files[".metadata"] = sha256_file(partial / ".metadata")
            manifest = {**manifest, "step": step, "world_size": self.world_size, "files": files}
            _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            _write_atomic(partial / MARKER, "ok\n")
            if final.exists():  # an older save of the same step (e.g. rerun): replace it
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._prune()
        ddist.barrier()
        return final

    def _prune(self) -> None:
        """Keep the newest keep_last complete checkpoints; called only after a new one is
        complete, so the last complete checkpoint is never deleted before its successor."""
        # A .partial folder here is left by a save that died (saves never overlap): drop it.
        for stale in self.root.glob("step_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last <= 0:
            return
        complete = list_complete(self.root)
        for _, path in complete[: -self.cfg.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    # --- load --------------------------------------------------------------------------
    @staticmethod
    def read_manifest(path: Path) -> dict:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist")
        if (path / "latest").is_file() or any(path.glob("global_step*")):
            # engine.save_checkpoint's layout: its ZeRO partitions are laid out for one world
            # size and DeepSpeed version; dtrain's zero1/2/3 write the common format instead.
            raise CheckpointError(
                f"checkpoint {path} is a native DeepSpeed checkpoint, not a dtrain one; "
                f"consolidate its weights with DeepSpeed's `python {path}/zero_to_fp32.py {path} "
                "OUT_DIR` and start a new run from them (dtrain's zero1/2/3 save its own format)"
            )
        if not is_complete(path):
            raise CheckpointError(
                f"checkpoint {path} is incomplete (no {MARKER} marker): it was interrupted "
                f"while being written; resume from an earlier one or use resume=auto"
            )
        try:
            return json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({e})") from None

    def load(self, path: Path, state: dict) -> dict:
        """Load into `state` (a DCP state dict template) in place; return the manifest."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        manifest = self.read_manifest(path)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP raises CheckpointException wrapping each rank's error
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from None
        extra = path / f"extra_rank{self.rank}.pt"
        if manifest.get("world_size") == self.world_size and extra.exists():
            set_rng_state(torch.load(extra, weights_only=True)["rng"])
        return manifest

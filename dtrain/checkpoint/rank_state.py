"""A rank's own state in a checkpoint (extra_rank{r}.pt): its RNG state, taken, checked and
applied, and what the rank kept besides (e.g. fp8 delayed scaling's amax histories), read as
plain values only."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dtrain.errors import CheckpointError


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# torch's generator states: the CPU one (mt19937) is a fixed-size uint8 tensor, CUDA's (Philox)
# its seed and offset, two 8-byte integers.
_CPU_RNG_BYTES = torch.get_rng_state().numel()
_CUDA_RNG_BYTES = 16


def rng_problem(state: object) -> str | None:
    """What is wrong with a saved rng_state() (one line), or None: checked before any of it is
    applied, as torch.set_rng_state would fail or crash on a state of the wrong shape."""
    if not isinstance(state, dict) or "torch" not in state:
        return "its RNG state is not a dict holding 'torch'"
    for key, t in state.items():
        size = {"torch": _CPU_RNG_BYTES, "cuda": _CUDA_RNG_BYTES}.get(key)
        if size is None:
            return f"its RNG state holds an unknown generator {key!r}"
        if type(t) is not torch.Tensor or t.dtype != torch.uint8 or t.shape != (size,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"its {key} RNG state is not {size} uint8 bytes (got {got})"
    return None


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


EXTRA_RE = re.compile(r"^extra_rank\d+\.pt$")
RANK_STATE_MAX_BYTES = 1 << 30  # RNG states and fp8's amax histories: kilobytes


def read_rank_state(path: Path, name: str) -> tuple[dict, dict | None]:
    """A rank's (RNG state, own state) from its extra_rank{r}.pt, read as plain values and
    checked; CheckpointError naming the file otherwise."""
    # lazily: safe_load imports torch.distributed.checkpoint, most of a second
    from dtrain.checkpoint.safe_load import RefusedObject, load_plain_file

    try:
        saved = load_plain_file(path / name, RANK_STATE_MAX_BYTES)
    except RefusedObject as e:
        raise CheckpointError(
            f"checkpoint {path}: {name} holds more than tensors, refused to unpickle it ({e.what})"
        ) from None
    why = "it is not a dict holding 'rng'" if not isinstance(saved, dict) else None
    why = why or rng_problem(saved.get("rng"))
    rank_state = saved.get("rank") if not why else None
    if not why and rank_state is not None and not isinstance(rank_state, dict):
        why = f"its rank state is a {type(rank_state).__name__}, not a dict"
    if why:
        raise CheckpointError(f"checkpoint {path}: {name} is malformed: {why}")
    return saved["rng"], rank_state or None

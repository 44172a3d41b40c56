"""Reading a DCP checkpoint without running code from it: the one way dtrain loads one.

DCP pickles twice. Its `.metadata` index is read with `pickle.load`: dtrain.checkpoint's
`check_metadata` reads it first with an unpickler that admits DCP's own metadata classes only.
And every non-tensor value of a state dict (the optimizer's `param_groups`: lr, betas, flags,
parameter names) is a pickled item inside the `.distcp` shards, which DCP's DefaultLoadPlanner
reads back with torch.load, weights_only off: an object whose `__reduce__` runs a command would
run. The planners here read those items with `plain_value` instead:
`torch.load(weights_only=True)`, then a check that what came back is plain values and tensors.

Every loader (resume under any strategy, generate, export) goes through `load_into` or
`load_all`, and through `check_objects` before it uses a checkpoint. Imported lazily: importing
torch.distributed.checkpoint takes most of a second.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from dtrain.errors import CheckpointError

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device)
_CONTAINERS = (dict, OrderedDict, list, tuple, set, frozenset, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


class RefusedObject(Exception):
    """A pickled item that is not a plain value; raised inside DCP, turned into a
    CheckpointError by load_into / load_all."""

    def __init__(self, key: str, what: str):
        super().__init__(key, what)
        self.key, self.what = key, what


def _not_plain(obj: Any) -> str | None:
    """The type name of the first part of obj that is not a plain value or tensor, or None.
    Exact types: a subclass of dict or list may carry code of its own."""
    todo = [obj]
    while todo:
        x = todo.pop()
        t = type(x)
        if t in _SCALARS or t in _TENSORS:
            continue
        if t not in _CONTAINERS:
            return f"{t.__module__}.{t.__qualname__}"
        todo.extend(x.items() if isinstance(x, dict) else x)
    return None


def plain_value(data: bytes, key: str) -> Any:
    """The value torch.save wrote into `data`, if it holds plain values and tensors only;
    else RefusedObject naming what it holds."""
    try:
        # Names the offending global (e.g. os.system) without unpickling anything.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # not a torch.save file at all: torch.load below says what it is
        unsafe = []
    if unsafe:
        raise RefusedObject(key, f"object of type {sorted(unsafe)[0]}")
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise RefusedObject(key, f"item that is not a plain value ({first})") from None
    # weights_only also admits classes libraries register (torchao's tensor subclasses, DTensor
    # placements): a checkpoint's non-tensor state never needs them.
    bad = _not_plain(obj)
    if bad is not None:
        raise RefusedObject(key, f"object of type {bad}")
    return obj


class _PlainBytes:
    """load_bytes of DefaultLoadPlanner, reading with plain_value instead of torch.load."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        key = read_item.dest_index.fqn
        obj = plain_value(value.read(), key)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj


class SafeLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    """Loads into a given state dict (resume, the model for generate and export)."""


class SafeEmptyLoadPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the checkpoint (export format=torch)."""


def _causes(e: BaseException) -> list[BaseException]:
    """The errors inside DCP's CheckpointException ({rank: (exception, traceback)}), or e."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return [e]
    return [w[0] if isinstance(w, tuple) else getattr(w, "exc", w) for w in failures.values()]


def _as_checkpoint_error(e: BaseException, path: Path) -> CheckpointError:
    causes = _causes(e)
    refused = next((c for c in causes if isinstance(c, RefusedObject)), None)
    if refused is not None:
        return CheckpointError(
            f"checkpoint {path}: state '{refused.key}' holds a pickled {refused.what}; "
            "refused to load it (dtrain checkpoints hold tensors and plain values only)"
        )
    lines = str(causes[0]).strip().splitlines() or [type(causes[0]).__name__]
    # torch.load's refusals put the cause on a line of its own, after the advice
    why = next((ln.strip() for ln in lines if "Unsupported global" in ln), lines[0])
    return CheckpointError(f"checkpoint {path} could not be loaded: {why}")


def load_into(path: str | Path, state: dict) -> None:
    """dcp.load into `state` in place (collective under torchrun), pickled items read safely.
    The caller has run check_metadata: DCP unpickles .metadata itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        raise _as_checkpoint_error(e, Path(path)) from None


def load_all(path: str | Path, keys: set[str] | None = None) -> dict:
    """Everything the checkpoint holds (or the flattened `keys` only), as a nested state dict,
    in this process alone (no collectives). The caller has run check_metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    # dcp.load cannot fill an empty dict (it copies back only the keys it was given), so this
    # is what dcp_to_torch_save does, with the safe planner.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:
        _load_state_dict(
            state, FileSystemReader(str(path)), planner=SafeEmptyLoadPlanner(keys), no_dist=True
        )
    except (Exception, CheckpointException) as e:
        raise _as_checkpoint_error(e, Path(path)) from None
    return state


def check_objects(path: str | Path) -> None:
    """Read every pickled item of the checkpoint (a few small values) and refuse it if one is
    not plain: resume=auto then falls back past it, and every loader refuses it alike, even
    one that would not read that item."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if keys:
        load_all(path, keys)

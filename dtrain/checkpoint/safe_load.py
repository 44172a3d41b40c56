"""Reading a DCP checkpoint without running code from it: the one way dtrain loads one, and the
one place that decides what may be unpickled.

DCP pickles twice. Its `.metadata` index, which DCP reads with `pickle.load`, is read here by
`SafeFileSystemReader` instead, with an unpickler that admits an exact list of (module, name)
pairs (DCP's metadata classes, torch.Size, dtypes, paths) and no attribute of them: pickle
protocol 4 resolves a dotted name attribute by attribute, and `Metadata.__init__.__globals__`
leads anywhere. The reader opens only regular files the manifest lists (no link, FIFO, device or
directory; never blocking on an open). And every non-tensor value of a state dict (the
optimizer's `param_groups`: lr, betas, flags, parameter names) is a pickled item inside the
`.distcp` shards, which DCP's DefaultLoadPlanner reads back with torch.load, weights_only off:
an object whose `__reduce__` runs a command would run. The planners here read those items with
`plain_value` instead: `torch.load(weights_only=True)` (whose unpickler looks globals up by
exact name too), then a check that what came back is plain values and tensors.

Every loader (resume under any strategy, generate, export) goes through `load_into` or
`load_all`, and through `check_objects` before it uses a checkpoint. Imported lazily: importing
torch.distributed.checkpoint takes most of a second.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools
from collections import OrderedDict
from collections.abc import Collection
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from dtrain.checkpoint.files import open_regular, read_regular
from dtrain.checkpoint.manifest import read_manifest
from dtrain.errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global DCP's .metadata may name, as exact (module, name) pairs; any other name, a dotted
# one included, is refused before it is looked up.
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup in torch's table of layouts
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
    | {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
)
# Opcodes that reach objects without find_class (copyreg's extension cache, persistent ids).
_REFUSED_OPCODES = frozenset({"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})
METADATA_MAX_BYTES = 1 << 30  # DCP's index of a 405B model's shards is a few MB


class SafeUnpickler(pickle.Unpickler):
    """Admits the globals of `allowed` only, by exact (module, name): no dotted name resolves."""

    def __init__(self, file, allowed: frozenset = METADATA_GLOBALS):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id")


def safe_unpickle(data: bytes, allowed: frozenset = METADATA_GLOBALS) -> Any:
    """The object pickled in `data`, if it names only `allowed` globals; else UnpicklingError."""
    for op, _, _ in pickletools.genops(data):  # also stops at truncated or garbled opcodes
        if op.name in _REFUSED_OPCODES:
            raise pickle.UnpicklingError(f"refused opcode {op.name}")
    return SafeUnpickler(io.BytesIO(data), allowed).load()


def load_metadata(path: str | Path, listed: Collection[str]) -> Metadata:
    """DCP's index of the checkpoint at `path`, read safely, naming only files in `listed`
    (the manifest's): DCP opens every file the index names, so none may be anything else."""
    path = Path(path)
    where = f"checkpoint {path}"
    if ".metadata" not in listed:
        raise CheckpointError(f"{where}: manifest.json does not list .metadata")
    data = read_regular(path / ".metadata", METADATA_MAX_BYTES)
    try:
        meta = safe_unpickle(data)
    except Exception as e:  # any unpickling failure: refuse, naming the file
        raise CheckpointError(
            f"{where}: .metadata is not a plain DCP index, refused to load it ({e})"
        ) from None
    storage = getattr(meta, "storage_data", None)
    if type(meta) is not Metadata or not isinstance(storage, dict):
        raise CheckpointError(f"{where}: .metadata is not a plain DCP index, refused to load it")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if type(info) is not _StorageInfo or not isinstance(name, str) or name not in listed:
            raise CheckpointError(
                f"{where}: .metadata names a shard manifest.json does not list ({name!r}); "
                "refused to open it"
            )
    return meta


class RegularFiles(FileSystem):
    """DCP's file access: reads open regular files only (no link, FIFO or device, never
    blocking); writes create new files only, never through a link or over a file."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode == "rb":
            fd = open_regular(Path(path))
        elif mode == "wb":
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o644)
        else:
            raise ValueError(f"unexpected mode {mode!r} for {path}")
        with os.fdopen(fd, mode) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader of a checkpoint folder that reads the index with SafeUnpickler and opens
    only regular files the manifest lists (`listed`)."""

    def __init__(self, path: str | Path, listed: Collection[str]):
        super().__init__(str(path))
        self.fs = RegularFiles()
        self.listed = frozenset(listed)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = load_metadata(Path(self.path), self.listed)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


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


def _listed(path: str | Path, listed: Collection[str] | None) -> Collection[str]:
    """The files a loader may open: `listed`, or by default those the signed manifest lists."""
    return listed if listed is not None else read_manifest(Path(path))["files"]


def load_into(path: str | Path, state: dict, listed: Collection[str] | None = None) -> None:
    """dcp.load into `state` in place (collective under torchrun), pickled items read safely,
    from the files of `listed` (the manifest's) only. The caller has run check_checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(path, _listed(path, listed))
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        raise _as_checkpoint_error(e, Path(path)) from None


def load_all(
    path: str | Path, listed: Collection[str] | None = None, keys: set[str] | None = None
) -> dict:
    """Everything the checkpoint holds (or the flattened `keys` only), as a nested state dict,
    in this process alone (no collectives), from the files of `listed` only. The caller has run
    check_checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    # dcp.load cannot fill an empty dict (it copies back only the keys it was given), so this
    # is what dcp_to_torch_save does, with the safe planner.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:
        _load_state_dict(
            state,
            SafeFileSystemReader(path, _listed(path, listed)),
            planner=SafeEmptyLoadPlanner(keys),
            no_dist=True,
        )
    except (Exception, CheckpointException) as e:
        raise _as_checkpoint_error(e, Path(path)) from None
    return state


def check_objects(path: str | Path, listed: Collection[str]) -> None:
    """Read the checkpoint's index and every pickled item (a few small values) and refuse it
    if one is not plain: resume=auto then falls back past it, and every loader refuses it
    alike, even one that would not read that item."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = load_metadata(path, listed)
    keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if keys:
        load_all(path, listed, keys)


def load_plain_file(path: Path, limit: int) -> Any:
    """A torch.save file of plain values and tensors (a rank's own state), read as such."""
    return plain_value(read_regular(path, limit), path.name)

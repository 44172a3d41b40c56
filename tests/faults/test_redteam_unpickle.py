"""Red team: what a crafted pickle in a checkpoint can reach through dtrain's unpicklers.

Pickle protocol 4 resolves a dotted global name attribute by attribute, so a name inside an
allowed module or class (`_StorageInfo.__init__.__code__.__class__`) reaches any type or
function those objects lead to. The pickles here are generated: every attribute of every
allowed module and class (dir()), each followed by the dunder chains that lead out (the
function's globals and code, builtins, subclasses, reduce hooks), written with GLOBAL under
protocols 2 to 5, with STACK_GLOBAL under 4 and 5, and with INST, each calling what it reaches
with a path whose creation would prove that code ran. Every one must be refused by name before
it is resolved. A real payload (a function built from a code object, the way the attack works)
is then planted in a checkpoint's `.metadata`, the manifest and COMPLETE re-signed, and run
through every command that reads a checkpoint.
"""

import copyreg
import importlib
import io
import os
import pickle
import re
import shutil
import struct
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint.safe_load import (
    METADATA_GLOBALS,
    RefusedObject,
    load_metadata,
    plain_value,
    safe_unpickle,
)
from dtrain.errors import CheckpointError
from tests.conftest import FAST, launch, train
from tests.faults.helpers import one_error_line, replace_signed, run_command, snapshot

# The dunder chains that lead from an attribute to code: a function's globals, code and
# builtins, a class's subclasses and reduce hooks.
LEADS = [
    "",
    ".__class__",
    ".__init__",
    ".__init__.__globals__",
    ".__init__.__class__",
    ".__init__.__code__.__class__",
    ".__init__.__builtins__",
    ".__globals__",
    ".__code__",
    ".__builtins__",
    ".__call__",
    ".__reduce_ex__",
    ".__reduce__",
    ".__subclasses__",
    ".__class__.__subclasses__",
    ".__class__.__base__",
    ".__dict__",
    ".__getattribute__",
]
FS = "torch.distributed.checkpoint.filesystem"


def _chains() -> list[tuple[str, str]]:
    """(module, dotted name) for every attribute of every allowed module and global, each with
    every lead, and every attribute of the modules they import; torch's own namespace
    (thousands of names) with the short leads only."""
    out = set()
    for module in sorted({m for m, _ in METADATA_GLOBALS} | {FS}):
        mod = importlib.import_module(module)
        leads = LEADS if module != "torch" else LEADS[:3]
        for attr in dir(mod):
            out.update((module, attr + lead) for lead in leads)
            inner = getattr(mod, attr)
            if module != "torch" and isinstance(inner, types.ModuleType):  # os, sys, pickle...
                out.update((module, f"{attr}.{sub}") for sub in dir(inner))
    dtype_seen = False
    for module, name in sorted(METADATA_GLOBALS):
        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, torch.dtype):  # every dtype has the same attributes: one of them
            if dtype_seen:
                out.update((module, name + lead) for lead in LEADS if lead)
                continue
            dtype_seen = True
        for attr in dir(obj):
            out.update((module, f"{name}.{attr}{lead}") for lead in LEADS)
    return sorted(out - METADATA_GLOBALS)


CHAINS = _chains()


def _str(x: str) -> bytes:
    b = x.encode()
    return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + struct.pack("<I", len(b)) + b


def _args(obj) -> bytes:
    """`obj` pickled as opcodes to embed in another pickle (protocol 3: no frames)."""
    return pickle.dumps(obj, protocol=3)[2:-1]


def _encodings(module: str, name: str, arg: str) -> list[bytes]:
    """Pickles that look `module`.`name` up and call it with `arg`: GLOBAL under protocols 2
    to 5, STACK_GLOBAL under 4 and 5, INST."""
    glob = b"c" + f"{module}\n{name}\n".encode()
    call = _args((arg,)) + b"R."
    out = [b"\x80" + bytes([p]) + glob + call for p in (2, 3, 4, 5)]
    out += [b"\x80" + bytes([p]) + _str(module) + _str(name) + b"\x93" + call for p in (4, 5)]
    out.append(b"(" + _args(arg) + b"i" + f"{module}\n{name}\n".encode() + b".")
    return out


def _payload(proof: Path) -> bytes:
    """The attack on an allow-list that resolves dotted names: FunctionType and CodeType
    reached through _StorageInfo.__init__, a function built from a code object, then called."""
    c = compile(f"import os; os.makedirs({str(proof)!r})", "<payload>", "exec")
    fields = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals,
              c.co_stacksize, c.co_flags, c.co_code, c.co_consts, c.co_names, c.co_varnames,
              c.co_filename, c.co_name, c.co_qualname, c.co_firstlineno, c.co_linetable,
              c.co_exceptiontable, c.co_freevars, c.co_cellvars)  # fmt: skip
    stack_global = lambda name: _str(FS) + _str(name) + b"\x93"  # noqa: E731
    code = stack_global("_StorageInfo.__init__.__code__.__class__") + _args(fields) + b"R"
    function = stack_global("_StorageInfo.__init__.__class__") + b"(" + code + b"}tR"
    return b"\x80\x04" + function + b")R."


def test_the_chains_reach_code_through_plain_pickle():
    """The generated names are real escapes: resolved the way pickle resolves them, they
    reach the types that build and call code, and os itself."""
    reached = set()
    for module, name in CHAINS:
        try:
            obj = pickle._getattribute(importlib.import_module(module), name)[0]
        except Exception:
            continue
        try:
            reached.add(obj)
        except TypeError:  # unhashable (a dict of globals)
            pass
    assert {types.FunctionType, types.CodeType, os.makedirs, os.system} <= reached
    assert len(CHAINS) > 5000, len(CHAINS)


def test_the_payload_runs_code_under_plain_pickle(tmp_path):
    proof = tmp_path / "pwned"
    importlib.import_module(FS)
    pickle.loads(_payload(proof))  # as DCP's FileSystemReader.read_metadata would
    assert proof.is_dir()


def test_every_chain_in_every_encoding_is_refused_by_name(tmp_path):
    proof = tmp_path / "pwned"
    tried = 0
    for module, name in CHAINS:
        for data in _encodings(module, name, str(proof)):
            with pytest.raises(
                pickle.UnpicklingError, match=f"refused to load {re.escape(module)}"
            ):
                safe_unpickle(data)
            tried += 1
    assert not proof.exists()
    assert tried == 7 * len(CHAINS)


def test_the_real_payload_is_refused(tmp_path):
    proof = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="refused to load .*_StorageInfo.__init__"):
        safe_unpickle(_payload(proof))
    assert not proof.exists()


def test_copyreg_extensions_and_persistent_ids_are_refused(tmp_path):
    proof = tmp_path / "pwned"
    copyreg.add_extension("os", "makedirs", 0xF1)
    try:
        data = b"\x80\x04\x82\xf1" + _args((str(proof),)) + b"R."
        with pytest.raises(pickle.UnpicklingError, match="refused opcode EXT1"):
            safe_unpickle(data)
    finally:
        copyreg.remove_extension("os", "makedirs", 0xF1)
    with pytest.raises(pickle.UnpicklingError, match="refused opcode BINPERSID"):
        safe_unpickle(b"\x80\x04" + _args("x") + b"Q.")
    assert not proof.exists()


def _torch_save_with(data_pkl: bytes) -> bytes:
    """A torch.save file whose pickle is `data_pkl`: what plain_value (the shards' pickled
    items, extra_rank*.pt) reads."""
    buf = io.BytesIO()
    torch.save(0, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, body)
    return out.getvalue()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_the_plain_value_reader_refuses_every_chain(tmp_path):
    """torch.load(weights_only=True) looks globals up by exact name: every chain, as GLOBAL
    under protocol 2 (the only global opcode it reads) and as STACK_GLOBAL, is refused."""
    proof = tmp_path / "pwned"
    assert plain_value(_torch_save_with(pickle.dumps({"lr": 0.1}, protocol=2)), "k") == {"lr": 0.1}
    for module, name in CHAINS[::7]:  # a seventh of them: torch.load costs ~0.1 ms each
        glob, stack = _encodings(module, name, str(proof))[0], _encodings(module, name, "x")[4]
        for data in (glob, stack):
            with pytest.raises(RefusedObject):
                plain_value(_torch_save_with(data), "k")
    with pytest.raises(RefusedObject):
        plain_value(_torch_save_with(_payload(proof)), "k")
    assert not proof.exists()


def test_dcps_own_metadata_still_loads(tmp_path):
    """Every kind of entry dcp.save writes into .metadata (tensors of each dtype, chunks,
    pickled values, the storage layout) passes the allow-list and matches DCP's own read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
    state = {
        "model": {f"t{i}": torch.zeros(3, 2, dtype=d) for i, d in enumerate(dtypes)},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["a"], "x": None}]},
        "scalar": torch.tensor(1.5),
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    names = [p.name for p in tmp_path.iterdir()]
    ours = load_metadata(tmp_path, names)
    theirs = FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    with pytest.raises(CheckpointError, match="names a shard manifest.json does not list"):
        load_metadata(tmp_path, [".metadata"])


# --- the payload planted in a checkpoint, through every command -------------------------


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A run dir with a good step 2 and a step 4 whose .metadata is the payload (re-signed)."""
    root = tmp_path_factory.mktemp("redteam_unpickle")
    run = root / "run"
    train(run, "trainer.max_steps=4", "trainer.eval_every=0", "checkpoint.every_n_steps=2")
    bad = run / "checkpoints" / "step_0000004"
    proof = root / "pwned"
    replace_signed(bad, ".metadata", _payload(proof))
    return run, bad, proof


def _command(loader: str, run: Path, bad: Path, out: Path) -> list[str]:
    train_py = [sys.executable, "launch/train.py", *FAST, "trainer.eval_every=0"]
    if loader == "resume":
        return [*train_py, "trainer.max_steps=5", f"resume={bad}", f"hydra.run.dir={out}"]
    if loader.startswith("export-"):
        fmt = loader.split("-")[1]
        cli = [sys.executable, "-m", "dtrain.cli.export"]
        return [*cli, f"checkpoint={bad}", f"out={out}", f"format={fmt}"]
    cli = [sys.executable, "-m", "dtrain.cli.generate"]
    return [*cli, f"checkpoint={bad}", "prompt=def ", "max_new_tokens=2"]


@pytest.mark.parametrize("loader", ["resume", "export-hf", "export-torch", "generate"])
def test_every_command_refuses_the_payload(planted, tmp_path, loader):
    run, bad, proof = planted
    before = snapshot(run)
    out = tmp_path / "out"
    res = run_command(_command(loader, run, bad, out), timeout=50)
    assert res.returncode == 2, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 or loader == "resume", res.stderr
    assert ".metadata is not a plain DCP index" in line and "_StorageInfo" in line, line
    assert not proof.exists()
    assert snapshot(run) == before
    assert not (out / "checkpoints").exists() and not (out / "model.safetensors").exists()


def test_resume_auto_falls_back_past_the_payload(planted, tmp_path):
    run, _, proof = planted
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    args = [*FAST, "trainer.eval_every=0", "trainer.max_steps=3", f"hydra.run.dir={copy}"]
    res = launch(*args, timeout=50)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "falling back to step_0000002" in res.stderr, res.stderr[-3000:]
    assert f"resumed from {copy / 'checkpoints' / 'step_0000002'} (step 2)" in res.stderr
    assert (copy / "checkpoints" / "step_0000004.rejected" / ".metadata").exists()
    assert not proof.exists()


def test_two_ranks_refuse_the_payload(planted, tmp_path):
    """Under dtrain-torchrun every rank checks the index before DCP reads it: one line, exit 2."""
    _, bad, proof = planted
    res = launch(
        *FAST,
        "strategy=ddp",
        "trainer.eval_every=0",
        "trainer.max_steps=5",
        f"resume={bad}",
        f"hydra.run.dir={tmp_path / 'r'}",
        nproc=2,
        timeout=55,
    )
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert errors and all(".metadata is not a plain DCP index" in e for e in errors), errors
    assert not proof.exists()
    assert not (tmp_path / "r" / "checkpoints").exists()

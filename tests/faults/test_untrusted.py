"""Untrusted files and the network: no code in a checkpoint ever runs, whichever loader reads it
(resume, generate, export in both formats, model.init_from, compare), no dataset or tokenizer
code runs unless the user opts in, and a single-process run listens on no network port.

A checkpoint pickles in three places, each planted here with a pickle whose `__reduce__`
creates a folder (the proof that code ran), the manifest re-signed as an attacker would: DCP's
`.metadata` (an allow-list unpickler reads it first), `extra_rank*.pt` (weights_only=True), and
the non-tensor items inside the `.distcp` shards (the optimizer's param_groups, or any tensor
slot an attacker turns into an object), which dtrain.checkpoint.safe_load reads as plain values
only. The data position and the run config live in manifest.json, which is JSON.
"""

import copy
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.config import DataConfig
from dtrain.errors import CheckpointError, UserError
from tests.conftest import FAST, ROOT, cli_env, launch, train
from tests.faults.helpers import (
    edit_manifest,
    kill_tree,
    one_error_line,
    start,
    wait_for_step,
    write_manifest,
)


class Exploit:
    """Unpickling this creates a folder: the proof that code ran."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (os.makedirs, (str(self.proof),))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    run = tmp_path_factory.mktemp("untrusted") / "run"
    train(run, "trainer.max_steps=2", "trainer.eval_every=0")
    return run / "checkpoints" / "step_0000002"


def _resign(dst: Path) -> None:
    """manifest.json's sha256 and size of every file in the checkpoint, recomputed: checksums
    only catch accidents, so a loader must refuse the content itself."""
    manifest = json.loads((dst / "manifest.json").read_text())
    names = sorted(
        p.name for p in dst.iterdir() if p.is_file() and p.name not in ("manifest.json", "COMPLETE")
    )
    manifest["files"] = {n: hashlib.sha256((dst / n).read_bytes()).hexdigest() for n in names}
    manifest["sizes"] = {n: (dst / n).stat().st_size for n in names}
    write_manifest(dst, manifest)  # COMPLETE re-signed too


def _plant(ckpt: Path, dst: Path, name: str, payload: bytes) -> Path:
    """A copy of ckpt with the file `name` replaced, the manifest re-signed to match."""
    shutil.copytree(ckpt, dst)
    (dst / name).write_bytes(payload)
    _resign(dst)
    return dst


def _plant_state(ckpt: Path, dst: Path, key: str, value, extra: dict | None = None) -> Path:
    """A copy of ckpt whose DCP state holds `value` at `key` (a flattened DCP key such as
    optim.param_groups.0.lr), saved again by DCP, which pickles a non-tensor value into the
    shard as it would an lr, then re-signed. `extra` adds parts to the state (fp16's scaler)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element

    from dtrain.checkpoint.safe_load import load_all

    state = {**load_all(ckpt), **copy.deepcopy(extra or {})}  # our own checkpoint, as saved
    where = FileSystemReader(str(ckpt)).read_metadata().planner_data.get(key)
    set_element(state, where or tuple(key.split(".", 1)), value)
    shutil.copytree(ckpt, dst)
    for f in [*dst.glob("*.distcp"), dst / ".metadata"]:
        f.unlink()
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    _resign(dst)
    return dst


def _slots(ckpt: Path) -> list[str]:
    """The state a checkpoint holds as pickled bytes in its shards (DCP's BYTE_IO items)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return sorted(k for k, v in meta.items() if isinstance(v, BytesStorageMetadata))


def _refused(slot: str) -> str:
    return rf"state '{re.escape(slot)}' holds a pickled object of type os\.makedirs; refused"


LR = "optim.param_groups.0.lr"
# Tensor slots an attacker can turn into objects (DCP then stores them as pickled bytes): the
# model's, which every loader reads, and fp16's loss scale.
TENSOR_SLOTS = ["model.tok_embeddings.weight", "loss_scaler.scale"]


def _fp16_scaler_state() -> dict:
    """What fp16 adds to Strategy.state_dict (built on CPU; fp16 trains on CUDA only)."""
    import torch

    from dtrain.lowp.scaling import LossScaler

    return {"loss_scaler": LossScaler(torch.device("cpu")).state_dict()}


def test_malicious_extra_rank_file_is_refused(ckpt, tmp_path):
    import torch

    proof = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"rng": Exploit(proof)}, evil)
    bad = _plant(ckpt, tmp_path / "ckpts" / "step_0000002", "extra_rank0.pt", evil.read_bytes())
    with pytest.raises(CheckpointError, match="extra_rank0.pt holds more than tensors"):
        train(tmp_path / "run", "trainer.max_steps=4", f"resume={bad}")
    assert not proof.exists()


def test_malicious_dcp_metadata_is_refused(ckpt, tmp_path):
    proof = tmp_path / "pwned"
    bad = _plant(
        ckpt, tmp_path / "ckpts" / "step_0000002", ".metadata", pickle.dumps(Exploit(proof))
    )
    with pytest.raises(CheckpointError, match=r"\.metadata is not a plain DCP index.*refused"):
        train(tmp_path / "run", "trainer.max_steps=4", f"resume={bad}")
    assert not proof.exists()


def test_resume_auto_skips_a_checkpoint_with_malicious_metadata(ckpt, tmp_path, capfd):
    proof = tmp_path / "pwned"
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "step_0000002")
    _plant(ckpt, run / "checkpoints" / "step_0000003", ".metadata", pickle.dumps(Exploit(proof)))
    manifest = json.loads((run / "checkpoints" / "step_0000003" / "manifest.json").read_text())
    manifest["step"] = 3
    write_manifest(run / "checkpoints" / "step_0000003", manifest)
    capfd.readouterr()
    train(run, "trainer.max_steps=4", "trainer.eval_every=0")
    err = capfd.readouterr().err
    assert "refused" in err and "falling back to step_0000002" in err, err[-2000:]
    assert not proof.exists()


def test_resume_auto_skips_a_checkpoint_with_a_planted_pickle(ckpt, tmp_path, capfd):
    proof = tmp_path / "pwned"
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / "step_0000002")
    bad = _plant_state(ckpt, run / "checkpoints" / "step_0000003", LR, Exploit(proof))
    manifest = json.loads((bad / "manifest.json").read_text())
    write_manifest(bad, {**manifest, "step": 3})
    capfd.readouterr()
    train(run, "trainer.max_steps=4", "trainer.eval_every=0")
    err = capfd.readouterr().err
    assert "holds a pickled object" in err and "falling back to step_0000002" in err, err[-2000:]
    assert not proof.exists()


# --- the pickled items inside the shards ------------------------------------------------


def test_the_pickled_state_of_a_checkpoint_is_the_optimizers_param_groups(ckpt):
    slots = _slots(ckpt)
    assert all(s.startswith("optim.param_groups.") for s in slots), slots
    assert {LR, "optim.param_groups.0.betas", "optim.param_groups.1.params"} <= set(slots)


def test_fp16_adds_no_pickled_state(ckpt, tmp_path):
    # fp16 adds the loss scaler, saved as tensors: its checkpoint pickles what fp32's does.
    import torch

    scaler = _fp16_scaler_state()["loss_scaler"]
    assert scaler and all(type(v) is torch.Tensor for v in scaler.values())
    fp16 = _plant_state(ckpt, tmp_path / "fp16", LR, 3e-4, extra=_fp16_scaler_state())
    assert _slots(fp16) == _slots(ckpt)


def test_dcps_own_loader_would_run_the_planted_pickle(ckpt, tmp_path):
    # The attack below is real: DCP's DefaultLoadPlanner unpickles it with weights_only=False.
    import torch.distributed.checkpoint as dcp

    from dtrain.checkpoint.safe_load import load_all

    proof = tmp_path / "pwned"
    bad = _plant_state(ckpt, tmp_path / "bad", LR, Exploit(proof))
    dcp.load(load_all(ckpt), checkpoint_id=str(bad), no_dist=True)
    assert proof.is_dir()


def test_every_loader_refuses_a_pickle_in_every_slot(ckpt, tmp_path):
    """Each pickled slot of a real checkpoint, and the tensor slots an attacker can turn into
    pickles, through each loader in-process: resume (CheckpointManager.load, any strategy),
    generate and export format=hf (load_checkpoint), export format=torch (consolidate), and the
    safe planners alone, past the check that every pickled item is plain."""
    from dtrain.checkpoint import CheckpointManager
    from dtrain.checkpoint.safe_load import load_all, load_into
    from dtrain.checkpoint.weights import consolidate, load_checkpoint
    from dtrain.config import CheckpointConfig

    extra = _fp16_scaler_state()  # the state of an fp16 run, which has the most slots
    template = {**load_all(ckpt), **extra}  # loads write into it: any values of its shape do
    out = tmp_path / "out.pt"
    manager = CheckpointManager(tmp_path / "run", CheckpointConfig(), rank=0, world_size=1)
    loaders = {
        "resume": lambda bad: manager.load(bad, template),
        "load_checkpoint": load_checkpoint,
        "consolidate": lambda bad: consolidate(bad, out),
        "load_into": lambda bad: load_into(bad, template),
        "load_all": load_all,
    }
    slots = _slots(ckpt) + TENSOR_SLOTS
    for i, slot in enumerate(slots):
        proof = tmp_path / f"pwned{i}"
        bad = _plant_state(ckpt, tmp_path / f"c{i}", slot, Exploit(proof), extra=extra)
        for name, load in loaders.items():
            try:
                load(bad)
            except CheckpointError as e:
                assert re.search(_refused(slot), str(e)), (name, str(e))
            else:
                pytest.fail(f"{name} loaded a checkpoint with a pickle in {slot}")
        assert not proof.exists() and not out.exists(), slot


@pytest.mark.slow
def test_zero2_resume_refuses_a_pickle_planted_in_its_checkpoint(ckpt, tmp_path):
    """DeepSpeed's ZeRO strategies save full weights, moments and param_groups by name: the
    same pickled slots as single, read back by the same loader on every rank."""
    pytest.importorskip("deepspeed")
    args = [*FAST, "trainer.eval_every=0", "strategy=zero2"]
    run = tmp_path / "zero2"
    ok = launch(*args, "trainer.max_steps=2", f"hydra.run.dir={run}", nproc=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    saved = run / "checkpoints" / "step_0000002"
    assert _slots(saved) == _slots(ckpt)
    proof = tmp_path / "pwned"
    bad = _plant_state(saved, tmp_path / "bad" / "step_0000002", LR, Exploit(proof))
    res = launch(*args, "trainer.max_steps=4", f"resume={bad}", f"hydra.run.dir={run}2", nproc=2)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.search(_refused(LR), errors[0]), res.stderr[-3000:]
    # dtrain-torchrun passes the ranks' exit 2 through, with their one line and no report
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not proof.exists()


def test_plain_values_are_what_the_safe_loader_accepts(ckpt):
    import io

    import torch

    from dtrain.checkpoint.safe_load import RefusedObject, load_all, plain_value

    state = load_all(ckpt)  # the real param_groups: floats, tuples, bools, None, lists of str
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)

    def saved(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    plain = [1, 2.5, True, None, "x", (1, "a"), [None], {"k": {"n": [1.0]}}, torch.zeros(2)]
    for value in plain:
        assert repr(plain_value(saved(value), "k")) == repr(value)
    # weights_only admits what libraries register (DTensor placements, torchao's tensors)
    # and dict subclasses: none of them is plain state.
    from torch.distributed.tensor.placement_types import Shard

    for value in [Shard(0), Exploit(Path("/nonexistent/pwned")), b"x" * 3]:
        if type(value) is bytes:
            assert plain_value(saved(value), "k") == value
            continue
        with pytest.raises(RefusedObject):
            plain_value(saved(value), "k")


# --- every command, as a real process ---------------------------------------------------


@pytest.fixture(scope="module")
def planted(ckpt, tmp_path_factory):
    """Run dirs whose one checkpoint holds the proof-making pickle in `slot` (built once)."""
    root = tmp_path_factory.mktemp("planted")
    out = {}
    for slot in (LR, TENSOR_SLOTS[0]):
        run = root / slot.replace(".", "_")
        proof = run.with_name(run.name + "_pwned")
        bad = _plant_state(ckpt, run / "checkpoints" / "step_0000002", slot, Exploit(proof))
        out[slot] = (run, bad, proof)
    return out


def _command(loader: str, run: Path, bad: Path, out: Path) -> list[str]:
    cli = [sys.executable, "-m"]
    if loader == "resume":
        return [sys.executable, "launch/train.py", *FAST, "trainer.max_steps=4",
                "trainer.eval_every=0", f"resume={bad}", f"hydra.run.dir={out}"]  # fmt: skip
    if loader == "resume-auto-run-dir":  # the run's only checkpoint: nothing to fall back to
        return [sys.executable, "launch/train.py", *FAST, "trainer.max_steps=4",
                "trainer.eval_every=0", f"hydra.run.dir={run}"]  # fmt: skip
    if loader.startswith("export-"):
        fmt = loader.split("-")[1]
        return [*cli, "dtrain.cli.export", f"checkpoint={bad}", f"out={out}", f"format={fmt}"]
    return [*cli, "dtrain.cli.generate", f"checkpoint={run}", "prompt=def ", "max_new_tokens=2"]


LOADERS = ["resume", "resume-auto-run-dir", "export-hf", "export-torch", "generate"]
# Every command on the optimizer's lr; the model-only ones (which read no optimizer state)
# also on a model tensor turned into a pickle. Every slot x every loader runs in-process above.
CASES = [(LR, loader) for loader in LOADERS] + [
    (TENSOR_SLOTS[0], "export-hf"),
    (TENSOR_SLOTS[0], "generate"),
]


@pytest.mark.parametrize("slot,loader", CASES, ids=[f"{s}-{x}" for s, x in CASES])
def test_every_command_refuses_a_planted_pickle(planted, tmp_path, slot, loader):
    run, bad, proof = planted[slot]
    out = tmp_path / "out"
    res = subprocess.run(
        _command(loader, run, bad, out),
        capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert re.search(_refused(slot), line), line
    assert not proof.exists()
    assert not out.exists() or loader.startswith("resume")  # a run dir holds no checkpoint
    assert not (out / "checkpoints").exists()


def test_model_init_from_reads_no_dtrain_checkpoint_and_no_pickle(planted, tmp_path):
    """model.init_from imports Hugging Face directories only, and only their safetensors."""
    import torch

    from dtrain.hf import CONFIG, INDEX, hf_config
    from dtrain.model import ModelConfig
    from dtrain.run.preflight import check_overrides
    from dtrain.train import run

    run_dir, bad, proof = planted[LR]
    base = [*FAST, "trainer.max_steps=1", "trainer.eval_every=0", f"hydra.run.dir={tmp_path}/r"]
    with pytest.raises(UserError, match=r"has no config\.json"):
        check_overrides([*base, f"model.init_from=hf:{bad}"])
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, ffn_hidden=64, vocab_size=320)
    (hf / CONFIG).write_text(json.dumps(hf_config(cfg, dtype=torch.float32)))
    (hf / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit(proof)))
    with pytest.raises(UserError, match="has no model.safetensors"):
        run(check_overrides([*base, f"model.init_from=hf:{hf}"]))
    (hf / INDEX).write_text(json.dumps({"weight_map": {"x": "pytorch_model.bin"}}))
    with pytest.raises(UserError, match=r"pytorch_model\.bin is not a safetensors file"):
        run(check_overrides([*base, f"model.init_from=hf:{hf}"]))
    assert not proof.exists()


def test_compare_reads_no_pickle_and_no_yaml_tags(tmp_path):
    """compare reads metrics.jsonl (JSON), TensorBoard events (protobuf) and .hydra/config.yaml,
    whose loader is yaml's safe one: a python/object tag is refused, never called."""
    proof = tmp_path / "pwned"
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / ".hydra" / "config.yaml").write_text(
        f"strategy: !!python/object/apply:os.makedirs ['{proof}']\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "dtrain.cli.compare", str(run), "--no-png"],
        capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert "config.yaml is not a plain YAML config" in one_error_line(res.stderr)
    assert not proof.exists()


# --- manifest.json: the data position and the run config --------------------------------


def test_manifest_json_cannot_carry_code(ckpt, tmp_path):
    """The data position, step, identity and run config are JSON: json.loads makes dicts,
    lists, strings, numbers, booleans and None, nothing that runs. A pickle in its place is an
    unreadable manifest; hostile values in it run no code and end in one line (UserError)."""
    from dtrain.run.preflight import check_overrides
    from dtrain.train import run

    proof = tmp_path / "pwned"
    payload = pickle.dumps(Exploit(proof))
    reduce_ = {"__reduce__": ["os.makedirs", [str(proof)]], "py/object": "os.makedirs"}
    hostile = {
        "pickle": None,  # manifest.json replaced by a pickle
        "data": payload.decode("latin-1"),
        "data.consumed": reduce_,
        "data.streams": {"0": payload.decode("latin-1")},
        "step": f"__import__('os').makedirs('{proof}')",
        "identity": reduce_,
        "config.model": reduce_,
        "config.data.tokenizer": payload.decode("latin-1"),
    }
    for i, (where, value) in enumerate(hostile.items()):
        bad = tmp_path / f"c{i}" / "step_0000002"
        shutil.copytree(ckpt, bad)
        if value is None:  # signed in COMPLETE as dtrain signs it: only the content is wrong
            (bad / "manifest.json").write_bytes(payload)
            sha = hashlib.sha256(payload).hexdigest()
            (bad / "COMPLETE").write_text(f"{sha}  manifest.json\n")
        else:
            edit_manifest(bad, where, value)
        argv = [*FAST, "trainer.max_steps=3", "trainer.eval_every=0", f"resume={bad}"]
        try:
            run(check_overrides([*argv, f"hydra.run.dir={tmp_path}/r{i}"]))
        except UserError as e:  # every hostile manifest is one line naming the checkpoint
            assert f"checkpoint {bad}" in str(e) or "was saved with" in str(e), (where, str(e))
        assert not proof.exists(), where


# --- the sources ------------------------------------------------------------------------


SOURCES = [p for d in ("dtrain", "launch") for p in sorted((ROOT / d).rglob("*.py"))]


def _call(text: str, open_paren: int) -> str:
    """The arguments of the call whose "(" is at `open_paren`, up to its matching ")"."""
    depth = 0
    for i in range(open_paren, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_paren : i + 1]
    return text[open_paren:]


def test_every_torch_load_is_weights_only_and_nothing_else_unpickles():
    for path in SOURCES:
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            call = _call(text, m.end() - 1)
            assert "weights_only=True" in call, f"{path}: torch.load{call}"
        assert not re.search(r"pickle\.loads?\(", text), f"{path} unpickles with plain pickle"
        # DCP's loaders unpickle with weights_only=False: only the safe planners load a
        # checkpoint, in one place, and every other file goes through it.
        assert not re.search(r"dcp_to_torch_save\(|import.*dcp_to_torch_save", text), path
        for m in re.finditer(r"\b(?:dcp\.load|_load_state_dict)\(", text):
            call = _call(text, m.end() - 1)
            assert path.name == "safe_load.py", f"{path}: {call}"
            assert re.search(r"planner=Safe\w*LoadPlanner\(", call), call
        for m in re.finditer(r"\bload_(?:into|all)\(", text):
            # The checks (checksums, .metadata allow-list, plain pickled items) come first.
            if path.name != "safe_load.py":
                assert "check_checkpoint(" in text[: m.start()], f"{path}: unchecked load"


def test_remote_code_is_never_trusted_by_default():
    from dtrain.config import compose, group_choices

    assert DataConfig().trust_remote_code is False
    # conf/data files list only what differs from the schema: none may turn it on.
    for choice in group_choices("data"):
        assert compose([f"data={choice}"]).data.trust_remote_code is False, choice
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"trust_remote_code\s*=\s*True", text), path
        for m in re.finditer(r"trust_remote_code\s*=\s*([^,)\n]+)", text):
            value = m.group(1).strip()
            # Passed on only from the user's config (or its default False), never a literal.
            assert "trust_remote_code" in value or value == "False", f"{path}: {m.group(0)}"


def _listening_inodes() -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            # TCP state 0A is LISTEN; a bound UDP socket (07) receives from anyone.
            if (table.startswith("tcp") and f[3] == "0A") or (
                table.startswith("udp") and f[3] == "07"
            ):
                inodes.add(f[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.match(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            out.add(m.group(1))
    return out


def test_the_socket_inspection_sees_a_listener():
    with socket.socket() as s:  # proof that the check below could fail
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert _socket_inodes(os.getpid()) & _listening_inodes()


def test_a_single_process_run_listens_on_no_port(tmp_path):
    run = tmp_path / "run"
    proc = start(
        "trainer.max_steps=100000",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        f"hydra.run.dir={run}",
    )
    try:
        wait_for_step(run, 2, proc)
        assert _socket_inodes(proc.pid) & _listening_inodes() == set()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0

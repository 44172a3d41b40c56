"""Untrusted files and the network: no code in a checkpoint ever runs (DCP's pickled .metadata
goes through an allow-list unpickler first, extra_rank*.pt through weights_only=True), no
dataset or tokenizer code runs unless the user opts in, and a single-process run listens on
no network port."""

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
from pathlib import Path

import pytest

from dtrain.config import DataConfig
from dtrain.errors import CheckpointError
from tests.conftest import ROOT, train
from tests.faults.helpers import kill_tree, start, wait_for_step, write_manifest


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


def _plant(ckpt: Path, dst: Path, name: str, payload: bytes) -> Path:
    """A copy of ckpt with `name` replaced and the manifest re-signed to match: checksums
    only catch accidents, so the loader must refuse the content itself."""
    shutil.copytree(ckpt, dst)
    (dst / name).write_bytes(payload)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(payload).hexdigest()
    manifest["sizes"][name] = len(payload)
    write_manifest(dst, manifest)  # COMPLETE re-signed too
    return dst


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


SOURCES = [p for d in ("dtrain", "launch") for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_torch_load_is_weights_only_and_nothing_else_unpickles():
    for path in SOURCES:
        text = path.read_text()
        for call in re.findall(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        assert not re.search(r"pickle\.loads?\(", text), f"{path} unpickles with plain pickle"
        for m in re.finditer(r"dcp\.load\(", text):
            # DCP's .metadata is pickle: the allow-list check must come first in that file.
            assert "check_metadata(path)" in text[: m.start()], f"{path}: dcp.load unguarded"


def test_remote_code_is_never_trusted_by_default():
    assert DataConfig().trust_remote_code is False
    for yaml in sorted((ROOT / "conf" / "data").glob("*.yaml")):
        assert re.search(r"^trust_remote_code: false\b", yaml.read_text(), re.M), yaml
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

"""What the GPU tests share: a small model on real text, runs through the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from tests.conftest import launch, read_jsonl

# A 4-layer GPT-2-small-wide model (d 768, ffn 2048: every matmul dimension a multiple of 16,
# as fp8 and int8 need) on the embedded text: seconds per run, compiled or not.
BASE = [
    "model=small",
    "model.n_layer=4",
    "trainer.seq_len=256",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "trainer.progress_bar=false",
    "trainer.device=cuda",
    "checkpoint.save_final=false",
    "optim.warmup_steps=5",
]
STEPS = 30
GLOBAL_BATCH = 16
# Eager where compilation is not what a test is about: each compile costs ~30 s of GPU time.
EAGER = "strategy.compile=false"


def merged(*overrides: str, nproc: int = 1) -> list[str]:
    """BASE, STEPS and this world size's micro-batch, each key overridden by `overrides`
    (Hydra refuses a config group named twice on one command line)."""
    args = [
        *BASE,
        f"trainer.max_steps={STEPS}",
        f"trainer.micro_batch_size={GLOBAL_BATCH // nproc}",
    ]
    keys = {o.split("=", 1)[0] for o in overrides}

    def kept(arg: str) -> bool:  # model=1b drops model.n_layer=4 too
        key = arg.split("=", 1)[0]
        return key not in keys and key.split(".", 1)[0] not in keys

    return [a for a in args if kept(a)] + list(overrides)


def one_gpu_env() -> dict:
    """Under pytest-xdist (bench/gpu_suite.sh runs the suite on several workers), each worker's
    one-GPU runs go to its own GPU, so two of them side by side do not share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return {}
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # a narrower set given to the suite
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": gpus[int(worker[2:]) % len(gpus)]} if gpus else {}


def run(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = 900) -> list[dict]:
    """Train through launch/train.py (torchrun for nproc > 1); the metrics.jsonl records."""
    res = launch(
        *merged(*overrides, nproc=nproc),
        f"hydra.run.dir={run_dir}",
        nproc=nproc,
        timeout=timeout,
        env_extra=one_gpu_env() if nproc == 1 else None,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def once(root: Path, name: str, make) -> Path:
    """`make(dir)` run once per suite under root/name, whichever test (or xdist worker) asks
    first; the others wait on its lock and read what it left. Returns root/name."""
    root.mkdir(parents=True, exist_ok=True)
    target, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.exists():  # one failure is reported by every test that needs it, run once
            raise AssertionError(f"shared run {name} failed: {failed.read_text()}")
        if not done.exists():
            try:
                make(target)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-4000:])
                raise
            done.touch()
    return target


def shared_run(tmp_path_factory, name: str, *overrides: str, nproc: int = 1) -> list[dict]:
    """A run that several tests compare against (the straight runs of the parity, resume and
    move tests): trained once for the whole suite, in the directory every xdist worker shares
    (the parent of each worker's base temp)."""
    base = tmp_path_factory.getbasetemp()  # under xdist: <session dir>/popen-gw<N>
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_runs"
    # The name says what the run is for; the digest keeps two different runs from sharing it.
    key = hashlib.sha256(repr((overrides, nproc)).encode()).hexdigest()[:8]
    d = once(root, f"{name}-{key}", lambda target: run(target, *overrides, nproc=nproc))
    return read_jsonl(d / "metrics.jsonl")


# The memory prediction's check: model=1b compiled (as users run it), a few steps past warm-up.
MEMORY_1B = [
    "model=1b",
    "trainer.seq_len=2048",
    "trainer.max_steps=4",
    "trainer.micro_batch_size=4",
    "precision=bf16",
    "data=synthetic",
]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def last(records: list[dict], key: str):
    return [r[key] for r in records if key in r][-1]


def record(results: Path | None, name: str, value) -> None:
    """Append a result to the suite's JSON summary (bench/gpu_suite.sh sets the file)."""
    if results is None:
        return
    with FileLock(f"{results}.lock"):  # xdist workers write it side by side
        data = json.loads(results.read_text()) if results.exists() else {}
        data[name] = value
        results.write_text(json.dumps(data, indent=1, sort_keys=True))

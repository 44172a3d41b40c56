"""Shared helpers: train in-process through the real Hydra configs, or under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests use local files only (CI cannot reach the Hugging Face hub). Offline, a hub name that is
# not cached fails at once instead of after huggingface_hub's five retries (23 s measured for
# data.tokenizer=gpt2). Set before any test imports huggingface_hub; subprocesses inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Small and fast: the tiny model on a 300 KB slice of the embedded corpus, no progress bar.
FAST = [
    "model=tiny",
    "data.max_bytes=300000",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=4",
    "trainer.eval_steps=2",
    "trainer.progress_bar=false",
    "trainer.device=cpu",
    "inspect.max_new_tokens=8",  # samples at each eval: short, so evals stay cheap
]


def compose(*overrides: str):
    from dtrain.config import compose as _compose

    return _compose(list(overrides))


def train(run_dir: Path, *overrides: str) -> dict:
    """Run dtrain.train.run in this process with FAST defaults plus `overrides`."""
    from dtrain.train import run

    cfg = compose(*FAST, f"hydra.run.dir={run_dir}", *overrides)
    return run(cfg)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r
    }


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch_cmd(args, nproc: int = 1) -> list[str]:
    """python launch/train.py (nproc=1) or torchrun --standalone (nproc>1) with `args`."""
    from dtrain.dist import train_command

    return train_command(list(args), nproc)


def launch(*args: str, nproc: int = 1, timeout: float = 600, env_extra: dict | None = None):
    """Run launch_cmd(args, nproc) to the end; returns the CompletedProcess."""
    env = cli_env()
    env.update(env_extra or {})
    return subprocess.run(
        launch_cmd(args, nproc), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def torchrun_script(script: Path, *args: str, timeout: float = 600):
    """Run a test's worker script on 2 ranks (torchrun --standalone, gloo on CPU) to the end;
    returns the CompletedProcess. Each rank runs it through tests/exit_after.py, which leaves
    without the interpreter's teardown once the script is done."""
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*cmd, str(ROOT / "tests" / "exit_after.py"), str(script), *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.fixture
def fast_overrides() -> list[str]:
    return list(FAST)

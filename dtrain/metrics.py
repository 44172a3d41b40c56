"""Throughput, MFU, memory per rank (gathered to rank 0), TensorBoard and metrics.jsonl writers.

Every rank measures; rank 0 writes.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dtrain import dist as ddist
from dtrain.config import MetricsConfig
from dtrain.dist import DistEnv
from dtrain.hardware import gpu_named


def peak_flops(device: torch.device, cfg: MetricsConfig) -> float | None:
    """A real peak or None: a CPU has no datasheet peak, and a timed matmul gave the same
    tokens/s 21% MFU in one run and 58% in another, so without one MFU is not reported."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type == "cuda":
        gpu = gpu_named(torch.cuda.get_device_name(device))
        if gpu is not None:
            return gpu.bf16_flops
    return None  # unknown GPU or CPU: MFU is reported as null


def process_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    # ru_maxrss is the peak resident set in KiB on Linux; the current RSS from /proc.
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss_bytes": rss, "peak_rss_bytes": peak}


def gather_memory(state_bytes, device: torch.device) -> list[dict]:
    """One dict per rank: exact model-state bytes plus the process/device memory."""
    import socket

    # The host and local rank say which node and card a number belongs to across nodes.
    mine = {
        **asdict(state_bytes),
        **process_memory(device),
        "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
    }
    return ddist.all_gather_object(mine)


class Throughput:
    """Tokens per second over the interval since the last report (host clock; the caller
    synchronises the device first by reading a value of the step)."""

    def __init__(self):
        self.t0, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def restart(self) -> None:
        """Start a fresh interval (after an eval or a checkpoint, which are not training)."""
        self.t0, self.tokens = time.perf_counter(), 0

    def report(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        return rate


class MetricsWriter:
    """Writes scalars and records on rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: Path, env: DistEnv, cfg: MetricsConfig, start_step: int = 0):
        self.enabled = env.is_main
        self.tb = None
        self.jsonl = None
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run logged past the step we resume from.
            self.tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step if start_step else None
            )
        if cfg.jsonl:
            path = run_dir / "metrics.jsonl"
            if start_step and path.exists():
                _truncate_jsonl(path, start_step)
            self.jsonl = open(path, "a", buffering=1)

    def scalars(self, step: int, values: dict) -> None:
        if self.tb is None:
            return
        for k, v in values.items():
            if v is not None:
                self.tb.add_scalar(k, v, step)

    def record(self, obj: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(obj) + "\n")

    def text(self, tag: str, text: str, step: int) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, text, step)

    def image(self, tag: str, img, step: int) -> None:
        """An RGB uint8 image, shape (3, H, W)."""
        if self.tb is not None:
            self.tb.add_image(tag, img, step, dataformats="CHW")

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()
        if self.jsonl is not None:
            self.jsonl.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()


def _truncate_jsonl(path: Path, start_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be logged again)."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= start_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def memory_scalars(memory_per_rank: list[dict]) -> dict:
    """memory/rank{r}/<key> for TensorBoard, in bytes."""
    out = {}
    for r, mem in enumerate(memory_per_rank):
        for k, v in mem.items():
            if k.endswith("_bytes"):  # not the host name / local rank that label the rank
                out[f"memory/rank{r}/{k}"] = v
    return out

"""Throughput, MFU, memory per rank (gathered to rank 0), and the writer of TensorBoard,
metrics.jsonl and the optional loggers (dtrain/reporting/).

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
from dtrain.reporting.loggers import build_loggers
from dtrain.reporting.summary import GiB, SummaryBuilder, draw_chart
from dtrain.reporting.tensorboard import EVENTS_DIR, hparams_summaries, layout, session_end


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
    """Writes on rank 0, a no-op elsewhere: TensorBoard (events in
    <run_dir>/tensorboard/<run_name>/), metrics.jsonl, and the W&B / MLflow loggers that
    metrics.wandb / metrics.mlflow turn on. Scalars go to TensorBoard and the loggers alike."""

    def __init__(
        self,
        run_dir: Path,
        env: DistEnv,
        cfg: MetricsConfig,
        start_step: int = 0,
        run_name: str = "run",
    ):
        self.enabled = env.is_main
        self.tb = None
        self.jsonl = None
        self.loggers: list = []
        self.summary = SummaryBuilder(run_dir)  # the run's final numbers, as compare reads them
        if not self.enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run logged past the step we resume from (those
            # of that step itself stay, as in metrics.jsonl: the checkpoint holds them).
            self.tb = SummaryWriter(
                str(run_dir / EVENTS_DIR / run_name),
                purge_step=start_step + 1 if start_step else None,
            )
        if cfg.jsonl:
            path = run_dir / "metrics.jsonl"
            if start_step and path.exists():
                _truncate_jsonl(path, start_step)
                for line in path.read_text().splitlines():  # the summary covers the whole run
                    self.summary.add(json.loads(line))
            self.jsonl = open(path, "a", buffering=1)
        self.loggers = build_loggers(cfg, run_dir, run_name)

    def start(self, hparams: dict, config: dict, *, cuda: bool, mfu: bool) -> None:
        """At every start (a resume too): the HParams session and the Custom Scalars layout in
        TensorBoard; the hparams and the whole config to the loggers."""
        if not self.enabled:
            return
        if self.tb is not None:
            for summary in hparams_summaries(hparams):
                self.tb._get_file_writer().add_summary(summary)
            shown = {
                "downstream": bool((config.get("downstream") or {}).get("every")),
                "evals": bool((config.get("trainer") or {}).get("eval_every")),
                "mixture": bool((config.get("data") or {}).get("mixture")),
            }
            self.tb.add_custom_scalars(layout(cuda=cuda, mfu=mfu, **shown))
        for logger in self.loggers:
            logger.start(hparams, config)

    def scalars(self, step: int, values: dict) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        for logger in self.loggers:
            logger.scalars(step, values)

    def record(self, obj: dict) -> None:
        if not self.enabled:
            return
        self.summary.add(obj)
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

    def finish(self, step: int) -> dict:
        """At the end of a run: its final numbers (the row compare prints) as a TensorBoard
        text table and to the loggers' summaries, compare's chart as an image, then close.
        Returns the numbers."""
        if not self.enabled:
            return {}
        run = self.summary.result()
        final = run.final()
        if self.tb is not None:
            rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in final.items())
            self.tb.add_text("summary", "| | |\n|---|---|\n" + rows, step)
        for logger in self.loggers:
            logger.summary(final)
        self._chart(run, step)
        self.close(ok=True)
        return final

    def _chart(self, run, step: int) -> None:
        if run.measured_bytes is None or not (self.tb is not None or self.loggers):
            return
        try:
            fig = draw_chart([run])
        except ImportError:  # matplotlib is an extra ('dtrain[plot]'): no chart without it
            return
        for logger in self.loggers:
            logger.figure(CHART_TAG, fig, step)
        if self.tb is not None:
            self.tb.add_figure(CHART_TAG, fig, step)  # closes the figure
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def close(self, ok: bool = False) -> None:
        """`ok`: the run ended normally (its HParams status; W&B's exit code; MLflow's status)."""
        if self.tb is not None:
            self.tb._get_file_writer().add_summary(session_end(ok))
            self.tb.close()
            self.tb = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        for logger in self.loggers:
            logger.close(ok)
        self.loggers = []


CHART_TAG = "memory/predicted_vs_measured"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


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


def memory_scalars(memory_per_rank: list[dict], plan=None) -> dict:
    """Memory for TensorBoard and the loggers, in GiB (metrics.jsonl keeps the exact bytes):
    memory/rank{r}/<quantity>_gib for every rank, memory/worst_rank/{peak,model_state}_gib (the
    run's figures in HParams) and, given the plan (rank 0's), memory/predicted/<quantity>_gib beside
    the measured ones at every logged step."""
    out, worst = {}, {}
    for r, mem in enumerate(memory_per_rank):
        # Byte counts only, not the host name / local rank that label the rank.
        q = {k.removesuffix("_bytes"): v for k, v in mem.items() if k.endswith("_bytes")}
        q["model_state"] = sum(q.get(k, 0) for k in ("params", "grads", "optim", "master"))
        for k, v in q.items():
            out[f"memory/rank{r}/{k}_gib"] = v / GiB
            worst[k] = max(worst.get(k, 0), v)
    # The worst rank's peak: what the CUDA caching allocator reserved on a GPU, the process's
    # peak RSS on a CPU (one series, so that the HParams table has one peak memory column).
    peak = worst.get("peak_reserved", worst.get("peak_rss"))
    if peak is not None:
        out["memory/worst_rank/peak_gib"] = peak / GiB
    if "model_state" in worst:
        out["memory/worst_rank/model_state_gib"] = worst["model_state"] / GiB
    if plan is not None:
        predicted = {
            "params": plan.params_bytes,
            "grads": plan.grads_bytes,
            "optim": plan.optim_bytes,
            "model_state": plan.model_state_bytes,
        }
        if "peak_reserved" in worst:  # a GPU peak is predicted for CUDA runs alone
            predicted["peak_reserved"] = plan.peak_bytes
        out.update({f"memory/predicted/{k}_gib": v / GiB for k, v in predicted.items()})
    return out

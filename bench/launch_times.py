"""Launch to step 10, per strategy or precision, at 1b.

Each entry runs from a new process to step 10; the time is the wall clock from the launch until
the metrics.jsonl record of step 10 is written, with tokens/s of the steps after it. With
`--runs 2 --fresh-cache` each entry gets empty Inductor and Triton caches of its own: the first
run compiles everything (a new machine), the second launches the same config again on the
caches the first filled (a user's second launch), and the run's own compile-cache line is kept.

    python bench/launch_times.py [--strategies single,...] [--runs N] [--fresh-cache] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMON = [
    "model=1b",
    "data=synthetic",
    "trainer.seq_len=2048",
    "trainer.micro_batch_size=8",
    "trainer.max_steps=20",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "checkpoint.save_final=false",
]
STRATEGIES = {
    "single": (1, []),
    "single_fp8": (1, ["precision=fp8"]),
    "single_int8": (1, ["precision=int8"]),
    "ddp": (2, ["strategy=ddp"]),
    "fsdp": (2, ["strategy=fsdp"]),
    "zero1": (2, ["strategy=zero1"]),
    "zero2": (2, ["strategy=zero2"]),
    "zero3": (2, ["strategy=zero3"]),
    # DeepCompile compiling once, at step 0, instead of at steps 0 and 5 (strategy.
    # deepcompile_schedule; which keeps zero3's speed is what this measures)
    "zero3_once": (2, ["strategy=zero3", "strategy.deepcompile_schedule=once"]),
    "zero3_resident": (2, ["strategy=zero3", "strategy.deepcompile_schedule=resident"]),
    "zero3_gather": (2, ["strategy=zero3", "strategy.deepcompile_schedule=gather"]),
    # Without DeepCompile: DeepSpeed's ZeRO-3 hooks, eager or under plain torch.compile.
    "zero3_eager": (2, ["strategy=zero3", "strategy.deepcompile=false"]),
    "zero3_compiled": (
        2,
        ["strategy=zero3", "strategy.deepcompile=false", "strategy.compile=true"],
    ),
}


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and every rank it started, so the GPUs are free for the next one.
    torchrun starts each rank in a session of its own (its DataLoader workers with it): each
    rank's group first, then the launcher's (a one-process run is the launcher's group)."""
    from dtrain.launcher import worker_pids

    for pid in worker_pids(proc.pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already, or not a group leader's group any more
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def step_time(
    metrics: Path, step: int, proc: subprocess.Popen, t0: float, limit: float
) -> float | None:
    """Seconds from t0 until metrics.jsonl holds `step`; None if the run ended first or
    `limit` seconds passed (the run is then stopped: its time is past any goal)."""
    needle = f'"step": {step},'
    while proc.poll() is None:
        if metrics.exists() and needle in metrics.read_text():
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > limit:
            kill_run(proc)
            return None
        time.sleep(0.2)
    return time.perf_counter() - t0 if metrics.exists() and needle in metrics.read_text() else None


def measure(name: str, root: Path, limit: float, cache: Path | None = None) -> dict:
    from dtrain.dist import train_command

    nproc, extra = STRATEGIES[name]
    if not any(x.startswith("precision=") for x in extra):
        extra = [*extra, "precision=bf16"]
    run_dir = root / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = train_command([*COMMON, *extra, f"hydra.run.dir={run_dir}"], nproc)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0")  # DeepSpeed's FusedAdam build
    if cache is not None:
        env.update(
            TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton")
        )
    t0 = time.perf_counter()
    log_path = root / f"{name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    t10 = step_time(run_dir / "metrics.jsonl", 10, proc, t0, limit)
    try:  # the run's 20 steps end soon after step 10: a hang past this is not timed
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_run(proc)
    recs = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    later = sorted(r["tokens_per_s"] for r in recs if r.get("step", 0) > 12 and "tokens_per_s" in r)
    return {
        "launch_to_step10_s": t10,
        "limit_s": limit,
        "stopped_at_limit": t10 is None and proc.returncode is not None and proc.returncode < 0,
        "tokens_per_s": later[len(later) // 2] if later else None,
        "returncode": proc.returncode,
        "compile_cache": cache_lines(log_path),
    }


def cache_lines(log: Path) -> list[str]:
    """The run's own words on what its compiling step took from the compile cache."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        line.split("torch.compile: ", 1)[1]
        for line in text.splitlines()
        if "torch.compile: " in line
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--strategies",
        default="single,ddp,fsdp,zero1,zero2,zero3",
        help=f"any of {','.join(STRATEGIES)}",
    )
    ap.add_argument("--runs", type=int, default=1, help="launches of each entry, one after another")
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="each entry starts from empty compile caches of its own, kept for its later runs",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--root", type=Path, default=Path("/tmp/runs/launch"))
    ap.add_argument("--limit", type=float, default=150, help="seconds to wait for step 10")
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds for all of them: a strategy that could not run to its limit in what is "
        "left is skipped (for a machine with a hard time limit; the figures so far are kept)",
    )
    args = ap.parse_args()
    import torch

    args.root.mkdir(parents=True, exist_ok=True)
    out = {"card": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    end = time.perf_counter() + args.budget if args.budget is not None else None
    for name in args.strategies.split(","):
        out[name] = skip_reason(STRATEGIES[name][0], out["gpus"], args.limit, end)
        if out[name] is None:
            cache = args.root / f"cache_{name}" if args.fresh_cache else None
            if cache is not None:
                subprocess.run(["rm", "-rf", str(cache)], check=True)
            runs = [measure(name, args.root, args.limit, cache) for _ in range(args.runs)]
            out[name] = runs[0] if args.runs == 1 else runs
        print(name, json.dumps(out[name]), flush=True)
        if args.out:  # after each: a call cut short keeps what it measured (whole: renamed)
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(out, indent=1))
            tmp.replace(args.out)


def skip_reason(nproc: int, gpus: int, limit: float, end: float | None) -> str | None:
    """Why a strategy is not measured, or None: too few GPUs, or a start that could take
    `limit` seconds (and its steps after step 10 as long again) not fitting before `end`."""
    if nproc > gpus:
        return f"skipped: needs {nproc} GPUs"
    if end is not None and time.perf_counter() + 2 * limit > end:
        return f"skipped: {2 * limit:.0f} s for it no longer fit the budget"
    return None


if __name__ == "__main__":
    main()

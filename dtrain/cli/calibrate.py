"""Measure this machine for the planner and write a profile that plan (and training) use.

    python -m dtrain.cli.calibrate                          # one process: compute only
    torchrun --nproc_per_node=8 -m dtrain.cli.calibrate     # and the collectives
    python -m dtrain.cli.calibrate out=/tmp/profile.json seconds=20 device=cpu

Measures matmul throughput per dtype (fp32, tf32 on GPUs, bf16, and fp8 / int8 where the
device has them), memory bandwidth (a large copy), and, when launched under torchrun, the bus
bandwidth and latency of all-reduce, all-gather and reduce-scatter (nccl-tests' definition; on
CPU through gloo, which has no reduce-scatter). Within `seconds` (default 30, at most 60).
Rank 0 writes the profile: out=, default $DTRAIN_CACHE (else ~/.cache/dtrain)/profile-<gpu>.json,
where `python -m dtrain.cli.plan` finds it for that gpu= (profile=auto). Bad input: one line,
exit code 2.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CalibrateArgs:
    out: str | None = None  # the profile's path (default: the cache, named by the GPU)
    seconds: float = 30.0  # time budget for all measurements
    size: int | None = None  # square matmul size (default 8192 on GPU, 512 on CPU)
    comm_mb: float | None = None  # collective message size in MiB (default 256 GPU, 4 CPU)
    device: str = "auto"  # auto | cpu | cuda


def _timed(fn, budget: float, sync, agree=None) -> float:
    """Seconds per call of fn, over as many calls as fit `budget` (after one warm-up). With
    `agree` (a function of one float, for collectives) every rank makes the same calls."""
    start = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - start
    calls = max(1, min(1000, int(budget / max(first, 1e-6))))
    if agree is not None:
        calls = int(agree(calls))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def _matmul_fn(kind: str, n: int, device):
    """A callable running one n x n x n matmul of `kind`, or a string saying why not."""
    import torch

    cuda = device.type == "cuda"
    if kind == "tf32" and not cuda:
        return "tf32 is a GPU tensor-core mode"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
    if kind in ("fp32", "tf32", "bf16"):
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        return lambda: a @ b
    if kind == "int8":
        a, b = (torch.randint(-8, 8, (n, n), device=device, dtype=torch.int8) for _ in range(2))
        return lambda: torch._int_mm(a, b)
    if not cuda or torch.cuda.get_device_capability(device) < (8, 9):
        return "no fp8 tensor cores here"
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def measure_compute(device, n: int, budget: float) -> tuple[dict, float, list[str]]:
    """(matmul FLOP/s per kind, memory bytes/s, notes)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flops, notes = {}, []
    kinds = ("fp32", "tf32", "bf16", "fp8", "int8")
    for kind in kinds:
        try:
            fn = _matmul_fn(kind, n, device)
            if isinstance(fn, str):
                notes.append(f"{kind}: not measured ({fn})")
                continue
            flops[kind] = 2 * n**3 / _timed(fn, budget / (len(kinds) + 1), sync)
        except (RuntimeError, TypeError) as e:  # a dtype this build or device cannot multiply
            notes.append(f"{kind}: not measured ({str(e).splitlines()[0][:80]})")
    big = torch.empty((2**28 if device.type == "cuda" else 2**24) // 4, device=device)
    dst = torch.empty_like(big)
    per_copy = _timed(lambda: dst.copy_(big), budget / (len(kinds) + 1), sync)
    return flops, 2 * big.numel() * 4 / per_copy, notes


def measure_comm(device, nbytes: int, budget: float) -> dict:
    """Bus bandwidth and per-step latency of each collective over all ranks (collective)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def agree(calls: int) -> int:  # the fewest any rank wants: all stop together
        t = torch.tensor([calls], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    out: dict = {
        "ranks": n,
        "nodes": n // int(os.environ.get("LOCAL_WORLD_SIZE", n)),
        "message_bytes": nbytes,
        "backend": dist.get_backend(),
    }
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        ring = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        steps = (2 if op == "all_reduce" else 1) * (n - 1)
        try:
            big, small = (_collective(op, size, n, device) for size in (nbytes, 4096))
            t_big = _timed(big, budget / 6, sync, agree)
            t_small = _timed(small, budget / 6, sync, agree)
        except (RuntimeError, ValueError) as e:  # gloo has no reduce-scatter
            out[op] = {"error": str(e).splitlines()[0][:120]}
            continue
        out[op] = {
            "busbw_bytes_per_s": ring * nbytes / t_big,
            "latency_s": t_small / steps,
            "seconds": t_big,
        }
    return out


def _collective(op: str, nbytes: int, n: int, device):
    import torch
    import torch.distributed as dist

    numel = max(n, nbytes // 4 // n * n)  # divisible by the ranks
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    # reduce_scatter_single is reduce_scatter_tensor's newer name (the old one warns).
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    return lambda: reduce_scatter(shard, full)


def profile_name(device) -> str:
    import torch

    from dtrain.hardware import gpu_named

    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    gpu = gpu_named(name)
    return gpu.name if gpu is not None else name


def calibrate(args: CalibrateArgs) -> tuple[dict, Path | None]:
    """Measure; (the profile, where rank 0 wrote it; None on other ranks)."""
    import torch
    import torch.distributed as dist

    from dtrain.memory.machine import PROFILE_VERSION, default_profile_path

    want = args.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    comm_share = 0.5 if world > 1 else 0.0
    n = args.size or (8192 if use_cuda else 512)
    flops, hbm, notes = measure_compute(device, n, args.seconds * (1 - comm_share) * 0.9)
    comm = None
    if world > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo")
        mb = args.comm_mb or (256 if use_cuda else 4)
        comm = measure_comm(device, int(mb * 2**20), args.seconds * comm_share * 0.9)
    else:
        notes.append("one process: communication not measured (launch under torchrun for it)")
    name = profile_name(device)
    profile = {
        "version": PROFILE_VERSION,
        "name": name,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "matmul_size": n,
        "matmul_flops": flops,
        "hbm_bytes_per_s": hbm,
        "comm": comm,
        "notes": notes,
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        path = Path(args.out).expanduser() if args.out else default_profile_path(name)
        from dtrain.reliability.safe_write import write_text

        # A measured profile replaces the last one (its purpose); a link there is refused.
        write_text(path, json.dumps(profile, indent=1), overwrite=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return profile, path


def main(argv: list[str] | None = None) -> int:
    from dtrain.cli._kv import exit_with_help_if_asked, parse_kv
    from dtrain.errors import ConfigError, UserError, fail

    argv = sys.argv[1:] if argv is None else argv
    exit_with_help_if_asked(argv, "python -m dtrain.cli.calibrate", __doc__, CalibrateArgs)
    try:
        args = parse_kv(CalibrateArgs, argv)
        if not 1 <= args.seconds <= 60:
            raise ConfigError(f"seconds must be in [1, 60], got {args.seconds}")
        if args.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={args.device!r}; valid choices: auto, cpu, cuda")
        if args.size is not None and args.size < 16:
            raise ConfigError(f"size must be >= 16, got {args.size}")
        profile, path = calibrate(args)
    except UserError as e:
        fail(e, rank0_only=False)
    if path is not None:
        for kind, f in profile["matmul_flops"].items():
            print(f"matmul {kind}: {f / 1e12:,.3f} TFLOP/s")
        print(f"memory copy: {profile['hbm_bytes_per_s'] / 1e9:,.1f} GB/s")
        for op, m in (profile["comm"] or {}).items():
            if isinstance(m, dict) and "busbw_bytes_per_s" in m:
                print(f"{op}: {m['busbw_bytes_per_s'] / 1e9:,.2f} GB/s bus bandwidth")
        print("\n".join(profile["notes"]))
        print(f"profile: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

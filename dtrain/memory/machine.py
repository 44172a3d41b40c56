"""The machine the speed plan prices a step on: a GPU's datasheet figures, or a profile that
`python -m dtrain.cli.calibrate` measured on the machine itself (JSON, docs/planner.md).

A profile stores what it measured: achieved matmul FLOP/s per dtype, memory bandwidth, and the
bus bandwidth of each collective (nccl-tests' definition, so the ring formulas of
dtrain.memory.speed apply to it as to a datasheet link). What it did not measure falls back to
the datasheet.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.errors import ConfigError
from dtrain.hardware import GpuSpec, peak_flops_of

PROFILE_VERSION = 1
MATMUL_KINDS = ("fp32", "tf32", "bf16", "fp8", "int8")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# A large bf16 GEMM reaches this share of the datasheet peak: torch.mm on the 1b/8b linear
# shapes ran at 681-804 TFLOP/s (median ~750) on an H200 (bench/results/2026-11-27-int8/
# int8_kernels.md). A measured rate is divided by it to stand in for the peak, so a profile of
# a datasheet-like card plans what the datasheet plans.
GEMM_SHARE_OF_PEAK = 0.76
# NCCL's large-message bus bandwidth is about this share of the link's datasheet figure
# (nccl-tests on NVSwitch H100 boxes report 360-390 of 450 GB/s for all-reduce).
LINK_SHARE = 0.8
GPUS_PER_NODE = 8  # HGX/DGX nodes


@dataclass
class Machine:
    """What one GPU can do, and its links: the inputs of dtrain.memory.speed."""

    name: str
    peak_flops: dict[str, float]  # per matmul kind, datasheet-equivalent (0: none)
    hbm_bytes_per_s: float
    # Achievable bus bandwidth (bytes/s) and per-step latency (s) of each collective, within a
    # node ("intra") and between nodes ("inter").
    links: dict[str, dict[str, tuple[float, float]]]
    gpus_per_node: int = GPUS_PER_NODE
    mfu_peak: dict[str, float] = field(default_factory=dict)  # datasheet peaks, for MFU
    source: str = "datasheet"  # or the profile's path
    notes: list[str] = field(default_factory=list)

    def link(self, op: str, inter: bool) -> tuple[float, float]:
        return self.links["inter" if inter else "intra"][op]


def datasheet_machine(gpu: GpuSpec, gpus_per_node: int = GPUS_PER_NODE) -> Machine:
    intra = (gpu.nvlink_bytes_per_s * LINK_SHARE, gpu.nvlink_latency_s)
    inter = (gpu.net_bytes_per_s * LINK_SHARE, gpu.net_latency_s)
    peaks = {k: peak_flops_of(gpu, k) for k in MATMUL_KINDS}
    return Machine(
        name=gpu.name,
        peak_flops=dict(peaks),
        mfu_peak=peaks,
        hbm_bytes_per_s=gpu.hbm_bytes_per_s,
        links={
            "intra": dict.fromkeys(COLLECTIVES, intra),
            "inter": dict.fromkeys(COLLECTIVES, inter),
        },
        gpus_per_node=gpus_per_node,
    )


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def default_profile_path(name: str) -> Path:
    """$DTRAIN_CACHE (else ~/.cache/dtrain)/profile-<gpu or device name>.json."""
    cache = Path(os.environ.get("DTRAIN_CACHE", "~/.cache/dtrain")).expanduser()
    return cache / f"profile-{slug(name)}.json"


def read_profile(path: str | Path) -> dict:
    """A profile written by dtrain.cli.calibrate; one-line ConfigError if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"profile={path}: no such file; write one with python -m dtrain.cli.calibrate"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"profile={path} is not a JSON profile: {e}") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ConfigError(
            f"profile={path} is not a version-{PROFILE_VERSION} dtrain profile; "
            "write one with python -m dtrain.cli.calibrate"
        )
    return data


def apply_profile(machine: Machine, profile: dict, source: str) -> Machine:
    """The datasheet machine with what the profile measured in its place."""
    for kind, flops in (profile.get("matmul_flops") or {}).items():
        if kind in machine.peak_flops and flops:
            machine.peak_flops[kind] = flops / GEMM_SHARE_OF_PEAK
    if profile.get("hbm_bytes_per_s"):
        machine.hbm_bytes_per_s = profile["hbm_bytes_per_s"]
    comm = profile.get("comm") or {}
    where = "inter" if comm.get("nodes", 1) > 1 else "intra"
    for op in COLLECTIVES:
        m = comm.get(op)
        if m and m.get("busbw_bytes_per_s"):
            machine.links[where][op] = (m["busbw_bytes_per_s"], m.get("latency_s", 0.0))
    if not comm:
        machine.notes.append("the profile has no communication figures: datasheet links")
    machine.source = source
    return machine


def build_machine(
    gpu: GpuSpec, profile: str | Path | None = None, gpus_per_node: int = GPUS_PER_NODE
) -> Machine:
    """The datasheet of `gpu`, with the profile at `profile` applied when given."""
    machine = datasheet_machine(gpu, gpus_per_node)
    if profile is None:
        return machine
    return apply_profile(machine, read_profile(profile), str(profile))


def find_profile(gpu: GpuSpec, choice: str = "auto") -> Path | None:
    """`profile=` as the CLIs take it: auto (the default path for this GPU if it exists),
    none (datasheet), or a path."""
    if choice == "none":
        return None
    if choice == "auto":
        path = default_profile_path(gpu.name)
        return path if path.exists() else None
    return Path(choice)

"""Process-group set-up from torchrun's environment, device choice, seeding and rank helpers."""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int  # global: unique over all nodes; rank 0 logs and writes files
    local_rank: int  # on this node: picks the GPU
    world_size: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE)
    node_rank: int = 0  # this node's index (torchrun's GROUP_RANK)
    hostname: str = ""
    allocator: str = "-"  # the CUDA caching allocator's settings (configure_allocator)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The local rank's GPU (ranks of one node never share a card), or the CPU."""
    from dtrain.errors import ConfigError

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use auto or cpu")
    n = torch.cuda.device_count()
    if local_rank < n:
        return torch.device("cuda", local_rank)
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if n == 1 and len(visible) == 1:
        # The scheduler bound one GPU to this process (Slurm --gpus-per-task=1, one GPU per
        # container): it is cuda:0 here, whatever the local rank.
        return torch.device("cuda", 0)
    raise ConfigError(
        f"LOCAL_RANK={local_rank} but {socket.gethostname()} shows only {n} CUDA device(s) to "
        f"this process; start at most {n} processes per node (NPROC_PER_NODE / "
        "--nproc_per_node)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXPANDABLE = "expandable_segments:True"
# Where a user sets the allocator's options: torch 2.9+ reads PYTORCH_ALLOC_CONF too, and
# PYTORCH_CUDA_ALLOC_CONF (then HIP's) wins over it. Any of them set: dtrain leaves all alone
# (its setter would reset every option the string does not name).
USER_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(device: torch.device, expandable: bool, environ=os.environ) -> str | None:
    """The CUDA caching allocator's settings dtrain applies, or None where it leaves the
    allocator alone (CPU, expandable segments off, or the user set the allocator's options).

    Expandable segments: a segment grows in place instead of a new one being cut for every
    odd-sized request, so freed blocks of one size are not stranded beside requests of another:
    less memory held, same speed (raw outputs of 2026-11-26)."""
    if device.type != "cuda" or not expandable or any(v in environ for v in USER_ALLOC_VARS):
        return None
    return EXPANDABLE


def _allocator_setter():
    # torch's runtime switch (its own tests flip expandable segments this way); named
    # _accelerator_setAllocatorSettings from torch 2.9, torch.cuda.memory's before.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter or torch.cuda.memory._set_allocator_settings


def configure_allocator(device: torch.device, expandable: bool, environ=os.environ) -> str:
    """Apply `allocator_settings` (before the first allocation, so every segment is
    expandable); returns what the allocator runs with, for the run's record: dtrain's
    setting, "user: VAR=..." or "default" ("-" off CUDA). Each rank calls it for itself, so the
    environment is left as the user set it."""
    if device.type != "cuda":
        return "-"
    settings = allocator_settings(device, expandable, environ)
    if settings is not None:
        _allocator_setter()(settings)
        return settings
    user = [f"{v}={environ[v]}" for v in USER_ALLOC_VARS if v in environ]
    return "user: " + ", ".join(user) if user else "default"


def init_distributed(
    device: str = "auto",
    timeout_s: float = 600.0,
    force_group: bool = False,
    expandable_segments: bool = True,
) -> DistEnv:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); alone: no group.

    nccl on GPUs, gloo on CPU. The device is the local rank's GPU, so ranks of one node never
    share a card. On a GPU the caching allocator is configured first (`configure_allocator`).
    """
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    alloc = configure_allocator(dev, expandable_segments)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and force_group and not dist.is_initialized():
        # A multi-rank strategy started without torchrun: a group of one on this host.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        # DeepSpeed's engine asserts that a launcher set LOCAL_RANK.
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    if (world > 1 or force_group) and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # A group of one meets no peer: an in-process store, not a TCP one on MASTER_PORT
        # (a port found free and bound a moment later was taken by another process in CI:
        # EADDRINUSE). The variables stay set for libraries that read them (DeepSpeed).
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world == 1 else {}
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
            **alone,
        )
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        device=dev,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
        hostname=socket.gethostname(),
        allocator=alloc,
    )


def shutdown() -> None:
    """Leave the process group once every rank is done with it."""
    if dist.is_initialized():
        # gloo: a group torn down while a peer still has an op in flight aborts that peer now
        # and then ("terminate called without an active exception", seen in CI); a barrier
        # first means no rank tears down before all have finished their last collective.
        dist.barrier()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0, group=None):
    """Rank src's Python object on every rank (identity when not distributed)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj, group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_background_group(timeout_s: float):
    """A gloo group of every rank for a background thread's collectives (None alone): two
    threads issuing collectives on one group interleave them differently on each rank. gloo
    because DCP's async save needs a CPU backend. Collective: every rank calls it."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def train_command(overrides: list[str], nproc: int = 1) -> list[str]:
    """The command line that trains with `overrides`: python launch/train.py for one process,
    dtrain-torchrun --standalone with nproc ranks otherwise (sweeps, benchmarks and tests use
    it): torchrun that stops on a signal with a save and exit 0 (dtrain/launcher.py)."""
    import sys
    from pathlib import Path

    launch = str(Path(__file__).resolve().parents[1] / "launch" / "train.py")
    if nproc == 1:
        return [sys.executable, launch, *overrides]
    return [
        sys.executable,
        "-m",
        "dtrain.launcher",
        "--standalone",
        f"--nproc_per_node={nproc}",
        launch,
        *overrides,
    ]

"""The device mesh of a run: (dp, cp, tp), data parallelism outermost and tensor parallelism
innermost, so a tensor-parallel group is neighbouring ranks (one node, the fastest links).

Everything here but build_mesh is pure arithmetic on the config: the data loader, the planner
and the start-up checks ask it without a process group.
"""

from __future__ import annotations

from typing import NamedTuple

from dtrain.config import ModelConfig, ParallelConfig
from dtrain.errors import ConfigError


class DataCoords(NamedTuple):
    """Which data-parallel replica a rank belongs to: ranks of one replica read the same batch."""

    rank: int
    world: int
    copies: int  # ranks per replica (tp x cp), consecutive in rank order


def data_coords(rank: int, world_size: int, parallel: ParallelConfig) -> DataCoords:
    inner = parallel.tp * parallel.cp
    return DataCoords(rank // inner, world_size // inner, inner)


def is_parallel(parallel: ParallelConfig) -> bool:
    return parallel.tp > 1 or parallel.cp > 1


def check_layout(
    parallel: ParallelConfig, world_size: int, model: ModelConfig, seq_len: int
) -> None:
    """A layout that does not divide the world, the heads or the sequence: one line naming the
    value and what divides."""
    tp, cp = parallel.tp, parallel.cp
    if world_size % (tp * cp):
        raise ConfigError(
            f"parallel.tp={tp} x parallel.cp={cp} = {tp * cp} does not divide the world size "
            f"{world_size}; choose tp x cp among {divisors(world_size)}"
        )
    for key, value in (("n_head", model.n_head), ("n_kv_head", model.n_kv_head)):
        if value % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide model.{key}={value}; "
                f"choose parallel.tp among {divisors(value)}"
            )
    chunks = 2 * cp * tp if cp > 1 else tp
    if seq_len % chunks:
        what = "2 x cp x tp (each rank takes two chunks)" if cp > 1 else "tp"
        raise ConfigError(
            f"trainer.seq_len={seq_len} is not divisible by {what} = {chunks} "
            f"(parallel.tp={tp}, parallel.cp={cp}); choose a multiple of {chunks}"
        )


def divisors(n: int) -> str:
    """The divisors of n, for a message: "1, 2, 4"."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


class Meshes(NamedTuple):
    root: object  # the (dp, cp, tp) DeviceMesh
    dp_cp: object  # its dp and cp dimensions flattened into one: what FSDP shards over


def build_mesh(device_type: str, world_size: int, parallel: ParallelConfig) -> Meshes:
    """The (dp, cp, tp) mesh, and the flattened dp x cp dimension that FSDP shards over: both
    average the gradients of one batch, so FSDP reduces over their product."""
    from torch.distributed.device_mesh import init_device_mesh

    tp, cp = parallel.tp, parallel.cp
    mesh = init_device_mesh(
        device_type, (world_size // (tp * cp), cp, tp), mesh_dim_names=("dp", "cp", "tp")
    )
    return Meshes(mesh, mesh["dp", "cp"]._flatten("dp_cp"))

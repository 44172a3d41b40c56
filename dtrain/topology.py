"""Node awareness: which ranks share a node, whether the run dir is shared by every node, and
decisions that rank 0 takes for all.

Under torchrun every process knows its global RANK, its LOCAL_RANK on its node and its node's
GROUP_RANK (see dist.DistEnv). Across nodes three things can go wrong that one node never shows:
the nodes disagree on what is on disk (a node-local run dir, or a shared filesystem whose caches
lag), the nodes run different numbers of ranks, and an error raised on one rank leaves the others
waiting in the next collective. The helpers here turn each into a one-line error on every rank.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dtrain import dist as ddist
from dtrain.dist import DistEnv
from dtrain.errors import CheckpointError, ConfigError, UserError

T = TypeVar("T")


@dataclass(frozen=True)
class Node:
    node_rank: int
    hostname: str
    ranks: tuple[int, ...]  # global ranks on this node, in local-rank order


def gather_nodes(env: DistEnv) -> list[Node]:
    """Every node and the global ranks it runs (collective). Refuses nodes with different
    numbers of ranks: a mesh over nodes (HSDP) and per-node data-loader workers assume them
    equal, and torchrun only produces unequal ones by mistake."""
    me = (env.node_rank, env.hostname, env.local_rank, env.rank, env.local_world_size)
    rows = ddist.all_gather_object(me)
    by_node: dict[int, list] = {}
    for row in rows:
        by_node.setdefault(row[0], []).append(row)
    nodes = [
        Node(n, rs[0][1], tuple(r[3] for r in sorted(rs, key=lambda r: r[2])))
        for n, rs in sorted(by_node.items())
    ]
    sizes = {len(n.ranks) for n in nodes}
    if len(sizes) > 1:
        counts = ", ".join(f"{n.hostname} (node {n.node_rank}): {len(n.ranks)}" for n in nodes)
        raise ConfigError(
            f"nodes run different numbers of ranks ({counts}); give every node the same "
            "NPROC_PER_NODE (--nproc_per_node)"
        )
    return nodes


def describe(nodes: list[Node]) -> str:
    """'2 nodes x 1 ranks: hostA [0], hostB [1]' for the start-up log line."""
    per = len(nodes[0].ranks) if nodes else 0
    where = ", ".join(f"{n.hostname} {list(n.ranks)}" for n in nodes)
    return f"{len(nodes)} node(s) x {per} rank(s): {where}"


def on_rank0(env: DistEnv, fn: Callable[[], T]) -> T:
    """fn() on rank 0 only, its result (or its UserError) on every rank.

    For decisions that must be the same everywhere, such as which checkpoint to resume from:
    ranks listing a shared directory a moment apart, or through different caches, could
    otherwise pick different ones. An error on rank 0 is raised on all ranks, so none is left
    waiting for the others in a collective.
    """
    if not env.distributed:
        return fn()
    result: tuple = (None, None)
    if env.is_main:
        try:
            result = (fn(), None)
        except UserError as e:
            result = (None, e)
    value, err = ddist.broadcast_object(result)
    if err is not None:
        raise err
    return value


def check_shared_dir(path: Path, env: DistEnv) -> None:
    """Raise CheckpointError on every rank unless all ranks see the same directory `path`.

    A checkpoint is one folder written by all ranks and completed by rank 0 (manifest, marker,
    rename); resuming reads it from every rank. Both need the run dir on a filesystem every
    node mounts (NFS, Lustre, GPFS, FSx, a PVC with ReadWriteMany).
    """
    if not env.distributed:
        return
    path = Path(path)
    token = ddist.broadcast_object(uuid.uuid4().hex if env.is_main else None)
    probe = path / f".shared-probe-{token}"
    if env.is_main:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    ddist.barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    views = ddist.all_gather_object((env.rank, env.hostname, seen))
    ddist.barrier()  # everyone has looked before rank 0 removes the probe
    if env.is_main:
        try:
            os.remove(probe)
        except OSError:
            pass
    blind = [(r, h) for r, h, ok in views if not ok]
    if blind:
        hosts = sorted({h for _, h in blind})
        ranks = [r for r, _ in blind]
        raise CheckpointError(
            f"run dir {path} is not shared: rank(s) {ranks} on {', '.join(hosts)} cannot see "
            "what rank 0 writes there; put hydra.run.dir on a filesystem every node mounts "
            "(see docs/multinode.md)"
        )

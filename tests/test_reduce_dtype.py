"""precision.reduce_dtype: gradients reduced across ranks in bf16 instead of fp32 (DDP's
compress hook, FSDP's reduce_dtype, DeepSpeed's communication_data_type); refused where it
cannot apply."""

from __future__ import annotations

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.precision import build_precision
from tests.conftest import FAST, compose, launch, train_losses

CPU = torch.device("cpu")
STEPS = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=0", "precision=bf16"]


def precision(*overrides: str):
    return build_precision(compose(*FAST, *overrides).precision, CPU)


def test_bf16_reduce_is_set_and_fp32_stays_the_default():
    assert precision("precision=bf16").reduce_dtype == torch.float32
    p = precision("precision=bf16", "precision.reduce_dtype=bf16")
    assert p.reduce_dtype == torch.bfloat16 and p.reduce_override


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["precision=bf16", "precision.reduce_dtype=fp16"], "choose fp32 or bf16"),
        (["precision=fp32", "precision.reduce_dtype=bf16"], "with precision=fp32; choose fp32"),
    ],
)
def test_a_reduce_dtype_the_precision_does_not_compute_in_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        precision(*overrides)


def test_single_refuses_it_in_one_line(tmp_path):
    res = launch(*FAST, *STEPS, "precision.reduce_dtype=bf16", f"hydra.run.dir={tmp_path}/r")
    assert res.returncode == 2
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "strategy=single reduces none" in lines[0], res.stderr


def losses(tmp_path, name: str, *overrides: str) -> dict[int, float]:
    res = launch(*FAST, *STEPS, *overrides, f"hydra.run.dir={tmp_path}/{name}", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    return train_losses(tmp_path / name)


def check_bf16_reduce_is_taken(tmp_path, strategy: str):
    """Same run with fp32 and bf16 reduction: the first loss (before any update) is equal, the
    later ones differ (the bf16-rounded gradients moved the weights) but stay close."""
    a = losses(tmp_path, "fp32", f"strategy={strategy}")
    b = losses(tmp_path, "bf16", f"strategy={strategy}", "precision.reduce_dtype=bf16")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert a[1] == b[1]
    assert any(a[s] != b[s] for s in (2, 3, 4)), (a, b)
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-2 * abs(a[s]), (s, a[s], b[s])


@pytest.mark.slow  # 30 s; the hook's arithmetic is checked bit for bit in the fast tier below
def test_ddp_reduces_in_bf16(tmp_path):
    check_bf16_reduce_is_taken(tmp_path, "ddp")


@pytest.mark.slow
def test_fsdp_reduces_in_bf16(tmp_path):
    check_bf16_reduce_is_taken(tmp_path, "fsdp")


def test_deepcompile_refuses_a_reduce_dtype_it_would_ignore():
    """DeepCompile reduces in the gradients' own dtype (bf16 under precision=bf16): asking for
    fp32 is an error (zero3 on CUDA has DeepCompile on by default), asking for bf16 is what it
    does; the eager engine takes either."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    from dtrain.dist import DistEnv
    from dtrain.strategies import build_strategy

    cuda = DistEnv(rank=0, local_rank=0, world_size=2, device=torch.device("cuda", 0))
    for want, refused in (("fp32", True), ("bf16", False)):
        cfg = compose(*FAST, "strategy=zero3", "precision=bf16", f"precision.reduce_dtype={want}")
        p = build_precision(cfg.precision, CPU)
        if refused:  # the checks read the device type only
            with pytest.raises(ConfigError, match="reduces gradients in their own dtype"):
                build_strategy(cfg.strategy, p, cuda)
        else:
            assert build_strategy(cfg.strategy, p, cuda).deepcompile
        cfg.strategy.deepcompile = False
        s = build_strategy(cfg.strategy, p, cuda)
        assert s.ds_config(cfg.model)["communication_data_type"] == want


def test_ddp_hook_gives_the_bf16_mean_in_fp32(tmp_path):
    """dtrain's DDP hook: after a no_sync micro-step and a synced one, each rank's gradient is
    the mean over ranks of the accumulated gradients, computed in bf16 (each halved in bf16,
    summed in bf16) and written back as fp32: equal on both ranks, not the fp32 mean."""
    from tests.conftest import ROOT, torchrun_script

    res = torchrun_script(ROOT / "tests" / "reduce_hook_worker.py", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    outs = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    g0, g1 = (o["grad"] for o in outs)
    local = outs[0]["local"]
    want = sum(g.to(torch.bfloat16) / 2 for g in local).float()
    assert g0.dtype == torch.float32 and torch.equal(g0, g1)
    assert torch.equal(g0, want)
    mean = (local[0] + local[1]) / 2
    assert not torch.equal(g0, mean)  # not the fp32 mean, but within bf16's rounding of it
    assert (g0 - mean).abs().max() <= 2**-7 * mean.abs().max()

"""Tensor and context parallelism without a process group: the layout checks, which ranks
share a batch, the context-parallel chunks, and the refusals before a run starts."""

import pytest

from dtrain.config import ModelConfig, ParallelConfig, StrategyConfig
from dtrain.errors import ConfigError
from dtrain.parallel.context import chunk_positions
from dtrain.parallel.mesh import check_layout, data_coords
from dtrain.precision import PRECISIONS
from dtrain.strategies import check_parallel
from tests.conftest import FAST, launch

MODEL = ModelConfig(n_head=8, n_kv_head=2, d_model=64)


def _check(strategy="fsdp", precision=None, world=4, tp=2, cp=1, seq_len=64, **kw):
    check_parallel(
        StrategyConfig(name=strategy, **kw),
        ParallelConfig(tp=tp, cp=cp),
        precision,
        world_size=world,
        model=MODEL,
        seq_len=seq_len,
    )


def test_ranks_of_one_tensor_and_context_group_read_one_batch():
    p = ParallelConfig(tp=2, cp=2)
    coords = [data_coords(r, 8, p) for r in range(8)]
    assert [c.rank for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {(c.world, c.copies) for c in coords} == {(2, 4)}
    assert data_coords(3, 4, ParallelConfig()) == (3, 4, 1)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_chunks_cover_the_sequence_once_with_equal_causal_work(cp):
    T = 32
    chunks = [chunk_positions(T, cp, r) for r in range(cp)]
    assert sorted(int(p) for c in chunks for p in c) == list(range(T))
    # Under the causal mask a query at position p attends over p + 1 keys.
    work = {int((c + 1).sum()) for c in chunks}
    assert len(work) == 1, work


def test_a_layout_that_divides_world_heads_and_sequence_is_accepted():
    _check(tp=2)  # 8 heads, 2 kv heads, 4 ranks, 64 tokens
    _check(tp=2, cp=2, seq_len=64)
    check_layout(ParallelConfig(cp=4), 4, MODEL, 8)


WORLD = r"parallel.tp=4 x parallel.cp=1 = 4 does not divide the world size 2; "
KV = r"parallel.tp=4 does not divide model.n_kv_head=2; choose parallel.tp among 1, 2$"
SEQ = r"trainer.seq_len=12 is not divisible by 2 x cp x tp .* = 8 .*choose a multiple of 8$"
DDP = r"strategy=ddp does not compose with parallel.tp=2, parallel.cp=1; choose strategy=fsdp"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp=4, world=2), WORLD + "choose tp x cp among 1, 2$"),
        (dict(tp=4, world=4), KV),
        (dict(tp=2, cp=2, seq_len=12), SEQ),
        (dict(tp=1, cp=2, world=2, seq_len=6), r"choose a multiple of 4$"),
        (dict(strategy="ddp"), DDP),
        (dict(strategy="zero3"), r"strategy=zero3 does not compose"),
        (dict(replicate_degree=2), r"strategy.replicate_degree=2 \(HSDP\) does not compose"),
        (dict(precision=PRECISIONS["int8"]), r"precision=int8 swaps modules .*precision=fp32"),
    ],
)
def test_layouts_that_cannot_be_built_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message):
        _check(**kw)


def test_heads_are_checked_as_well_as_kv_heads():
    with pytest.raises(ConfigError, match="model.n_head=4"):
        check_layout(ParallelConfig(tp=8), 8, ModelConfig(n_head=4, d_model=64), 64)


def test_launch_refuses_a_layout_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    res = launch(*FAST, "strategy=fsdp", "parallel.tp=2", f"hydra.run.dir={run_dir}")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "does not divide the world size 1" in res.stderr
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()

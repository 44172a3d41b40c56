"""The Triton int8 kernels on a CUDA GPU (marked `gpu`; skipped without CUDA or Triton).

What they compute, against the portable path: the int32 products equal torch._int_mm's exactly
(odd shapes and dtrain's 1b/8b shapes), the fused dequantization and the quantize are the eager
path's fp32 operations bit for bit, and a training step of int8 linears on the Triton kernels
matches one on torch._int_mm (eagerly: bit for bit; under torch.compile: closely, Inductor's
quantize divides with a different rounding). On sm90+ the dispatch takes the Triton kernels.

    python -m pytest -q tests/gpu/test_int8_kernels.py
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from torch import nn

from dtrain.lowp.int8 import linear as i8
from dtrain.lowp.int8.options import Int8Options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

# (M, N, K): odd ones (not multiples of 16/64/128, one row, K=16), then dtrain's layers:
# 1b (d 2048, ffn 5632, 16384 tokens) and 8b (d 4096, kv 1024, ffn 14336, 8192 tokens).
ODD = [(33, 70, 100), (1, 1, 16), (257, 129, 64), (17, 8, 300), (1000, 1000, 1000), (130, 200, 72)]
LARGE = [(16384, 5632, 2048), (16384, 2048, 5632), (8192, 1024, 4096), (4096, 14336, 4096)]


@pytest.fixture(scope="module")
def it():
    from dtrain.lowp.int8 import triton_gemm as int8_triton

    assert not int8_triton.INTERPRET, "unset TRITON_INTERPRET for the GPU tests"
    return int8_triton


def _operands(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g).t()
    sa = torch.rand(m, 1, device="cuda", generator=g) + 0.01
    sb = torch.rand(1, n, device="cuda", generator=g) + 0.01
    return a, b, sa, sb


def test_sm90_takes_the_triton_kernels(monkeypatch, caplog):
    monkeypatch.setattr(i8, "_LOGGED", set())
    kernel, why = i8.select_kernel("cuda")
    if torch.cuda.get_device_capability() < (9, 0):
        assert kernel == "torch" and "sm90+" in why
        pytest.skip(f"not Hopper: {why}")
    assert kernel == "triton", why
    model = nn.Sequential(nn.Linear(64, 64)).cuda()
    with caplog.at_level(logging.INFO, logger="dtrain"):
        i8.apply_int8(model, lambda m, n: True)
    assert model[0].kernel == "triton"
    lines = [r.getMessage() for r in caplog.records if "int8 matmuls" in r.getMessage()]
    assert lines == [f"int8 matmuls: Triton sm90 kernels ({why})"]


@pytest.mark.parametrize("m,n,k", ODD + LARGE)
def test_int8_mm_equals_int_mm_exactly(it, m, n, k):
    a, b, _, _ = _operands(m, n, k)
    out = it.int8_mm(a, b, None, None, torch.int32)
    assert torch.equal(out, i8.int_mm(a, b))  # torch._int_mm, zero-padded where CUDA needs it


@pytest.mark.parametrize("i", range(3))
def test_every_tuned_config_is_exact(it, i):
    """Autotuning may pick any of them for a shape: each computes the exact product (and the
    same fused dequantization). M, N not multiples of the tiles, K one of 128 as at dtrain's
    shapes (the masked-K path is the small config's, on the odd shapes above)."""
    assert len(it._BIG) == 3  # the parametrization above counts them
    config = it._BIG[i]
    for m, n, k in [(2048 + 64, 1024 + 48, 1024)]:
        a, b, sa, sb = _operands(m, n, k)
        out = torch.empty(m, n, dtype=torch.int32, device="cuda")
        it._launch_int8_mm(a, b, out, None, None, config=config)
        assert torch.equal(out, i8.int_mm(a, b)), (m, n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        it._launch_int8_mm(a, b, out, sa.reshape(-1), sb.reshape(-1), config=config)
        assert torch.equal(out, i8.scaled_int_mm(a, sa, b, sb, torch.bfloat16)), (m, n, k)


@pytest.mark.parametrize("i", range(5))
def test_every_tma_config_is_exact(it, i):
    """The persistent TMA GEMM, each config it may be tuned to: M, N off the tiles; K = 1024
    (whole tiles) and 1040 (a multiple of 16, not of the tile: the last tile is TMA's zeros).
    Every config fits with bf16 outputs (what training writes); with an unscaled int32 output
    the BLOCK_K 128, 3-stage tiles may not fit in shared memory: such a config must fail to
    compile (autotuning then times it as infinite), never compute something else."""
    from triton.runtime.errors import OutOfResources

    assert len(it._TMA_TILES) == 5  # the parametrization above counts them
    if not it._has_tma(torch.device("cuda")):
        pytest.skip("no TMA before compute capability 9.0")
    config = it._TMA_TILES[i]
    for m, n, k in [(2048 + 64, 1024 + 48, 1024), (1000, 520, 1040)]:
        a, b, sa, sb = _operands(m, n, k)
        assert it.tma_ok(a, b)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        it._launch_int8_mm_tma(a, b, out, sa.reshape(-1), sb.reshape(-1), config=config)
        assert torch.equal(out, i8.scaled_int_mm(a, sa, b, sb, torch.bfloat16)), (config, m, n, k)
        out = torch.empty(m, n, dtype=torch.int32, device="cuda")
        try:
            it._launch_int8_mm_tma(a, b, out, None, None, config=config)
        except OutOfResources:
            assert config[2:] == (128, 8, 3), config  # only the big-K tiles may not fit
            continue
        assert torch.equal(out, i8.int_mm(a, b)), (config, m, n, k)


def test_tma_autotuning_skips_the_tiles_that_do_not_fit(it):
    """An int32 output, where 128x256x128 exceeds shared memory: autotuning over every config
    still gives the exact product; the tile that does not compile was timed as infinite (skipped,
    not fatal) and was not chosen."""
    import math

    if not it._has_tma(torch.device("cuda")):
        pytest.skip("no TMA before compute capability 9.0")
    m, n, k = 4096 + 64, 2048 + 48, 2048  # 2^34 multiply-adds: the autotuned path
    a, b, _, _ = _operands(m, n, k)
    out = torch.empty(m, n, dtype=torch.int32, device="cuda")
    it._launch_int8_mm_tma(a, b, out, None, None)
    assert torch.equal(out, i8.int_mm(a, b))
    tiles = it.tuned_configs()["tma"]
    chosen = [v for key, v in tiles.items() if key[:3] == (m, n, k) and "torch.int32" in key]
    assert len(chosen) == 1, tiles
    timings = it._int8_mm_tma_tuned.configs_timings  # this key's, the last one tuned

    def tile(c):
        kw = c.kwargs
        return (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], c.num_warps, c.num_stages)

    by_tile = {tile(c): t if isinstance(t, float) else t[0] for c, t in timings.items()}
    assert math.isinf(by_tile[(128, 256, 128, 8, 3)]), by_tile
    assert "BLOCK_M: 128, BLOCK_N: 256, BLOCK_K: 128" not in chosen[0]


def test_large_problems_take_the_tma_gemm(it, monkeypatch):
    """int8_mm's dispatch: TMA (the default) for large problems with 16-byte rows, the pointer
    kernel where TMA cannot read the operands (K = 1000) or precision.int8_gemm=pointer says so."""
    took = []
    tma, ptr = it._launch_int8_mm_tma, it._launch_int8_mm
    monkeypatch.setattr(
        it, "_launch_int8_mm_tma", lambda *a, **k: took.append("tma") or tma(*a, **k)
    )
    monkeypatch.setattr(it, "_launch_int8_mm", lambda *a, **k: took.append("ptr") or ptr(*a, **k))
    assert it.GEMM == "tma"
    if not it._has_tma(torch.device("cuda")):
        pytest.skip("no TMA before compute capability 9.0: the pointer kernel only")
    for (m, n, k), want in [((2048, 2048, 1024), "tma"), ((2048, 2048, 1000), "ptr")]:
        a, b, _, _ = _operands(m, n, k)
        took.clear()
        assert torch.equal(it.int8_mm(a, b, None, None, torch.int32), i8.int_mm(a, b))
        assert took == [want], (m, n, k, took)
    monkeypatch.setattr(it, "GEMM", "pointer")
    a, b, _, _ = _operands(2048, 2048, 1024)
    took.clear()
    it.int8_mm(a, b, None, None, torch.int32)
    assert took == ["ptr"]


def test_int8_mm_full_scale_values_are_exact(it):
    a = torch.full((256, 4096), -127, dtype=torch.int8, device="cuda")
    b = torch.full((384, 4096), 127, dtype=torch.int8, device="cuda").t()
    assert (it.int8_mm(a, b, None, None, torch.int32) == -127 * 127 * 4096).all()


@pytest.mark.parametrize(
    "m,n,k,out_dtype",
    [(*s, dt) for s in ODD for dt in (torch.float32, torch.bfloat16)]
    + [(*s, torch.bfloat16) for s in LARGE[:2]],  # (each new case compiles 8 configs: few)
)
def test_fused_dequantization_is_the_eager_arithmetic(it, m, n, k, out_dtype):
    """(float(acc) * sa) * sb, then one rounding to out_dtype: the same operations in the same
    order as int8.scaled_int_mm, so the same bits."""
    a, b, sa, sb = _operands(m, n, k)
    ref = i8.scaled_int_mm(a, sa, b, sb, out_dtype)
    out = it.int8_mm(a, b, sa, sb, out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()
    if m * n * k < 2**30:  # one scale (int8 grad-weight's): odd shapes only, as said above
        ref1 = i8.scaled_int_mm(a, sa, b, 1.0, out_dtype)
        assert torch.equal(it.int8_mm(a, b, sa, None, out_dtype), ref1)
    # and close to the float reference (float64 product of the dequantized operands)
    exact = (a.double() * sa.double()) @ (b.double() * sb.double())
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize(
    "r,c", [(33, 100), (1, 1), (257, 129), (16384, 2048), (2048, 5632), (5, 14336)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rowwise_equals_eager_bitwise(it, r, c, dtype):
    g = torch.Generator(device="cuda").manual_seed(r + c)
    x = (torch.randn(r, c, device="cuda", generator=g) * 3).to(dtype)
    if r > 2 and c > 6:
        x[1] = 0.0
        x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5], dtype=dtype)
        x[2, 6:] = 0.0
    ways = {  # the op (autotuned for row-major x), and each way with a fixed tile
        "op": lambda v, cs: it.quantize_rowwise(v, cs),
        "one pass": lambda v, cs: it.quantize_rows(v, cs, one_pass=True),
        "two sweeps": lambda v, cs: it.quantize_rows(v, cs, one_pass=False),
    }
    if c > it.ONE_PASS_MAX:
        del ways["one pass"]  # never offered there: the row would not fit in registers
    for way, quantize in ways.items():
        for name, v in {"row-major": x, "transposed view": x.t().contiguous().t()}.items():
            q, s = quantize(v, None)
            qe, se = i8.quantize_rowwise(v)
            assert torch.equal(s, se), (way, name)
            assert torch.equal(q, qe), (way, name, (q.int() - qe.int()).abs().max().item())
        cs = torch.rand(c, device="cuda", generator=g) + 0.1
        q, s = quantize(x, cs)
        qe, se = i8.quantize_rowwise(x.float() * cs)
        assert torch.equal(q, qe) and torch.equal(s, se), way


@pytest.mark.parametrize("r,c", [(16384, 2048), (16384, 5632), (8192, 14336), (300, 1000)])
def test_every_quantize_tile_autotuning_may_choose_is_exact(it, r, c, monkeypatch):
    """Each QUANTIZE_TILES config prune_row_tiles offers for the row, launched as autotuning
    launches it, against the eager quantize bit for bit (bf16 activations, as training's)."""
    monkeypatch.setattr(it, "QUANTIZE_TILE", "tuned")  # whatever an earlier test configured
    g = torch.Generator(device="cuda").manual_seed(c)
    x = (torch.randn(r, c, device="cuda", generator=g) * 3).bfloat16()
    qe, se = i8.quantize_rowwise(x)
    row_c = 1 << (c - 1).bit_length()
    offered = it.prune_row_tiles(it.row_tile_configs(it.QUANTIZE_TILES), {}, ROW_C=row_c)
    assert offered
    for cfg in offered:
        q = torch.empty_like(qe)
        s = torch.empty_like(se)
        grid = (-(-r // cfg.kwargs["BLOCK_R"]),)
        args = (x, s, q, s, r, c, x.stride(0), x.stride(1))
        kw = dict(HAS_COL_SCALE=False, ROW_C=row_c, num_warps=cfg.num_warps, **cfg.kwargs)
        it._quantize_rowwise_kernel[grid](*args, **kw)
        assert torch.equal(s, se) and torch.equal(q, qe), cfg
    q, s = it.quantize_rowwise(x, None)
    assert torch.equal(q, qe) and torch.equal(s, se)
    chosen = it.tuned_configs()["quantize"]
    assert any(k[:3] == (r, c, False) for k in chosen), chosen


def test_long_reductions_are_chunked_exactly(monkeypatch):
    monkeypatch.setattr(i8, "MAX_REDUCTION", 256)
    a, b, sa, sb = _operands(300, 200, 1000)
    for s in (sb, 1.0):
        out = i8._scaled_mm(a, sa, b, s, torch.float32, "triton")
        assert torch.equal(out, i8.scaled_int_mm(a, sa, b, s, torch.float32))


def _mlp(d=256, ffn=704, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d, ffn, bias=False), nn.SiLU(), nn.Linear(ffn, d, bias=False)
    ).cuda()


def _train(model, steps=3, compile=False):
    """AdamW steps under bf16 autocast: the losses, and the first step's output and grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn = torch.compile(model) if compile else model
    g = torch.Generator(device="cuda").manual_seed(0)
    losses, first = [], None
    for _ in range(steps):
        x = torch.randn(8, 200, 256, device="cuda", generator=g).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
            loss = (y.float() - x.detach()).pow(2).mean()
        loss.backward()
        if first is None:
            first = [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first


@pytest.mark.parametrize("grad_weight", ["bf16", "int8", "int8_grouped"])
def test_a_training_step_is_the_portable_paths_bit_for_bit(grad_weight):
    ref, tri = _mlp(), _mlp()
    i8.apply_int8(ref, lambda m, n: True, grad_weight=grad_weight, kernel="torch")
    i8.apply_int8(tri, lambda m, n: True, grad_weight=grad_weight, kernel="triton")
    loss_r, first_r = _train(ref)
    loss_t, first_t = _train(tri)
    for name, r, t in zip(["y", "dx", "dw1", "dw2"], first_r, first_t, strict=True):
        assert torch.equal(r, t), (name, (r.float() - t.float()).abs().max().item())
    torch.testing.assert_close(torch.tensor(loss_t), torch.tensor(loss_r), rtol=1e-5, atol=0)


@pytest.mark.parametrize("quantize", ["fused", "apart", "gradients"])
def test_compiled_training_steps_match_the_portable_path(quantize):
    """torch.compile: Triton GEMMs (opaque custom ops) and Inductor's fused quantize (or, with
    precision.int8_quantize=apart, the Triton quantize op), against the eager portable path:
    close, not equal (Inductor fuses the quantize into its producer without rounding that to
    bf16 first, and divides with its own rounding: the int8 values move by one step here and
    there, about the size of int8's own rounding)."""
    torch._dynamo.reset()
    ref, tri = _mlp(), _mlp()
    options = Int8Options(quantize=quantize)
    i8.apply_int8(ref, lambda m, n: True, grad_weight="bf16", kernel="torch", options=options)
    i8.apply_int8(tri, lambda m, n: True, grad_weight="bf16", kernel="triton", options=options)
    loss_r, first_r = _train(ref)
    loss_t, first_t = _train(tri, compile=True)
    for name, r, t in zip(["y", "dx", "dw1", "dw2"], first_r, first_t, strict=True):
        rel = ((t.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < 5e-2, (name, rel)
    torch.testing.assert_close(torch.tensor(loss_t), torch.tensor(loss_r), rtol=1e-2, atol=0)


# --- the grouped grad-weight GEMM (dtrain/lowp/int8/grouped_triton.py) --------------------------

# (N, M, K) of dW = gq (N, M) @ xq (M, K): odd ones, then 1b's grad-weights at 16384 tokens.
GROUPED = [(33, 300, 70), (1, 129, 1), (130, 1000, 72), (2048, 16384, 5632), (5632, 16384, 2048)]


def _grouped_operands(n, m, k, seed=0):
    from tests.gpu.gluon_grouped_check import operands

    return operands(n, m, k, seed)


@pytest.mark.parametrize("choice", ["triton", "auto"])
@pytest.mark.parametrize("n,m,k", GROUPED)
def test_grouped_gemm_is_the_portable_paths_bit_for_bit(it, n, m, k, choice):
    """Through int8_mm_grouped, on the Triton kernels (autotuned) and on the default (the Gluon
    kernel where it applies), against one torch._int_mm per group, scaled and added in fp32 as
    eager does (the kernels' multiply and add are rounded apart, no fused multiply-add)."""
    from dtrain.lowp.int8 import grouped as ig
    from dtrain.lowp.int8 import grouped_triton as igt

    a, b, s = _grouped_operands(n, m, k)
    ref = ig.grouped_int_mm(a, s, b, torch.float32)
    with igt.grouped_gemm(choice):
        assert torch.equal(igt.int8_mm_grouped(a, b, s, torch.float32), ref)
        assert torch.equal(igt.int8_mm_grouped(a, b, s, torch.bfloat16), ref.bfloat16())
    if n * m * k >= 2**30 and torch.cuda.get_device_capability() >= (9, 0) and it.GEMM == "tma":
        assert it.takes_tma(a, b)  # 1b's shapes: the persistent TMA kernel


def test_every_grouped_tile_autotuning_may_choose_is_exact():
    """Each tile of the pointer kernel and of the TMA kernel (Hopper), edges in every
    dimension and a short last group."""
    from dtrain.lowp.int8 import grouped as ig
    from dtrain.lowp.int8 import grouped_triton as igt

    n, m, k = 1024 + 48, 2048 + 64 + 16, 512 + 40
    a, b, s = _grouped_operands(n, m, k)
    ref = ig.grouped_int_mm(a, s, b, torch.float32)
    launches = [(igt.launch, c) for c in [*igt._TILES, igt._SMALL]]
    if torch.cuda.get_device_capability() >= (9, 0):
        launches += [(igt.launch_tma, c) for c in igt._TILES]
    for launch, config in launches:
        out = torch.empty(n, k, device="cuda")
        launch(a, b, s, out, config=config)
        assert torch.equal(out, ref), (launch.__name__, config)


def _run_check(script: str, what: str, timeout: int) -> None:
    """Runs tests/gpu/<script> in a subprocess under `timeout` seconds: a kernel deadlocked on its
    barriers fails the test (naming the last launch it printed) instead of hanging the suite."""
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    try:
        res = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "gpu" / script)], cwd=ROOT, env=cli_env(),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        last = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-1:]
        pytest.fail(f"{what} did not finish in {timeout} s (a deadlock?); last: {last}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _skip_without_gluon_hopper() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels' wgmma is Hopper's (sm_90)")
    from dtrain.lowp.int8.gluon_support import has_gluon_hopper

    if not has_gluon_hopper():
        pytest.skip("this Triton has no Gluon for Hopper")


def test_gluon_gemm_is_the_portable_paths_bit_for_bit():
    """The warp-specialized Gluon GEMM (dtrain/lowp/int8/gluon_gemm.py; precision.int8_gemm=gluon)
    on Hopper at each tile and the tuned one, three times each, bf16 and fp32 out: edges in M, N
    and K, K under one step, fewer tiles than SMs, one tile, 1b's and 8b's GEMMs (every element
    stored: none left NaN); and int8_mm taking it for scaled products and the TMA kernel for the
    integer one (tests/gpu/gluon_gemm_check.py, in a subprocess under a timeout)."""
    _skip_without_gluon_hopper()
    _run_check("gluon_gemm_check.py", "the Gluon GEMM", timeout=240)


def test_gluon_grouped_gemm_is_the_portable_paths_bit_for_bit():
    """The Gluon kernel (dtrain/lowp/int8/grouped_gluon.py; the default where it applies) on
    Hopper at each of its tiles, three times each: edges in every dimension, a short last
    group, one group, less than one, and 1b's grad-weights (every tile stored: none left NaN);
    and int8_mm_grouped taking it by default and when chosen. In a subprocess under a timeout
    (tests/gpu/gluon_grouped_check.py): a deadlock on its barriers fails the test instead of
    hanging the suite."""
    _skip_without_gluon_hopper()
    _run_check("gluon_grouped_check.py", "the Gluon grouped GEMM", timeout=120)


@pytest.mark.parametrize("m,n", [(16384, 5632), (16384, 2048), (8192, 14336), (300, 1000)])
def test_grouped_quantize_kernel_is_the_torch_ops_bit_for_bit(m, n):
    """Autotuned and in every tile, on bf16 output gradients with a loud token, against the
    eager torch ops (their IEEE division: the kernel divides with div_rn)."""
    from dtrain.lowp.int8 import grouped as ig
    from dtrain.lowp.int8 import grouped_triton as igt

    g = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    dy[3] *= 40
    ts = torch.rand(m, 1, device="cuda", generator=g) + 0.01
    q_ref, s_ref = ig.quantize_groups(dy, ts)
    for block_n in (None, *dict(igt._QUANTIZE_TILES)):
        q, s = igt.quantize_groups(dy, ts, block_n=block_n)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), block_n


# --- the fused SwiGLU (dtrain/lowp/experimental/int8_swiglu.py, precision.int8_swiglu=fused) ----


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("r,c", [(16384, 5632), (1024, 14336), (1000, 700), (3, 5)])
def test_swiglu_kernels_compute_eagers_gate_and_quantizes(r, c, one_pass):
    """The gate's two fused kernels, one pass and two sweeps, at 1b's and 8b's rows, against
    eager CUDA ops on bf16. The kernels compute silu's formulas with Inductor's sigmoid
    (approximate exp and division), a few fp32 ulps from eager's: the same bf16 values but in
    at most a thousandth of them, by one step. The int8 codes are exactly the row quantize of
    the gradients the kernel returned, and the backward's codes of h are the forward's."""
    import torch.nn.functional as F

    from dtrain.lowp.experimental import int8_swiglu_triton as swt

    g = torch.Generator(device="cuda").manual_seed(0)
    a, b, dh = (
        (s * torch.randn(r, c, device="cuda", generator=g)).bfloat16() for s in (3.0, 1.0, 0.1)
    )
    hq, hs = swt.gate_quantize(a, b, one_pass=one_pass)
    ref_q, ref_s = i8.quantize_rowwise(F.silu(a) * b)
    assert (hq.int() - ref_q.int()).abs().max() <= 1
    assert (hq != ref_q).float().mean() <= 1e-3
    torch.testing.assert_close(hs, ref_s, rtol=2**-7, atol=0)
    ga, gb, gaq, gas, gbq, gbs, hq2, hs2 = swt.gate_backward_quantize(dh, a, b, one_pass=one_pass)
    assert torch.equal(hq2, hq) and torch.equal(hs2, hs)  # w2's input, recomputed: the same bits
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    (F.silu(a_) * b_).backward(dh)
    for got, ref in ((ga, a_.grad), (gb, b_.grad)):
        assert got.dtype == torch.bfloat16
        assert (got != ref).float().mean() <= 1e-3
        assert _bf16_steps_apart(got, ref) <= 1
    for grad, q, s in ((ga, gaq, gas), (gb, gbq, gbs)):
        ref_q, ref_s = i8.quantize_rowwise(grad)
        assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


@pytest.mark.parametrize("r,c", [(4096, 5632), (512, 14336)])
def test_swiglu_kernels_one_pass_and_two_sweeps_are_the_same_bits(r, c):
    """Both ways run the same jitted arithmetic, compiled: every output the same bits, and
    the ops' (autotuned among both ways' tiles) too."""
    from dtrain.lowp.experimental import int8_swiglu_triton as swt

    g = torch.Generator(device="cuda").manual_seed(1)
    a, b, dh = (
        (s * torch.randn(r, c, device="cuda", generator=g)).bfloat16() for s in (3.0, 1.0, 0.1)
    )
    one, two = (
        (*swt.gate_quantize(a, b, one_pass=p), *swt.gate_backward_quantize(dh, a, b, one_pass=p))
        for p in (True, False)
    )
    assert all(torch.equal(x, y) for x, y in zip(one, two, strict=True))
    tuned = (*swt.swiglu_quantize(a, b), *swt.swiglu_backward_quantize(dh, a, b))
    assert all(torch.equal(x, y) for x, y in zip(one, tuned, strict=True))
    chosen = swt.tuned_configs()
    assert any(k[:2] == (r, c) for k in chosen["forward"]), chosen
    assert any(k[:2] == (r, c) for k in chosen["backward"]), chosen


def _bf16_steps_apart(x: torch.Tensor, ref: torch.Tensor) -> int:
    """The largest distance in bf16 steps (ulps, as ordered int16 codes) between x and ref."""

    def code(t):
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -32768 - i, i)  # sign-magnitude to an ordered integer line

    return int((code(x) - code(ref)).abs().max().item())


def _swiglu_ffn():
    from dtrain.model import FeedForward, ModelConfig

    torch.manual_seed(0)
    return FeedForward(ModelConfig(d_model=256, ffn_hidden=704)).cuda()


@pytest.mark.parametrize("compile", [False, True])
def test_fused_swiglu_trains_as_the_three_linears(compile, monkeypatch):
    """A SwiGLU's AdamW steps under bf16 autocast: fused on the Triton kernels (compiled or
    not) against the three Int8Linear layers on the portable path, eager: close. Eager, the
    Triton GEMMs are exact and what moves is the gate's last bits; compiled, also x's quantize,
    which Inductor computes with its own division (as in the compiled test above, whose bounds
    these are)."""
    from dtrain.lowp.experimental import int8_swiglu as sw

    torch._dynamo.reset()
    ref, fused = _swiglu_ffn(), _swiglu_ffn()
    i8.apply_int8(ref, lambda m, n: True, grad_weight="bf16", kernel="torch")
    i8.apply_int8(fused, lambda m, n: True, grad_weight="bf16", kernel="triton")
    assert sw.fuse_swiglu(fused) == 1
    loss_r, first_r = _train(ref)
    loss_f, first_f = _train(fused, compile=compile)
    bound, rtol = (5e-2, 1e-2) if compile else (1e-2, 1e-3)
    for name, r, t in zip(["y", "dx", "dw1", "dw3", "dw2"], first_r, first_f, strict=True):
        rel = ((t.float() - r.float()).norm() / r.float().norm()).item()
        assert rel < bound, (name, rel)
    torch.testing.assert_close(torch.tensor(loss_f), torch.tensor(loss_r), rtol=rtol, atol=0)

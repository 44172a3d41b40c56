"""The Triton int8 kernels on CPU, in Triton's interpreter: what they compute, bit for bit.

Not collected by the default run (no test_ prefix): tests/test_int8_triton.py runs this file in
a subprocess with TRITON_INTERPRET=1, which must be set before the kernels are defined (the
GPU tests in the same pytest run need them compiled).

One difference from the GPU, by the interpreter: it casts fp32 to bf16 by truncation where the
GPU rounds to nearest even, so bf16 outputs are compared within one bf16 step here and bit for
bit in tests/gpu/test_int8_kernels.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_int8_triton.py"

from dtrain.lowp.experimental import int8_swiglu as sw  # noqa: E402
from dtrain.lowp.experimental import int8_swiglu_triton as swt  # noqa: E402
from dtrain.lowp.int8 import grouped as ig  # noqa: E402
from dtrain.lowp.int8 import grouped_triton as igt  # noqa: E402
from dtrain.lowp.int8 import linear as i8  # noqa: E402
from dtrain.lowp.int8 import triton_gemm as it  # noqa: E402
from dtrain.lowp.int8.options import Int8Options  # noqa: E402

# (M, N, K): not multiples of 16/32/64; a single row/column; K a multiple of 128 (EVEN_K).
SHAPES = [(33, 70, 100), (1, 1, 16), (257, 129, 64), (17, 8, 300), (64, 96, 256), (5, 3, 1)]


@pytest.fixture(autouse=True)
def _default_kernels(monkeypatch):
    """apply_int8 hands the ops the run's choices (configure): each test starts from, and leaves
    behind, the defaults."""
    monkeypatch.setattr(it, "GEMM", "tma")
    monkeypatch.setattr(it, "QUANTIZE_TILE", "tuned")
    monkeypatch.setattr(igt, "GROUPED_GEMM", "auto")


def _operands(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).t()  # column-major
    sa = torch.rand(m, 1, generator=g) + 0.01
    sb = torch.rand(1, n, generator=g) + 0.01
    return a, b, sa, sb


def _bf16_step_apart(x: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal, or one bf16 step apart (the interpreter truncates where the GPU rounds)."""
    diff = (x.float() - ref.float()).abs()
    return bool((diff <= ref.float().abs() * 2**-7 + 1e-30).all())


def _exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long() @ b.long()).int()  # int64 accumulation: the ground truth


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_mm_equals_int_mm(m, n, k):
    a, b, _, _ = _operands(m, n, k)
    out = it.int8_mm(a, b, None, None, torch.int32)
    assert torch.equal(out, _exact(a, b))
    if k > 1:  # CPU _int_mm misreads a (1, N) operand whose strides are (1, 1)
        assert torch.equal(out, torch._int_mm(a, b))


# The persistent TMA GEMM (int8_mm's pick for large problems on a GPU): K a multiple of 16 (TMA's
# 16-byte rows) but not of the tile's 32, so the last K tile is TMA's zero fill; odd M and N.
TMA_SHAPES = [(33, 70, 80), (1, 1, 16), (257, 129, 64), (17, 8, 304), (100, 33, 48)]


@pytest.mark.parametrize("m,n,k", TMA_SHAPES)
def test_tma_gemm_equals_the_exact_product(m, n, k):
    a, b, sa, sb = _operands(m, n, k)
    assert it.tma_ok(a, b)
    out = torch.empty(m, n, dtype=torch.int32)
    it._launch_int8_mm_tma(a, b, out, None, None, config=(32, 32, 32, 4, 1))
    assert torch.equal(out, _exact(a, b))
    out = torch.empty(m, n, dtype=torch.float32)
    it._launch_int8_mm_tma(a, b, out, sa.reshape(-1), sb.reshape(-1), config=(32, 32, 32, 4, 1))
    assert torch.equal(out, _exact(a, b) * sa * sb)  # the pointer kernel's epilogue, same bits


def test_tma_needs_16_byte_rows():
    a, b, _, _ = _operands(33, 70, 100)  # K = 100: rows of 100 bytes
    assert not it.tma_ok(a, b)
    a, b, _, _ = _operands(33, 70, 80)
    assert not it.tma_ok(a, b.contiguous())  # b row-major: not K-major


def test_only_gpus_with_tma_take_the_tma_gemm(monkeypatch):
    """Compute capability 9.0+ has TMA; an A100 forced onto the Triton kernels takes the pointer
    kernel (the TMA one would not compile there)."""
    for cap, want in [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        assert it._has_tma(torch.device("cuda", 0)) is want, cap
    a, b, _, _ = _operands(64, 64, 64)
    assert not it.takes_tma(a, b)  # CPU tensors: never (the interpreter runs the pointer one)


def test_the_pointer_gemm_when_asked_is_said_in_one_line(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        i8.apply_int8(
            nn.Linear(8, 8), lambda m, n: True, kernel="triton", options=Int8Options(gemm="pointer")
        )
    assert it.GEMM == "pointer"
    lines = [r.getMessage() for r in caplog.records if "int8 GEMMs" in r.getMessage()]
    assert lines == ["int8 GEMMs: the pointer-load kernel, not the TMA one (precision.int8_gemm)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dtrain"):  # the default says nothing
        i8.apply_int8(nn.Linear(8, 8), lambda m, n: True, kernel="triton")
    assert not [r for r in caplog.records if "int8 GEMMs" in r.getMessage()]


@pytest.mark.parametrize(
    "gemm,line",
    [
        ("gluon", "the warp-specialized Gluon kernel where it applies (Hopper, scaled), else "),
        (
            "fastest",
            "per shape the faster of the Gluon and TMA kernels, timed once, where the Gluon one "
            "applies (Hopper, scaled), else ",
        ),
    ],
)
def test_the_gluon_gemm_when_asked_is_said_in_one_line_and_never_runs_on_cpu(
    gemm, line, monkeypatch, caplog
):
    with caplog.at_level(logging.INFO, logger="dtrain"):
        i8.apply_int8(
            nn.Linear(8, 8), lambda m, n: True, kernel="triton", options=Int8Options(gemm=gemm)
        )
    assert it.GEMM == gemm
    lines = [r.getMessage() for r in caplog.records if "int8 GEMMs" in r.getMessage()]
    assert lines == [f"int8 GEMMs: {line}the TMA one (precision.int8_gemm)"]
    a, b, sa, sb = _operands(1024, 1024, 1024)  # 2**30 multiply-adds: a large problem
    assert not it._takes_gluon(a, b, sa, sb, torch.bfloat16)  # CPU tensors (the interpreter)
    assert torch.equal(
        it.int8_mm(a[:33], b[:, :70], sa[:33], sb[:, :70], torch.float32),
        i8.scaled_int_mm(a[:33], sa[:33], b[:, :70], sb[:, :70], torch.float32),
    )


def test_the_quantize_tile_switch_forces_the_sweeps_and_is_said_in_one_line(monkeypatch, caplog):
    """precision.int8_quantize_tiles=sweeps: the op takes two sweeps of a fixed tile where it would
    autotune (or, here in the interpreter, take one pass), and apply_int8 says so once."""
    seen = []
    launch = it.launch_rows

    def recorded(*args, **kwargs):
        seen.append(args[6])  # one_pass
        return launch(*args, **kwargs)

    monkeypatch.setattr(it, "launch_rows", recorded)
    x = torch.randn(5, 70)
    it.quantize_rowwise(x, None)
    monkeypatch.setattr(it, "QUANTIZE_TILE", "sweeps")
    q, s = it.quantize_rowwise(x, None)
    qe, se = i8.quantize_rowwise(x)
    assert seen == [None, False] and torch.equal(q, qe) and torch.equal(s, se)
    sweeps = Int8Options(quantize_tiles="sweeps")
    with caplog.at_level(logging.INFO, logger="dtrain"):
        i8.apply_int8(nn.Linear(8, 8), lambda m, n: True, kernel="triton", options=sweeps)
    assert it.QUANTIZE_TILE == "sweeps"
    lines = [r.getMessage() for r in caplog.records if "quantize op" in r.getMessage()]
    assert lines == ["int8 quantize op: two sweeps of a fixed tile, not autotuned "
                     "(precision.int8_quantize_tiles)"]  # fmt: skip


def test_int8_mm_full_scale_values_are_exact():
    a = torch.full((40, 300), -127, dtype=torch.int8)
    b = torch.full((24, 300), 127, dtype=torch.int8).t()
    out = it.int8_mm(a, b, None, None, torch.int32)
    assert (out == -127 * 127 * 300).all()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_mm_dequantizes_as_eager_does(m, n, k):
    a, b, sa, sb = _operands(m, n, k)
    ref = _exact(a, b) * sa * sb  # as int8.scaled_int_mm computes it from _int_mm's product
    assert torch.equal(it.int8_mm(a, b, sa, sb, torch.float32), ref)
    # one scale only (int8 grad_weight's: the other is folded into the quantized operand)
    assert torch.equal(it.int8_mm(a, b, sa, None, torch.float32), _exact(a, b) * sa)
    assert _bf16_step_apart(it.int8_mm(a, b, sa, sb, torch.bfloat16), ref.bfloat16())
    assert it.int8_mm(a, b, sa, sb, torch.bfloat16).dtype == torch.bfloat16


def test_int8_mm_takes_any_strides():
    a, b, sa, sb = _operands(50, 40, 72)
    ref = torch._int_mm(a, b) * sa * sb
    b_rowmajor = b.contiguous()  # (K, N) row-major: correct, if not the fast layout
    assert torch.equal(it.int8_mm(a, b_rowmajor, sa, sb, torch.float32), ref)
    wide = torch.zeros(50, 100, dtype=torch.int8)
    wide[:, 10:82] = a  # a strided view into a wider buffer
    assert torch.equal(it.int8_mm(wide[:, 10:82], b, sa, sb, torch.float32), ref)


def test_int8_mm_rejects_what_it_cannot_compute():
    a, b, sa, sb = _operands(8, 8, 32)
    with pytest.raises(ValueError, match="do not chain"):
        it.int8_mm(a, b[:16], None, None, torch.int32)
    with pytest.raises(ValueError, match="without scales"):
        it.int8_mm(a, b, sa, None, torch.int32)
    with pytest.raises(ValueError, match="2-d int8"):
        it.int8_mm(a.float(), b, None, None, torch.float32)


def _quantize_inputs(r, c, dtype):
    g = torch.Generator().manual_seed(r * 1000 + c)
    x = (torch.randn(r, c, generator=g) * 3).to(dtype)
    if r > 2 and c > 6:
        x[1] = 0.0  # an all-zero row: scale 1e-12/127, q = 0
        # A row whose scale is exactly 1: x/scale lands on .5 ties, rounded half to even.
        x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5], dtype=dtype)
        x[2, 6:] = 0.0
    return x


@pytest.mark.parametrize("r,c", [(33, 100), (1, 1), (257, 129), (5, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rowwise_equals_eager_bitwise(r, c, dtype):
    x = _quantize_inputs(r, c, dtype)
    views = {
        "row-major": x,
        "transposed view": x.t().contiguous().t(),  # what weight.t() is
        "strided": torch.cat([x, x], dim=1)[:, ::2],
    }
    ways = {  # the op (here one pass for contiguous rows) and each way forced
        "op": lambda v: it.quantize_rowwise(v, None),
        "one pass": lambda v: it.quantize_rows(v, one_pass=True),
        "two sweeps": lambda v: it.quantize_rows(v, one_pass=False),  # tiles of 64 here
    }
    for way, quantize in ways.items():
        for name, v in views.items():
            q, s = quantize(v)
            qe, se = i8.quantize_rowwise(v)
            assert torch.equal(s, se), (way, name)
            assert torch.equal(q, qe), (way, name)
            assert q.is_contiguous() and s.shape == (r, 1)
    if r > 2 and c > 6:
        q, s = it.quantize_rowwise(x, None)
        assert s[2].item() == 1.0
        assert q[2, :6].tolist() == [127, 0, 2, 2, 0, -2]  # half to even, as torch.round


def _codes_where_the_division_differs() -> torch.Tensor:
    """A row of fp32 values led by its abs-max, 1.0 (so its scale is fp32(1/127)), then every
    value within 8 ulps of a half code whose quotient by that scale rounds to one code and
    whose product with the scale's reciprocal to the next (ten of them)."""
    scale = torch.tensor(1.0) * i8.INV_QMAX
    half_codes = (torch.arange(-127, 127) + 0.5) * scale  # (254,) fp32
    bits = half_codes.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-8, 9)])  # ulps either side
    differ = (near / scale).round() != (near * torch.reciprocal(scale)).round()
    found = near[differ].unique()
    assert found.numel() >= 8, found.numel()
    return torch.cat([torch.ones(1), found])


def test_codes_are_the_values_times_the_scales_reciprocal():
    """int8.codes multiplies by the scale's reciprocal, one IEEE division a scale, not one a
    value: on values where the two round to different codes the torch ops and the kernels give
    the multiply's (and so the test sees which arithmetic ran), row-wise and in groups."""
    row = _codes_where_the_division_differs()
    scale = torch.tensor(1.0) * i8.INV_QMAX
    by_product = (row * torch.reciprocal(scale)).round().to(torch.int8)
    by_quotient = (row / scale).round().to(torch.int8)
    assert (by_product != by_quotient).sum() == row.numel() - 1  # all but the abs-max
    x = row.reshape(1, -1)
    q, s = i8.quantize_rowwise(x)
    assert s.item() == scale.item() and torch.equal(q[0], by_product)
    for one_pass in (True, False):
        q, s = it.quantize_rows(x, one_pass=one_pass)
        assert s.item() == scale.item() and torch.equal(q[0], by_product), one_pass
    col = x.t().contiguous()  # (tokens, 1 channel): one group of 41 tokens
    for quantize in (ig.quantize_groups, igt.quantize_groups):
        q, s = quantize(col, torch.ones(col.shape[0], 1))
        assert s.item() == scale.item() and torch.equal(q[0], by_product), quantize


def test_quantize_rowwise_with_column_scales():
    """int8 grad_weight quantizes (dy * s_x)^T: dy^T with per-column (token) scales."""
    g = torch.randn(64, 40)
    xs = torch.rand(64, 1) + 0.1
    qe, se = i8.quantize_rowwise((g.float() * xs).t())
    for one_pass in (None, True, False):
        q, s = it.quantize_rows(g.t(), xs.reshape(-1), one_pass=one_pass)
        assert torch.equal(q, qe) and torch.equal(s, se), one_pass


def test_quantize_autotuning_offers_one_pass_only_for_rows_that_fit():
    """On a GPU autotuning chooses the quantize's tile for contiguous rows: one pass where
    BLOCK_R rows of next_power_of_2(C) values are at most ONE_PASS_MAX, sweeps only for rows
    longer than their tile: rows of 2,048 take only one pass, 1b's 5,632 both, 8b's 14,336 only
    the sweeps."""

    def offered(c):
        row_c = 1 << (c - 1).bit_length()
        kept = it.prune_row_tiles(it.row_tile_configs(it.QUANTIZE_TILES), {}, ROW_C=row_c)
        return {(k.kwargs["ONE_PASS"], k.kwargs["BLOCK_R"], k.kwargs["SWEEP_C"]) for k in kept}

    assert offered(2048) == {(True, 1, 1), (True, 2, 1)}
    assert offered(4096) == {(True, 1, 1), (True, 2, 1), (False, 2, 2048), (False, 1, 2048)}
    assert offered(5632) == {(True, 1, 1), (False, 2, 2048), (False, 1, 2048)}
    assert offered(14336) == {(False, 2, 2048), (False, 1, 2048)}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_weight", ["int8", "bf16", "int8_grouped"])
def test_int8_linear_triton_equals_torch(grad_weight):
    """Forward, grad_input and grad_weight: the Triton path computes the portable path's
    numbers bit for bit (fp32 outputs; int32 products are exact, the dequantization is the
    same fp32 operations)."""
    torch.manual_seed(0)
    x = torch.randn(3, 50, 70, requires_grad=True)  # 150 tokens: two groups for int8_grouped
    w = torch.randn(45, 70, requires_grad=True)
    b = torch.randn(45, requires_grad=True)
    results = {}
    for kernel in ("torch", "triton"):
        x.grad = w.grad = b.grad = None
        with CountOps() as ops:
            y = i8.int8_linear(x, w, b, grad_weight=grad_weight, kernel=kernel)
            y.pow(2).sum().backward()
        results[kernel] = [y.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone()]
        if kernel == "triton":
            n_mm = 3 if grad_weight == "int8" else 2
            assert ops.names.count("int8_mm") == n_mm and "_int_mm" not in ops.names
            # x and w forward, dy and w^T for grad_input, (dy s_x)^T for int8 grad_weight
            assert ops.names.count("int8_quantize_rowwise") == n_mm + 2
            # the grouped grad_weight: its own GEMM and quantize
            assert ops.names.count("int8_mm_grouped") == (grad_weight == "int8_grouped")
            assert ops.names.count("int8_quantize_groups") == (grad_weight == "int8_grouped")
    for name, r, t in zip(("y", "dx", "dw", "db"), results["torch"], results["triton"]):
        assert torch.equal(r, t), name


def test_autocast_bf16_outputs_within_a_bf16_step():
    torch.manual_seed(1)
    x = torch.randn(40, 96)
    w = torch.randn(72, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_t = i8.int8_linear(x, w, kernel="triton")
        y_r = i8.int8_linear(x, w, kernel="torch")
    assert y_t.dtype == y_r.dtype == torch.bfloat16
    assert _bf16_step_apart(y_t, y_r)


def test_long_reductions_are_chunked_as_the_portable_path_does(monkeypatch):
    monkeypatch.setattr(i8, "MAX_REDUCTION", 32)
    a, b, sa, sb = _operands(5, 7, 100)
    for s in (sb, 1.0):
        out = i8._scaled_mm(a, sa, b, s, torch.float32, "triton")
        assert torch.equal(out, i8.scaled_int_mm(a, sa, b, s, torch.float32))
    full = torch.full((4, 96), 127, dtype=torch.int8)
    exact = full.double() @ full.t().double()
    got = i8._scaled_mm(full, torch.ones(4, 1), full.t(), 1.0, torch.float64, "triton")
    assert torch.equal(got, exact)


def _compiled_mlp(grad_weight: str, tokens: int, quantize: str = "gradients"):
    """Two int8 linears on the Triton ops, a step compiled with fullgraph=True and AOTAutograd
    (no Inductor): (model, loss_fn, x, (forward graph's code, backward graph's code))."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def capture(gm, example_inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    options = Int8Options(quantize=quantize)
    i8.apply_int8(
        model, lambda m, n: True, grad_weight=grad_weight, kernel="triton", options=options
    )
    x = torch.randn(4, tokens, 64, requires_grad=True)

    def loss_fn(x):
        return model(x).float().pow(2).mean()

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    torch.compile(loss_fn, backend=backend, fullgraph=True)(x).backward()
    return model, loss_fn, x, tuple(codes)


@pytest.mark.parametrize("quantize", ["fused", "apart", "gradients"])
@pytest.mark.parametrize("grad_weight", ["int8", "bf16"])
def test_compiles_in_one_graph_with_the_triton_ops(grad_weight, quantize):
    """fullgraph=True: the custom ops (opaque to Dynamo, with fake implementations) break no
    graph and appear in the forward and backward graphs AOTAutograd hands to the compiler; the
    compiled step's gradients are the eager Triton path's. precision.int8_quantize=apart keeps
    every quantize as the Triton op, =gradients those of dy (not the transposed weights', the
    default); =fused leaves them all to Inductor to fuse."""
    model, loss_fn, x, (fw, bw) = _compiled_mlp(grad_weight, tokens=32, quantize=quantize)
    n_bw = 2 if grad_weight == "int8" else 1  # per layer: grad_input (+ grad_weight in int8)
    assert fw.count("torch.ops.dtrain.int8_mm") == 2, fw
    assert bw.count("torch.ops.dtrain.int8_mm") == 2 * n_bw, bw
    assert "_int_mm" not in fw + bw
    # Left to Inductor, which fuses it into the producer, or per layer the Triton op: x and W
    # forward; dy and W^T backward (+ dy^T for an int8 grad_weight).
    n_fw = 4 if quantize == "apart" else 0
    assert fw.count("torch.ops.dtrain.int8_quantize_rowwise") == n_fw, fw
    # per layer: dy (+ dy^T for an int8 grad_weight), and W^T unless only dy's are apart
    n_bw_q = {"fused": 0, "gradients": 2 * n_bw}.get(quantize, 2 * (n_bw + 1))
    assert bw.count("torch.ops.dtrain.int8_quantize_rowwise") == n_bw_q, bw
    assert all(m.quantize == quantize for m in model if isinstance(m, i8.Int8Linear))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_fn(x).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_fastest_takes_the_kernel_timed_faster_per_shape_and_times_each_shape_once(monkeypatch):
    """GEMM=fastest: where the Gluon kernel applies, int8_mm runs whichever of it and the TMA
    kernel median_ms timed faster on that shape (timed once per shape and out dtype, after each
    tuned); "gluon" runs it untimed. The launches are stand-ins recording which ran (the real
    ones are Hopper's: tests/gpu/gluon_gemm_check.py runs them)."""
    gg = pytest.importorskip("dtrain.lowp.int8.gluon_gemm")
    ran, timed = [], []

    def fake(name):
        def launch(*args, **kwargs):
            ran.append(name)

        return launch

    # the Gluon kernel is the faster where K >= 1024, the slower below
    def median_ms(call):
        a, name = call.args[0], call.func.__name__
        timed.append(name)
        return 1.0 if (a.shape[1] >= 1024) == (name == "gluon") else 2.0

    fake_gluon = fake("gluon")
    fake_gluon.__name__ = "gluon"
    fake_tma = fake("tma")
    fake_tma.__name__ = "tma"
    monkeypatch.setattr(gg, "launch", fake_gluon)
    monkeypatch.setattr(it, "_launch_int8_mm_tma", fake_tma)
    monkeypatch.setattr(it, "median_ms", median_ms)
    monkeypatch.setattr(it, "_takes_gluon", lambda *args: True)  # as on Hopper
    monkeypatch.setattr(it, "takes_tma", lambda *args: True)
    monkeypatch.setattr(it, "_GLUON_FASTER", {})
    monkeypatch.setattr(it, "GEMM", "fastest")
    for k, faster in ((2048, "gluon"), (512, "tma")):
        a, b, sa, sb = _operands(64, 64, k)
        for _ in range(3):
            ran.clear()
            it.int8_mm(a, b, sa, sb, torch.bfloat16)
            assert ran[-1] == faster, k
        assert timed.count("gluon") == timed.count("tma") == (1 if k == 2048 else 2)
    it.int8_mm(a, b, sa, sb, torch.float32)  # another out dtype: timed again
    assert len(timed) == 6
    monkeypatch.setattr(it, "GEMM", "gluon")
    ran.clear()
    it.int8_mm(a, b, sa, sb, torch.bfloat16)
    assert ran == ["gluon"] and len(timed) == 6


def test_dispatch_in_the_interpreter():
    assert i8.select_kernel("cpu", "triton")[0] == "triton"
    assert i8.select_kernel("cpu") == ("torch", "no CUDA device")


# --- the grouped grad-weight GEMM (dtrain/lowp/int8/grouped_triton.py) --------------------------

# (N, M, K) of dW (N, K) = gq (N, M) @ xq (M, K): reductions M of one group, a short last one,
# under a group; odd N and K.
GROUPED_SHAPES = [(33, 300, 70), (5, 128, 16), (64, 1, 40), (1, 129, 1), (17, 256, 33)]


def _grouped_operands(n, m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (n, m), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (k, m), dtype=torch.int8, generator=g).t()  # column-major
    s = torch.rand(-(-m // ig.GROUP), n, generator=g).t() + 0.01  # as quantize_groups lays out
    return a, b, s


@pytest.mark.parametrize("n,m,k", GROUPED_SHAPES)
def test_grouped_gemm_is_the_portable_path_bit_for_bit(n, m, k):
    a, b, s = _grouped_operands(n, m, k)
    ref = ig.grouped_int_mm(a, s, b, torch.float32)
    assert torch.equal(igt.int8_mm_grouped(a, b, s, torch.float32), ref)
    # any strides: a row-major b too (the kernel loads through pointers)
    assert torch.equal(igt.int8_mm_grouped(a, b.contiguous(), s, torch.float32), ref)
    assert _bf16_step_apart(igt.int8_mm_grouped(a, b, s, torch.bfloat16), ref)


def test_grouped_gemm_does_not_overflow_where_one_int32_sum_would():
    """Full-scale values over 133,376 tokens (a dot product of 2.15e9, past 2**31 - 1): the
    kernel keeps no int32 sum across groups, and its bits are the portable path's."""
    m = 1042 * ig.GROUP
    full = torch.full((3, m), 127, dtype=torch.int8)
    scales = torch.ones(3, 1042)
    got = igt.int8_mm_grouped(full, full.t(), scales, torch.float32)
    assert torch.equal(got, ig.grouped_int_mm(full, scales, full.t(), torch.float32))
    exact = torch.full((3, 3), m * 127.0**2, dtype=torch.float64)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("m,n", [(1, 1), (127, 7), (128, 33), (300, 5), (513, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_quantize_kernel_is_the_torch_ops_bit_for_bit(m, n, dtype):
    g = torch.Generator().manual_seed(m)
    dy = torch.randn(m, n, generator=g).to(dtype)
    dy[0] *= 50  # a loud token
    ts = torch.rand(m, 1, generator=g) + 0.1
    q_ref, s_ref = ig.quantize_groups(dy, ts)
    for block_n in (None, 32):
        q, s = igt.quantize_groups(dy, ts, block_n=block_n)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), block_n
        assert q.stride() == q_ref.stride() and s.stride() == (1, n)
    q, s = igt.quantize_groups(dy.t().contiguous().t(), ts)  # column-major dy: any strides
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="token scales"):
        igt.quantize_groups(dy, ts[1:])


def test_grouped_gemm_rejects_what_it_cannot_compute():
    a, b, s = _grouped_operands(4, 200, 6)
    with pytest.raises(ValueError, match="2-d int8 operands"):
        igt.int8_mm_grouped(a.float(), b, s, torch.float32)
    with pytest.raises(ValueError, match="do not chain"):
        igt.int8_mm_grouped(a, b[:100], s, torch.float32)
    with pytest.raises(ValueError, match=r"a_scale must be fp32 of shape \(4, 2\)"):
        igt.int8_mm_grouped(a, b, s[:, :1], torch.float32)
    with pytest.raises(ValueError, match="float dtype"):
        igt.int8_mm_grouped(a, b, s, torch.int32)
    empty = igt.int8_mm_grouped(a[:, :0], b[:0], s[:, :0], torch.float32)
    assert torch.equal(empty, torch.zeros(4, 6))


@pytest.mark.parametrize("quantize", ["gradients", "fused"])
def test_grouped_grad_weight_compiles_in_one_graph_with_its_ops(quantize):
    """fullgraph=True with grad_weight="int8_grouped": its GEMM is one custom op in the backward
    graph (per layer), its quantize the Triton op where dy's quantizes are kept apart (the
    default) or left to the compiler (fused), and the compiled step's gradients are the eager
    Triton path's."""
    model, loss_fn, x, (fw, bw) = _compiled_mlp(
        "int8_grouped", tokens=64, quantize=quantize
    )  # 256: two groups
    assert "int8_mm_grouped" not in fw and "int8_quantize_groups" not in fw
    assert bw.count("torch.ops.dtrain.int8_mm_grouped") == 2, bw
    n_q = 2 if quantize == "gradients" else 0
    assert bw.count("torch.ops.dtrain.int8_quantize_groups") == n_q, bw
    assert bw.count("torch.ops.dtrain.int8_mm.") == 2, bw  # grad_input only
    assert "_int_mm" not in fw + bw
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_fn(x).backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


# --- the fused SwiGLU's kernels (dtrain/lowp/experimental/int8_swiglu_triton.py) ---------------

SWIGLU_SHAPES = [(5, 70), (33, 129), (1, 1), (16, 300), (3, 64)]


def _gate_operands(r, c, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b, dh = (s * torch.randn(r, c, generator=g) for s in (3.0, 1.0, 0.1))
    return a.to(dtype), b.to(dtype), dh.to(dtype)


def _within(x, ref, rel):
    """|x - ref| <= rel |ref|, plus rel / 100 of the largest |ref|: where silu's gradient
    crosses zero (1 + a (1 - sigmoid(a)) cancels) one exp's last bit is a large relative error."""
    ref = ref.float()
    diff = (x.float() - ref).abs()
    return bool((diff <= ref.abs() * rel + ref.abs().max() * rel / 100 + 1e-30).all())


@pytest.mark.parametrize("r,c", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_quantize_is_the_gate_then_the_row_quantize(r, c, dtype):
    """hq, hs: quantize_rowwise(silu(a) * b). fp32: the scales within fp32 rounding of eager's
    (numpy's exp here, torch's there) and the codes within one; bf16: the interpreter truncates
    the two roundings, so the scales within two bf16 steps and the codes within two."""
    a, b, _ = _gate_operands(r, c, dtype)
    hq, hs = swt.swiglu_quantize(a, b)
    ref_q, ref_s = i8.quantize_rowwise(torch.nn.functional.silu(a) * b)
    assert hq.dtype == torch.int8 and hq.shape == (r, c) and hs.shape == (r, 1)
    rel, codes = (1e-6, 1) if dtype == torch.float32 else (2**-6, 2)
    assert _within(hs, ref_s, rel)
    assert (hq.int() - ref_q.int()).abs().max() <= codes
    assert (hq.int() - ref_q.int()).abs().float().mean() < 0.5  # mostly the same codes


@pytest.mark.parametrize("r,c", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_is_autogrades_gradients_and_their_quantizes(r, c, dtype):
    """ga, gb: autograd's gradients of silu(a) * b (within the interpreter's truncation in
    bf16), and the int8 codes and scales are exactly quantize_rowwise of the ga and gb the
    kernel returned, and w2's input codes and scales are swiglu_quantize's."""
    a, b, dh = _gate_operands(r, c, dtype)
    ga, gb, gaq, gas, gbq, gbs, hq, hs = swt.swiglu_backward_quantize(dh, a, b)
    fw_q, fw_s = swt.swiglu_quantize(a, b)
    assert torch.equal(hq, fw_q) and torch.equal(hs, fw_s)
    a_ = a.clone().requires_grad_()
    b_ = b.clone().requires_grad_()
    (torch.nn.functional.silu(a_) * b_).backward(dh)
    rel = 1e-5 if dtype == torch.float32 else 2**-6
    assert ga.dtype == gb.dtype == dtype
    assert _within(ga, a_.grad, rel) and _within(gb, b_.grad, rel)
    for g, q, s in ((ga, gaq, gas), (gb, gbq, gbs)):
        ref_q, ref_s = i8.quantize_rowwise(g)
        assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


@pytest.mark.parametrize("r,c", [(5, 70), (33, 129), (3, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernels_one_pass_and_two_sweeps_are_the_same_bits(r, c, dtype):
    """The one-pass kernels (the row one tile, as the ops take rows up to ONE_PASS_MAX) and the
    two sweeps (several tiles of 64 here) compute every output with the same operations."""
    a, b, dh = _gate_operands(r, c, dtype, seed=1)
    assert c <= it.ONE_PASS_MAX and it.quantize_blocks(r, c, rows_contiguous=True)[1] < c
    one = (*swt.gate_quantize(a, b, one_pass=True), *swt.gate_backward_quantize(dh, a, b))
    two = (
        *swt.gate_quantize(a, b, one_pass=False),
        *swt.gate_backward_quantize(dh, a, b, one_pass=False),
    )
    assert all(torch.equal(x, y) for x, y in zip(one, two, strict=True))
    ops = (*swt.swiglu_quantize(a, b), *swt.swiglu_backward_quantize(dh, a, b))
    assert all(torch.equal(x, y) for x, y in zip(one, ops, strict=True))


def test_swiglu_kernels_take_one_pass_up_to_the_bound_and_two_sweeps_past_it(monkeypatch):
    """The ops take the one-pass kernels for rows up to ONE_PASS_MAX values (then the row is
    one tile), the two sweeps past it; the tiles are powers of two, 4 to 16 warps."""
    seen = []
    one_pass_blocks, sweep_blocks = it.one_pass_blocks, it.quantize_blocks

    def one(r, c):
        seen.append((c, True))
        return one_pass_blocks(r, c)

    def two(r, c, rows_contiguous):
        seen.append((c, False))
        return sweep_blocks(r, c, rows_contiguous)

    monkeypatch.setattr(it, "one_pass_blocks", one)
    monkeypatch.setattr(it, "quantize_blocks", two)
    monkeypatch.setattr(it, "ONE_PASS_MAX", 64)
    for c in (64, 65):
        a, b, dh = _gate_operands(3, c, torch.float32)
        swt.swiglu_quantize(a, b)
        swt.swiglu_backward_quantize(dh, a, b)
    assert seen == [(64, True), (64, True), (65, False), (65, False)]
    monkeypatch.undo()
    for c in (1, 300, 5632, 8192, 14336):
        block_r, sweep_c, warps = it.one_pass_blocks(16384, c)
        row_c = 1 << (c - 1).bit_length()
        assert 4 <= warps <= 16 and block_r * row_c >= 4096  # 16,384 rows: enough to fill
        assert block_r & (block_r - 1) == 0 and sweep_c == 1  # a power of two; no sweeps


def test_swiglu_autotuning_offers_one_pass_only_up_to_the_bound():
    """On a GPU autotuning chooses the tile: one-pass tiles only for rows up to ONE_PASS_MAX
    (past it the backward spills), the sweeps only for rows longer than their tile."""

    def offered(c):
        row_c = 1 << (c - 1).bit_length()
        kept = it.prune_row_tiles(swt._CONFIGS, {}, ROW_C=row_c)
        return {(k.kwargs["ONE_PASS"], k.kwargs["SWEEP_C"]) for k in kept}

    assert offered(5632) == {(True, 1), (False, 2048), (False, 1024), (False, 512)}
    assert offered(8192) == offered(5632)
    assert offered(14336) == {(False, 2048), (False, 1024), (False, 512)}
    assert offered(700) == {(True, 1), (False, 512)}
    assert offered(64) == {(True, 1)}


def test_swiglu_kernels_refuse_what_they_cannot_compute():
    a = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        swt.swiglu_quantize(a, torch.randn(4, 9))
    with pytest.raises(ValueError, match="one shape and dtype"):
        swt.swiglu_backward_quantize(a, a, a.bfloat16())
    with pytest.raises(ValueError, match="float tensors"):
        swt.swiglu_quantize(a.to(torch.int8), a.to(torch.int8))


class _Gate(nn.Module):
    """A SwiGLU's three linears, declared as dtrain.model.FeedForward declares them."""

    swiglu = ("w1", "w3", "w2")

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
        self.w2 = nn.Linear(96, 64, bias=False)


def _ffn(kernel, grad_weight="bf16"):
    torch.manual_seed(0)
    ffn = _Gate()
    i8.apply_int8(ffn, lambda m, n: True, grad_weight=grad_weight, kernel=kernel)
    assert sw.fuse_swiglu(ffn) == 1
    return ffn


@pytest.mark.parametrize("grad_weight", ["int8", "bf16"])
def test_fused_swiglu_on_the_triton_kernels_is_the_portable_one(grad_weight):
    """The whole fused function on the Triton kernels (the gate's two fused kernels, the int8
    GEMMs and quantizes) against the portable path, fp32: the same up to exp's last bits."""
    x = torch.randn(3, 11, 64)
    out = {}
    for kernel in ("torch", "triton"):
        ffn = _ffn(kernel, grad_weight)
        xi = x.clone().requires_grad_()
        with CountOps() as ops:
            y = ffn(xi)
            y.pow(2).sum().backward()
        out[kernel] = [y.detach(), xi.grad] + [p.grad for p in ffn.parameters()]
        if kernel == "triton":
            assert ops.names.count("int8_swiglu_quantize") == 1
            assert ops.names.count("int8_swiglu_backward_quantize") == 1
            assert "_int_mm" not in ops.names and "silu" not in ops.names
    # The exps differ in their last bits (numpy's here, torch's there), which moves a scale by
    # an fp32 ulp now and then: 1e-8 of each tensor's norm when measured, where one int8 code
    # off in a row would be about 1e-3.
    for name, r, t in zip(("y", "dx", "dw1", "dw3", "dw2"), out["torch"], out["triton"]):
        assert ((t - r).norm() / r.norm()).item() < 1e-6, name


def test_fused_swiglu_compiles_with_its_kernels_as_two_ops():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def capture(gm, example_inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    ffn = _ffn("triton")
    x = torch.randn(2, 8, 64, requires_grad=True)
    compiled = torch.compile(
        lambda x: ffn(x).pow(2).mean(),
        fullgraph=True,
        backend=aot_autograd(fw_compiler=capture, bw_compiler=capture),
    )
    compiled(x).backward()
    fw, bw = codes
    assert fw.count("torch.ops.dtrain.int8_swiglu_quantize") == 1, fw
    assert bw.count("torch.ops.dtrain.int8_swiglu_backward_quantize") == 1, bw
    assert fw.count("torch.ops.dtrain.int8_mm") == 3 and bw.count("torch.ops.dtrain.int8_mm") == 3

"""precision=int8's grouped grad-weight (dtrain/lowp/int8/grouped.py) on the portable path: the
quantize per 128 tokens, the GEMM that sums group by group, and what it buys in accuracy. The
Triton kernel is checked against this path bit for bit in tests/int8_triton_interp.py (CPU)
and tests/gpu/test_int8_kernels.py (CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtrain.lowp.int8 import grouped as ig
from dtrain.lowp.int8 import linear as i8
from tests.test_precision import CountOps, snr_db


def _reference_quantize(g: torch.Tensor, token_scale: torch.Tensor):
    """One group of rows at a time, as the definition reads."""
    v = g.float() * token_scale
    codes, scales = [], []
    for lo in range(0, g.shape[0], ig.GROUP):
        part = v[lo : lo + ig.GROUP]
        s = part.abs().amax(dim=0).clamp_min(1e-12) * i8.INV_QMAX
        codes.append((part / s).round().clamp(-127, 127).to(torch.int8))
        scales.append(s)
    return torch.cat(codes).t(), torch.stack(scales, dim=1)


@pytest.mark.parametrize("m,n", [(1, 1), (127, 7), (128, 33), (300, 5), (513, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_groups_is_one_scale_per_column_per_128_rows(m, n, dtype):
    torch.manual_seed(m)
    g = torch.randn(m, n).to(dtype)
    g[0] *= 50  # a loud token: it sets the scales of its own group only
    ts = torch.rand(m, 1) + 0.1
    q, s = ig.quantize_groups(g, ts)
    q_ref, s_ref = _reference_quantize(g, ts)
    assert q.dtype == torch.int8 and q.shape == (n, m) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (n, -(-m // ig.GROUP))
    assert s.t().is_contiguous()  # a group's scales contiguous: what a GEMM tile loads
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    # within half a step of its group's scale, and every group uses its full range
    err = (q.float().t() * s.repeat_interleave(ig.GROUP, dim=1)[:, :m].t()) - g.float() * ts
    assert (err.abs() <= s.repeat_interleave(ig.GROUP, dim=1)[:, :m].t() * 0.5 + 1e-6).all()
    assert (q.abs().amax(dim=1) == 127).all()


def test_grouped_int_mm_sums_each_group_exactly_then_scales_it():
    torch.manual_seed(0)
    n, m, k = 9, 300, 11  # three groups, the last one short
    a = torch.randint(-127, 128, (n, m), dtype=torch.int8)
    b = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    s = torch.rand(n, 3) + 0.01
    with CountOps() as ops:
        out = ig.grouped_int_mm(a, s, b, torch.float32)
    assert ops.counts["_int_mm"] == 3  # one integer matmul per group
    parts = [
        a[:, j * 128 : (j + 1) * 128].long() @ b[j * 128 : (j + 1) * 128].long() for j in range(3)
    ]
    ref = torch.zeros(n, k)
    for j, part in enumerate(parts):  # exact integer sums, then fp32: scaled, added in order
        ref = ig.fma_f32(part.float(), s[:, j : j + 1], ref)  # rounded once (tested below)
    assert torch.equal(out, ref)
    exact = sum(part.double() * s[:, j : j + 1].double() for j, part in enumerate(parts))
    size = sum(part.double().abs() * s[:, j : j + 1].double() for j, part in enumerate(parts))
    assert ((out.double() - exact).abs() <= 3 * 2**-24 * size).all()


def _round_f32(x) -> float:
    """The exact rational x rounded to the nearest fp32, ties to even."""
    from fractions import Fraction

    import numpy as np

    f = np.float32(float(x))  # float() rounds to fp64 correctly: within one fp32 step
    near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return float(min(near, key=lambda y: (abs(Fraction(float(y)) - x), int(y.view(np.int32)) & 1)))


def test_fma_f32_is_a_fused_multiply_add_rounded_once():
    """Against exact rational arithmetic: random fp32 triples over a wide range of exponents,
    and the case where rounding the fp64 sum to fp32 rounds twice (1 + 2^-23 + 2^-24 - 2^-70
    lands on an fp32 tie in fp64 and goes to the even neighbour, 1 + 2^-22; rounded once it is
    1 + 2^-23), which the naive fp64 evaluation gets wrong."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(0)
    n = 4000
    a, b, c = (
        torch.randn(n, generator=g) * 2.0 ** torch.randint(-30, 30, (n,), generator=g)
        for _ in range(3)
    )
    tie = torch.tensor([1 + 2**-23, 2**-24 * (1 - 2**-23), 1 + 2**-23])  # a, b, c
    a, b, c = (torch.cat([t, tie[i : i + 1]]) for i, t in enumerate((a, b, c)))
    want = torch.tensor(
        [_round_f32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in
         zip(a.tolist(), b.tolist(), c.tolist(), strict=True)]
    )  # fmt: skip
    got = ig.fma_f32(a, b, c)
    assert torch.equal(got, want)
    assert got[-1].item() == 1 + 2**-23
    naive = (a.double() * b.double() + c.double()).float()
    assert naive[-1].item() == 1 + 2**-22  # rounded twice: the case is a real one


def test_grouped_int_mm_rounds_each_groups_scale_and_add_once():
    """Each group's scale-and-add is one fused multiply-add (what the kernels' fma.rn.f32
    computes), not a multiply and an add rounded apart: within a rounding of that sum, and not
    equal to it everywhere, so the test sees which one runs."""
    g = torch.Generator().manual_seed(1)
    aq = torch.randint(-127, 128, (64, 1000), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (1000, 48), dtype=torch.int8, generator=g)
    s = torch.rand(64, ig.group_count(1000), generator=g) + 0.01
    fused = ig.grouped_int_mm(aq, s, b, torch.float32)
    apart, size = torch.zeros_like(fused), torch.zeros_like(fused, dtype=torch.float64)
    for j in range(s.shape[1]):
        part = aq[:, j * 128 : (j + 1) * 128].long() @ b[j * 128 : (j + 1) * 128].long()
        apart = apart + part.float() * s[:, j : j + 1]
        size += part.double().abs() * s[:, j : j + 1].double()
    # apart two roundings a group, fused one, each within 2^-24 of the running sum's size
    assert ((fused.double() - apart.double()).abs() <= 3 * 8 * 2**-24 * size).all()
    assert not torch.equal(fused, apart)


def test_grouped_int_mm_does_not_overflow_where_one_int32_sum_would():
    """Full-scale values over 133,376 tokens: 2.15e9 a dot product, past int32's 2**31 - 1;
    each group's int32 sum is 128 * 127**2, summed across groups in fp32."""
    m = 1042 * ig.GROUP
    full = torch.full((2, m), 127, dtype=torch.int8)
    got = ig.grouped_int_mm(full, torch.ones(2, 1042), full.t(), torch.float32)
    exact = torch.full((2, 2), m * 127.0**2, dtype=torch.float64)
    assert m * 127**2 > 2**31
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


def _grad_weights(m: int, loud: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """grad_weight of one (m x 128) @ (128 x 192) linear in fp32 and in each int8 mode under
    bf16 autocast; `loud` tokens, spread over the batch, get 30x larger output gradients."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 128, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(192, 128, generator=g)).requires_grad_()
    gy = torch.randn(m, 192, generator=g)
    gy[torch.randperm(m, generator=g)[:loud]] *= 30
    out = {}

    def run(name, fn):
        x.grad = w.grad = None
        fn(x, w).backward(gy)
        out[name] = w.grad.clone()

    run("fp32", F.linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for mode in i8.GRAD_WEIGHT_MODES:
            run(mode, lambda x, w, mode=mode: i8.int8_linear(x, w, grad_weight=mode))
    return out


def test_grouped_grad_weight_is_more_accurate_than_one_scale_over_all_tokens():
    """Over a long batch with a few loud tokens the per-channel scale flattens every other
    token; per 128 tokens only the loud tokens' neighbours. SwitchBack's bf16 output gradient
    (no rounding to 8 bits) stays the most accurate."""
    r = _grad_weights(2048, loud=16)
    snr = {mode: snr_db(r["fp32"], r[mode]) for mode in i8.GRAD_WEIGHT_MODES}
    assert snr["int8_grouped"] > snr["int8"] + 6, snr
    assert snr["int8_grouped"] < snr["bf16"], snr
    quiet = _grad_weights(2048, loud=0)
    assert snr_db(quiet["fp32"], quiet["int8_grouped"]) > snr_db(quiet["fp32"], quiet["int8"])
    assert snr_db(quiet["fp32"], quiet["int8_grouped"]) > 38


def test_grouped_changes_grad_weight_only_and_runs_it_in_int8():
    torch.manual_seed(0)
    x = torch.randn(2, 150, 64, requires_grad=True)  # 300 tokens: three groups
    w = torch.randn(48, 64, requires_grad=True)
    res = {}
    for mode in ("int8", "int8_grouped"):
        x.grad = w.grad = None
        with CountOps() as ops:
            y = i8.int8_linear(x, w, grad_weight=mode)
            y.pow(2).sum().backward()
        res[mode] = (y.detach(), x.grad.clone(), w.grad.clone(), ops.counts.get("_int_mm", 0))
    assert torch.equal(res["int8"][0], res["int8_grouped"][0])  # forward
    assert torch.equal(res["int8"][1], res["int8_grouped"][1])  # grad_input
    assert not torch.equal(res["int8"][2], res["int8_grouped"][2])
    assert res["int8"][3] == 3  # forward, grad_input, grad_weight
    assert res["int8_grouped"][3] == 2 + 3  # grad_weight: one per group, no bf16 matmul
    assert res["int8_grouped"][2].dtype == torch.float32


def test_a_bad_grad_weight_mode_names_the_choices():
    with pytest.raises(ValueError, match="grad_weight='int4'"):
        i8.int8_linear(torch.randn(2, 8), torch.randn(4, 8), grad_weight="int4")


def test_a_last_group_of_one_token_is_exact():
    """129 tokens: the last group holds one, an outer product (torch._int_mm on CPU gets K = 1
    wrong; int8.int_mm computes it itself)."""
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (6, 129), dtype=torch.int8)
    b = torch.randint(-127, 128, (5, 129), dtype=torch.int8).t()
    out = ig.grouped_int_mm(a, torch.ones(6, 2), b, torch.float64)
    assert torch.equal(out, (a.long() @ b.long()).double())


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the dispatch reads, with real strides."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize(
    "choice,capability,k,expected",
    [
        ("gluon", (9, 0), 256, True),  # chosen, on Hopper, operands TMA can read
        ("auto", (9, 0), 256, True),  # the default, where Triton has Gluon (as here)
        ("triton", (9, 0), 256, False),  # the Triton kernels, chosen
        ("auto", (10, 0), 256, False),
        ("gluon", (10, 0), 256, False),  # Blackwell: no wgmma
        ("gluon", (8, 0), 256, False),  # Ampere: no wgmma, no TMA
        ("gluon", (9, 0), 200, False),  # rows of 200 int8: not 16-byte aligned for TMA
    ],
)
def test_the_gluon_grouped_gemm_is_taken_only_where_chosen_and_it_can_run(
    monkeypatch, choice, capability, k, expected
):
    """The grouped GEMM runs on the Gluon kernel on Hopper (sm_90) for TMA-readable operands,
    unless precision.int8_grouped_gemm=triton, and nowhere else."""
    igt = pytest.importorskip("dtrain.lowp.int8.grouped_triton")
    monkeypatch.setattr(igt, "GROUPED_GEMM", choice)
    monkeypatch.setattr(igt, "has_gluon_hopper", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    a = torch.zeros(64, k, dtype=torch.int8).as_subclass(_OnCuda)  # (N, M tokens)
    b = torch.zeros(96, k, dtype=torch.int8).t().as_subclass(_OnCuda)  # (M, K) column-major
    assert igt._takes_gluon(a, b) is expected
    assert not igt._takes_gluon(torch.zeros(64, 256, dtype=torch.int8), b)  # a CPU tensor
    monkeypatch.setattr(igt, "has_gluon_hopper", lambda: False)  # a Triton before 3.6
    assert igt._takes_gluon(a, b) is (expected and choice == "gluon")

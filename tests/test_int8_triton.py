"""The Triton int8 kernels, checked on CPU in Triton's interpreter (tests/int8_triton_interp.py,
in a subprocess with TRITON_INTERPRET=1): exact integer products against torch._int_mm, the
dequantizing epilogue and the quantize against the eager path bit for bit, odd shapes, strides,
chunked reductions, the int8 linear's forward and backward, torch.compile in one graph.

And the fused SwiGLU's kernels compiled for sm_90a (no GPU needed: Triton's own compiler and
cuobjdump): the registers of every tile autotuning may choose, none spilled; likewise the
grouped grad-weight's GEMMs, the Triton ones and the Gluon one (its wgmma waited for with one
left in flight, so each group's promotion runs beside the next group's MMA).

Skipped where Triton is not installed (CPU wheels of torch do not ship it; the lowp extra
installs it, so CI runs these). The same kernels run on a GPU: tests/gpu/test_int8_kernels.py.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, cli_env


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_in_the_interpreter():
    env = cli_env()
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tensors only, even on a GPU machine
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/int8_triton_interp.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]


def _cuobjdump() -> str | None:
    """Triton's bundled cuobjdump, if this Triton has one."""
    import os

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    return tool if os.path.exists(tool) else None


def _compile_sm90(kernel, types: dict, consts: dict, warps: int, stages: int | None = None):
    """`kernel` compiled for sm_90a by Triton here (no GPU needed), its arguments typed by
    `types` (pointers and integers, in order) and `consts`, as the runtime compiles it for
    training's tensors (pointers and integers but R 16-byte aligned / divisible by 16: Triton
    then vectorizes the loads, which changes the register count)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = dict(types)
    aligned = [names.index(n) for n in sig if n != "R"]
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps} | ({"num_stages": stages} if stages else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _kernel_resources(kernel, types: dict, consts: dict, warps: int, stages=None):
    """(registers, local bytes) a thread of `kernel` takes compiled for sm_90a (_compile_sm90)."""
    return _resources(_compile_sm90(kernel, types, consts, warps, stages))


def _resources(compiled):
    """(registers, local bytes) a thread of a kernel compiled here takes: cuobjdump reads the
    cubin."""
    import os
    import tempfile

    tool = _cuobjdump()
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
    regs, stack, local = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out).groups()
    return int(regs), int(stack) + int(local)


def _gate_types(kernel) -> dict:
    """A fused-SwiGLU kernel's argument types before its constants: the pointers (bf16 tensors,
    fp32 scales, int8 codes), then R and C."""

    def pointer(name):
        if name in ("a_ptr", "b_ptr", "dh_ptr", "ga_ptr", "gb_ptr"):
            return "*bf16"
        return "*fp32" if name.endswith("s_ptr") or name == "scale_ptr" else "*i8"

    names = kernel.arg_names
    return {n: pointer(n) for n in names[: names.index("R")]} | {"R": "i32", "C": "i32"}


def _gate_kernel_resources(kernel, row_c: int, one_pass: bool, block_r: int, sweep_c: int, warps):
    """_kernel_resources of a fused-SwiGLU kernel with bf16 inputs."""
    consts = {"ROW_C": row_c, "BLOCK_R": block_r, "SWEEP_C": sweep_c, "ONE_PASS": one_pass}
    return _kernel_resources(kernel, _gate_types(kernel), consts, warps)


def _skip_without_sm90_compiler(monkeypatch):
    import inspect

    from triton.compiler import ASTSource

    if _cuobjdump() is None:
        pytest.skip("this Triton has no bundled cuobjdump")
    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip("Triton before 3.3 names ASTSource's constants differently")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_swiglu_kernels_spill_no_registers_in_any_tile_autotuning_may_choose(monkeypatch):
    """Every tile prune_row_tiles offers for 1b's row (5,632 -> 8,192) and 8b's (14,336 -> 16,384)
    compiles for sm_90a within the register file, nothing spilled to local memory; the
    one-pass tiles of 8b's row, which ONE_PASS_MAX keeps out, spill or leave room for only one
    program a multiprocessor (why the bound)."""
    _skip_without_sm90_compiler(monkeypatch)
    from dtrain.lowp.experimental import int8_swiglu_triton as swt
    from dtrain.lowp.int8 import triton_gemm as it

    kernels = (swt._swiglu_quantize_kernel, swt._swiglu_backward_quantize_kernel)
    for row_c in (8192, 16384):
        offered = it.prune_row_tiles(swt._CONFIGS, {}, ROW_C=row_c)
        assert offered
        for cfg in offered:
            kw = cfg.kwargs
            tile = (row_c, kw["ONE_PASS"], kw["BLOCK_R"], kw["SWEEP_C"], cfg.num_warps)
            for kernel in kernels:
                regs, local = _gate_kernel_resources(kernel, *tile)
                assert local == 0 and regs * 32 * cfg.num_warps <= 65536, (kernel, tile, regs)
    assert 16384 > it.ONE_PASS_MAX
    for warps in (8, 16, 32):
        regs, local = _gate_kernel_resources(kernels[1], 16384, True, 1, 1, warps)
        assert local > 0 or regs * 32 * warps > 65536 // 2, (warps, regs)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_swiglu_kernels_divide_once_a_scale_not_once_a_value(monkeypatch):
    """Compiled for sm_90a, every tile of 1b's row: the only IEEE divisions (div.rn.f32, each a
    branch to a slow path) are the reciprocals of the rows' scales, one for the forward's h and
    three for the backward's ga, gb and h. Sigmoid and silu are Inductor's (Triton's sigmoid,
    approximate); with PyTorch's eager formulas (two IEEE divisions a value) the kernels were
    slower than Inductor's loops (docs/precision.md)."""
    _skip_without_sm90_compiler(monkeypatch)
    from dtrain.lowp.experimental import int8_swiglu_triton as swt
    from dtrain.lowp.int8 import triton_gemm as it

    kernels = ((swt._swiglu_quantize_kernel, 1), (swt._swiglu_backward_quantize_kernel, 3))
    for cfg in it.prune_row_tiles(swt._CONFIGS, {}, ROW_C=8192):
        for kernel, scales in kernels:
            consts = {"ROW_C": 8192, **cfg.kwargs}
            ptx = _compile_sm90(kernel, _gate_types(kernel), consts, cfg.num_warps).asm["ptx"]
            assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == scales, (kernel, cfg)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_quantize_kernel_spills_no_registers_in_any_tile_autotuning_may_choose(monkeypatch):
    """The row-wise quantize's tiles prune_row_tiles offers for dtrain's rows of bf16 (2,048,
    1b's 5,632 -> 8,192 and 8b's 14,336 -> 16,384) compile for sm_90a within the register
    file, nothing spilled: one pass holds BLOCK_R whole rows in registers."""
    _skip_without_sm90_compiler(monkeypatch)
    from dtrain.lowp.int8 import triton_gemm as it

    types = {"x_ptr": "*bf16", "col_scale_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32"}
    types.update(R="i32", C="i32", stride_xr="i32")
    configs = it.row_tile_configs(it.QUANTIZE_TILES)
    seen_one_pass = False
    for row_c in (2048, 8192, 16384):
        offered = it.prune_row_tiles(configs, {}, ROW_C=row_c)
        assert offered
        for cfg in offered:
            # stride_xc == 1 (contiguous rows, the tuned launch): Triton specializes it
            consts = dict(stride_xc=1, HAS_COL_SCALE=False, ROW_C=row_c, **cfg.kwargs)
            regs, local = _kernel_resources(
                it._quantize_rowwise_kernel, types, consts, cfg.num_warps
            )
            assert local == 0 and regs * 32 * cfg.num_warps <= 65536, (cfg, row_c, regs)
            seen_one_pass |= cfg.kwargs["ONE_PASS"]
    assert seen_one_pass


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_grouped_gemm_is_int8_wgmma_without_spills_with_one_fused_multiply_add(monkeypatch):
    """The grouped grad-weight GEMMs (pointer loads, and persistent with TMA loads) compiled for
    sm_90a as training launches them (both operands K-major, fp32 out): the int8 dot is Hopper's
    wgmma (s32 += s8 x s8), every tile autotuning may choose spills no registers to local
    memory and fits the shared memory of an H100/H200, and the per-group promotion is a
    multiply and an add each rounded to nearest (no fused multiply-add, no flush to zero): the
    portable path's arithmetic, which the GPU tests compare bit for bit."""
    _skip_without_sm90_compiler(monkeypatch)
    from dtrain.lowp.int8 import grouped_triton as igt

    common = {"c_ptr": "*fp32", "s_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    common.update(stride_cm="i32", stride_sg="i32")
    strides = dict(stride_cn=1, stride_sm=1)  # the scales as quantize_groups lays them out
    for bm, bn, bk, warps, stages in [*igt._TILES, igt._SMALL]:
        tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
        pointer = {"a_ptr": "*i8", "b_ptr": "*i8", **common, "stride_am": "i32"}
        builds = [
            (
                igt._int8_mm_grouped_kernel,
                {**pointer, "stride_bn": "i32"},
                dict(stride_ak=1, stride_bk=1, EVEN_K=True, **strides, **tile),
                False,
            )
        ]
        if (bm, bn, bk, warps, stages) in igt._TILES:  # the persistent TMA kernel's tiles
            descs = {
                "a_desc": f"tensordesc<i8[{bm}, {bk}]>",
                "b_desc": f"tensordesc<i8[{bn}, {bk}]>",
            }
            builds.append(
                (
                    igt._int8_mm_grouped_tma_kernel,
                    {**descs, **common},
                    dict(NUM_SMS=132, **strides, **tile),
                    True,
                )
            )
        for kernel, types, consts, tma in builds:
            regs, local = _kernel_resources(kernel, types, consts, warps, stages)
            assert local == 0, (kernel, (bm, bn, warps), regs)
            compiled = _compile_sm90(kernel, types, consts, warps, stages)
            assert compiled.metadata.shared <= 232448, (kernel, compiled.metadata.shared)  # H100
            ptx = compiled.asm["ptx"]
            assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8", ptx)
            assert "mma.sync" not in ptx
            assert ("cp.async.bulk.tensor" in ptx) == tma, kernel
            # the promotion one fused multiply-add, rounded once, not flushed to zero
            assert re.search(r"\bfma\.rn\.f32\b", ptx) and not re.search(r"\.ftz\.f32", ptx)
    # its quantize: a (128, BLOCK_N) tile of bf16 output gradients in registers, none spilled
    types = {"g_ptr": "*bf16", "ts_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32"}
    types.update(M="i32", N="i32", stride_gm="i32", stride_qn="i32", stride_sg="i32")
    for block_n, warps in igt._QUANTIZE_TILES:
        consts = dict(stride_gn=1, stride_sn=1, GROUP_SIZE=igt.GROUP, BLOCK_N=block_n)
        regs, local = _kernel_resources(igt._quantize_groups_kernel, types, consts, warps)
        assert local == 0, (block_n, warps, regs)


def _skip_without_gluon_compiler(monkeypatch):
    _skip_without_sm90_compiler(monkeypatch)
    from dtrain.lowp.int8.gluon_support import has_gluon_hopper

    if not has_gluon_hopper():
        pytest.skip("this Triton has no Gluon for Hopper")


def _compile_gluon_sm90(kernel, descs: dict, types: dict, consts: dict):
    """A Gluon `kernel` compiled for sm_90a here: its TMA descriptors `descs`, then its other
    arguments typed by `types` (pointers 16-byte aligned, as torch allocates) and `consts`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    sig = {n: mangle_type(d) for n, d in descs.items()} | types
    sig.update(dict.fromkeys(consts, "constexpr"))
    pointers = [n for n, t in types.items() if t.startswith("*")]
    src = GluonASTSource(
        fn=kernel,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in pointers},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _int8_wgmmas(compiled) -> tuple[list, list]:
    """(every int8 wgmma of the SASS, those a wait is tracked on: gsb0). ptxas serialises
    wgmmas (every one then waited for: its note C7514) when other instructions read an
    accumulator while one is in flight."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run(
            [_cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    mmas = re.findall(r"IGMMA\.64x\d+x32\.S8\.S8[^;]*;", sass)
    return mmas, [m for m in mmas if "gsb0" in m]


def _warp_specialized_int8_wgmma_on_tma(compiled) -> None:
    """Nothing spilled, shared memory within an H100's, the partitions' register budgets
    (setmaxnreg: warp-specialized), int8 wgmma on TMA-loaded stages and no mma.sync."""
    regs, local = _resources(compiled)
    assert local == 0, regs
    assert compiled.metadata.shared <= 232448, compiled.metadata.shared  # an H100's
    ptx = compiled.asm["ptx"]
    assert "setmaxnreg" in ptx
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8", ptx)
    assert "cp.async.bulk.tensor" in ptx and "mma.sync" not in ptx


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_gluon_gemm_is_warp_specialized_with_a_wait_a_step(monkeypatch):
    """The Gluon int8 GEMM (dtrain/lowp/int8/gluon_gemm.py) compiled for sm_90a as training
    launches it (bf16 and fp32 outputs), at each of its tiles: warp-specialized (two consumer
    warpgroups and a producer warp), int8 wgmma on TMA stages, and in the SASS each consumer's
    wgmmas of a K step (BLOCK_K / 32 of them for each 64 rows) chained with one wait: not
    serialised. Nothing spilled (64-bit offsets in its epilogue did spill: a stack frame)."""
    _skip_without_gluon_compiler(monkeypatch)
    import torch

    from dtrain.lowp.int8 import gluon_gemm as g

    a = torch.zeros(256, 256, dtype=torch.int8)
    b = torch.zeros(256, 256, dtype=torch.int8).t()  # column-major, as training passes it
    for out in ("*bf16", "*fp32"):
        for tile in g.TILES:
            a_desc, b_desc = g.descriptors(a, b, tile)
            types = {"c_ptr": out, "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"}
            types |= dict.fromkeys(("M", "N", "K", "stride_cm", "stride_cn"), "i32")
            consts = {"GROUP_M": 8, "NUM_BUFFERS": tile[3]}
            descs = {"a_desc": a_desc, "b_desc": b_desc}
            compiled = _compile_gluon_sm90(g._int8_mm_ws_kernel, descs, types, consts)
            _warp_specialized_int8_wgmma_on_tma(compiled)
            mmas, waited = _int8_wgmmas(compiled)
            block_m, _, block_k, _ = tile
            consumers, per_step = 2, (block_m // 64) * (block_k // 32)
            assert len(mmas) == consumers * per_step and len(waited) == consumers, (out, tile)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_gluon_grouped_gemm_is_warp_specialized_with_its_wgmmas_chained(monkeypatch):
    """The Gluon grouped GEMM (dtrain/lowp/int8/grouped_gluon.py) compiled for sm_90a as
    training launches it, at each of its tiles: warp-specialized (setmaxnreg: two
    consumer warpgroups and a producer warp), int8 wgmma (s32 += s8 x s8) on TMA-loaded
    stages, and in the SASS each consumer's four wgmmas of a step chained and then waited for
    once. ptxas serialises wgmmas (every IGMMA then waits: its note C7514) when other
    instructions read an accumulator while one is in flight, which the design must avoid for
    the promotion of one consumer to overlap another's MMAs. The promotion one fused
    multiply-add rounded as the portable path's (fma.rn: no flush to zero); nothing spilled;
    shared memory within an H100's."""
    _skip_without_gluon_compiler(monkeypatch)
    import torch

    from dtrain.lowp.int8 import grouped_gluon as gg

    a = torch.zeros(256, 256, dtype=torch.int8)
    b = torch.zeros(256, 256, dtype=torch.int8).t()  # column-major, as training passes it
    for block_m, block_n, buffers in gg.TILES:
        a_desc, b_desc = gg.descriptors(a, b, block_m, block_n)
        types = {"c_ptr": "*fp32", "s_ptr": "*fp32"}
        names = ("M", "N", "K", "stride_cm", "stride_cn", "stride_sm", "stride_sg")
        types |= dict.fromkeys(names, "i32")
        consts = {"GROUP_M": 8, "NUM_BUFFERS": buffers}
        descs = {"a_desc": a_desc, "b_desc": b_desc}
        compiled = _compile_gluon_sm90(gg._int8_mm_grouped_kernel, descs, types, consts)
        _warp_specialized_int8_wgmma_on_tma(compiled)
        ptx = compiled.asm["ptx"]
        assert re.search(r"\bfma\.rn\.f32\b", ptx) and not re.search(r"\.ftz\.f32", ptx)
        mmas, waited = _int8_wgmmas(compiled)
        chunks, consumers = block_n // 128, 2  # a consumer's steps a group
        # each consumer four chained a step and then one wait
        assert len(mmas) == consumers * 4 * chunks and len(waited) == consumers * chunks, mmas

"""dtrain/lowp/fp8/layout.py: the fp8 weight-gradient transposes taken out of Inductor's fused
kernels. On CPU (torch._scaled_mm runs there in real fp8): the pass finds the transposed copies
in a compiled fp8 block's backward, replaces every one, and the step gives the same bits."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

from dtrain.model import Block, ModelConfig, rope_tables
from dtrain.precision import block_linear_filter
from tests.conftest import ROOT, cli_env

pytest.importorskip("torchao")
fp8_layout = pytest.importorskip("dtrain.lowp.fp8.layout")


@pytest.fixture
def inductor_pass(monkeypatch):
    """Keep the process-wide Inductor setting as it was after the test."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", None)
    # Compile afresh: a graph cached on disk by an earlier run would skip the pass watched here.
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    # Scalar C++ kernels: Inductor's vectorised ones change with the CPU's ISA, and on some x86
    # machines its fused fp8 kernels gave another weight gradient than the pass's; this is a
    # test of the pass, not of the vectoriser.
    monkeypatch.setattr(inductor_config.cpp, "simdlen", 0)
    return inductor_config


def fp8_block(d_model=64, ffn_hidden=128, seq=48, device="cpu"):
    """One transformer block with its linears in fp8 (torchao, tensorwise), and RoPE tables."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=d_model, n_head=4, ffn_hidden=ffn_hidden)
    block = Block(cfg).to(device)

    def keep(m, fqn):
        return block_linear_filter(m, "layers.0." + fqn)

    convert_to_float8_training(block, config=Float8LinearConfig(), module_filter_fn=keep)
    return block, rope_tables(cfg.head_dim, seq, cfg.rope_theta, device=device)


def compiled_step(block, rope):
    """Output, input gradient and parameter gradients of one compiled forward and backward."""
    d = block.attn_norm.weight
    shape = (2, rope.shape[0], d.shape[0])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(d.device)
    x.requires_grad_(True)
    compiled = torch.compile(block)
    with torch.autocast(d.device.type, torch.bfloat16):
        out = compiled(x, rope)[0]
    out.float().pow(2).mean().backward()
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()]


def fp8_transposed_copies(graph):
    return sum(fp8_layout._transposed_source(n) is not None for n in graph.nodes)


def test_the_pass_takes_every_fp8_transpose_out_and_changes_no_bit(inductor_pass):
    try:
        torch._scaled_mm(
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
            torch.ones(()),
            torch.ones(()),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no fp8 GEMM on CPU")
    block, rope = fp8_block()
    twin = copy.deepcopy(block)
    torch._dynamo.reset()
    fused = compiled_step(block, rope)  # Inductor's own fusion

    seen = []

    class Watch(fp8_layout.TransposesApart):
        def __call__(self, graph):
            before = fp8_transposed_copies(graph)
            super().__call__(graph)
            ops = [n for n in graph.nodes if n.target is torch.ops.dtrain.fp8_transpose.default]
            seen.append((before, fp8_transposed_copies(graph), len(ops)))

    torch._dynamo.reset()
    inductor_pass.post_grad_custom_post_pass = Watch()
    apart = compiled_step(twin, rope)
    backward = max(seen, key=lambda s: s[0])
    # The backward holds the weight-gradient transposes: dy and x of every fp8 linear (7 in a
    # block: q, k, v, o, w1, w2, w3), of which x is shared by q, k, v and by w1, w3.
    assert backward[0] >= 7, seen
    assert backward[1] == 0 and backward[2] == backward[0], seen
    for a, b in zip(fused, apart):
        assert torch.equal(a, b)


def test_only_contiguous_2d_fp8_transposes_match():
    from torch import fx

    g = fx.Graph()
    aten = torch.ops.aten

    def node(name, t):
        n = g.placeholder(name)
        n.meta["val"] = t
        return n

    fp8 = torch.zeros(4, 8, dtype=torch.float8_e5m2)
    cases = {
        "fp8": node("a", fp8),
        "bf16": node("b", torch.zeros(4, 8, dtype=torch.bfloat16)),
        "strided": node("c", fp8.t()),
        "3d": node("d", torch.zeros(2, 4, 8, dtype=torch.float8_e5m2)),
        "keeps-layout": node("e", fp8),  # clone without memory_format: preserve_format
    }
    found = {}
    for name, src in cases.items():
        perm = [0, 2, 1] if name == "3d" else [1, 0]
        kwargs = {} if name == "keeps-layout" else {"memory_format": torch.contiguous_format}
        permuted = g.call_function(aten.permute.default, (src, perm))
        clone = g.call_function(aten.clone.default, (permuted,), kwargs)
        found[name] = fp8_layout._transposed_source(clone) is src
    want = {"fp8": True, "bf16": False, "strided": False, "3d": False, "keeps-layout": False}
    assert found == want


def test_apply_fp8_installs_the_pass_once_and_leaves_another_alone(inductor_pass):
    from dtrain.lowp.fp8 import apply_fp8

    for _ in range(2):
        apply_fp8(_fp8_block_plain(), block_linear_filter, emulate=True)
    installed = inductor_pass.post_grad_custom_post_pass
    assert isinstance(installed, fp8_layout.TransposesApart)
    assert installed.uuid() == fp8_layout.TransposesApart().uuid()  # the cache key is stable

    def theirs(graph):  # someone else's pass: kept, and the transposes stay Inductor's
        pass

    inductor_pass.post_grad_custom_post_pass = theirs
    apply_fp8(_fp8_block_plain(), block_linear_filter, emulate=True)
    assert inductor_pass.post_grad_custom_post_pass is theirs


def _fp8_block_plain():
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Block(ModelConfig(d_model=64))])})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_the_triton_transpose_in_the_interpreter():
    # The CUDA kernel's code, run on CPU by Triton's interpreter: odd shapes, partial tiles.
    code = (
        "import torch\n"
        "from dtrain.lowp.fp8.triton_transpose import transpose_bytes\n"
        "for m, n in [(0, 5), (1, 1), (3, 130), (129, 64), (200, 17), (65, 63)]:\n"
        "    x = torch.randn(m, n).to(torch.float8_e5m2)\n"
        "    y = torch.ops.dtrain.fp8_transpose(x)\n"
        "    assert y.shape == (n, m) and y.is_contiguous(), (m, n)\n"
        "    want = x.t().contiguous().view(torch.uint8)\n"
        "    assert torch.equal(y.view(torch.uint8), want), (m, n)\n"
        "base = torch.randn(70, 90).to(torch.float8_e4m3fn)\n"
        "for x in (base[:, 10:50], base.t()):  # not row-major: made contiguous first\n"
        "    want = x.t().contiguous().view(torch.uint8)\n"
        "    assert torch.equal(transpose_bytes(x).view(torch.uint8), want)\n"
        "print('OK')\n"
    )
    env = cli_env()
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    pre = "import dtrain.lowp.fp8.layout\n"
    res = subprocess.run(
        [sys.executable, "-c", pre + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_fsdp_fp8_weight_transposes_are_made_in_backward_not_saved(tmp_path):
    """Under fsdp with fp8 all-gather, torchao's grad-input GEMM reads a transposed copy of
    each fp8 weight. Without dtrain's joint-graph pass the partitioner made the MLP weights'
    copies in the forward and saved them (8b on 2x H200: 5.25 GiB at the peak, outside the
    memory plan). With it every fp8 tensor the forward saves is a gathered weight itself, and
    the loss and gradients are the same bits."""
    from tests.conftest import ROOT, torchrun_script

    pytest.importorskip("torchao")
    worker = ROOT / "tests" / "fsdp_fp8_saved_worker.py"
    for mode in ("on", "off"):
        res = torchrun_script(worker, str(tmp_path), mode)
        assert res.returncode == 0, res.stderr[-3000:]
    for r in (0, 1):
        on, off = (torch.load(tmp_path / f"rank{r}_{m}.pt") for m in ("on", "off"))
        assert on["saved"] == off["saved"] > 0
        assert on["own"] == 0
        # What the pass changes: without it w1, w2 and w3 of both blocks are saved copies (if
        # torch's partitioner stops making them, this says so and the pass can go).
        assert off["own"] == 2 * 3
        assert torch.equal(on["loss"], off["loss"]) and torch.equal(on["grads"], off["grads"])

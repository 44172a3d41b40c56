"""On a CUDA device: the fp8 weight-gradient transposes run as their own op inside a compiled
fp8 block (dtrain/lowp/fp8_layout.py) without changing what it computes beyond rounding, fsdp's
fp8 weight shards are cast all at once in one compiled call, torchao's bits (dtrain/lowp/fp8.py),
and the async checkpoints' host buffers are page-locked and staged into (dtrain/host_staging.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_fp8_layout import compiled_step, fp8_block, fp8_transposed_copies

pytestmark = pytest.mark.gpu


def test_compiled_fp8_block_takes_the_transpose_op_on_cuda(monkeypatch):
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor_config

    from dtrain.lowp import fp8_layout

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    monkeypatch.setattr(inductor_config, "post_grad_custom_post_pass", None)
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)  # the pass must run
    # 1b's widths (d_model 2048, SwiGLU 5632) at a short sequence
    block, rope = fp8_block(d_model=2048, ffn_hidden=5632, seq=256, device="cuda")
    twin = copy.deepcopy(block)
    torch._dynamo.reset()
    fused = compiled_step(block, rope)
    seen = []

    class Watch(fp8_layout.TransposesApart):
        def __call__(self, graph):
            before = fp8_transposed_copies(graph)
            super().__call__(graph)
            seen.append((before, fp8_transposed_copies(graph)))

    torch._dynamo.reset()
    inductor_config.post_grad_custom_post_pass = Watch()
    apart = compiled_step(twin, rope)
    assert max(b for b, _ in seen) >= 7 and all(a == 0 for _, a in seen), seen
    # Other kernels may fuse differently around the op: equal to bf16 rounding, not bitwise.
    for a, b in zip(fused, apart):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-5), (a - b).abs().max()


def test_weight_shards_are_cast_in_one_compiled_call_with_torchaos_bits():
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    from dtrain.lowp import fp8

    torch._dynamo.reset()
    fp8._compiled_cast_all = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    # 1b's block shapes halved by the 2-rank shard, odd rows too; scales are views of one tensor
    shapes = [(1024, 2048), (128, 2048), (2816, 2048), (1024, 5632), (37, 48)] * 3
    hps = [torch.randn(s, device="cuda", generator=gen) * 3 for s in shapes]
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):  # new scales each step, as after every optimizer step: no recompile
        amax = torch.stack([h.abs().max() for h in hps])
        scales = list((torch.finfo(torch.float8_e4m3fn).max / amax.double()).float())
        out = fp8.cast_shards(hps, scales, torch.float8_e4m3fn, compiled=True)
        for h, sc, q in zip(hps, scales, out, strict=True):
            ref = hp_tensor_and_scale_to_float8(h, sc, torch.float8_e4m3fn)._data
            assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
        hps = [h * 1.01 for h in hps]
    assert fp8._compiled_cast_all is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1


def test_host_buffers_are_page_locked_and_staged_into():
    from torch.distributed._state_dict_utils import _copy_state_dict

    from dtrain.host_staging import host_buffers

    state = {"w": torch.randn(1000, 37, device="cuda"), "m": {"x": torch.randn(5, device="cuda")}}
    state["step"] = torch.tensor(3.0, device="cuda")
    cache, flat = host_buffers(state, pin=True)
    assert flat.is_pinned() and cache["w"].is_pinned() and not cache["w"].is_cuda
    _copy_state_dict(state, cache)
    assert torch.equal(cache["w"], state["w"].cpu()) and torch.equal(
        cache["m"]["x"], state["m"]["x"].cpu()
    )
    assert cache["step"].item() == 3.0

"""On a CUDA device: the fp8 weight-gradient transposes run as their own op inside a compiled
fp8 block (dtrain/lowp/fp8/layout.py) without changing what it computes beyond rounding, fsdp's
fp8 weight shards are cast all at once in one compiled call, torchao's bits
(dtrain/lowp/fp8/linear.py), precision.fp8_lm_head and precision.fp8_fast_accum reach the fp8
GEMMs themselves, and the async checkpoints' host buffers are page-locked and staged into
(dtrain/host_staging.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_fp8_layout import compiled_step, fp8_block, fp8_transposed_copies

pytestmark = pytest.mark.gpu


def test_compiled_fp8_block_takes_the_transpose_op_on_cuda(monkeypatch):
    pytest.importorskip("torchao")
    import torch._inductor.config as inductor_config

    from dtrain.lowp.fp8 import layout as fp8_layout

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


def test_delayed_scaling_compiles_and_is_as_close_to_bf16_as_dynamic_scaling_on_cuda():
    """precision.fp8_scaling=delayed in a compiled block at 1b's widths, on the same input
    twice: the first step scales dynamically; after the history rolls, the second casts with
    the history's scale, fused where the tensors are made. Not bitwise dynamic's: fused, a
    norm's output goes to fp8 without the bf16 rounding between (on an H200 the outputs came
    0.0162 apart at most, fp8's rounding step). So each output
    and gradient of both steps is held to dynamic scaling's own distance from the same block
    in bf16 (with a quarter more room)."""
    pytest.importorskip("torchao")
    from dtrain.model import Block, ModelConfig
    from tests.test_fp8_delayed import delayed_twin, step

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    block, rope = fp8_block(d_model=2048, ffn_hidden=5632, seq=256, device="cuda")
    torch.manual_seed(0)  # fp8_block's weights, left in bf16
    bf16 = Block(ModelConfig(d_model=2048, n_head=4, ffn_hidden=5632)).to("cuda")
    twin, delayed = delayed_twin(block, compiled=True)
    torch._dynamo.reset()
    ref, dynamic = step(bf16, rope, compiled=True), step(block, rope, compiled=True)
    first = step(twin, rope, compiled=True)
    delayed.step()
    assert all(float(s.history[0]) > 0 for s in delayed.states)
    assert all(m.delayed for m in delayed.linears)
    again = step(twin, rope, compiled=True)

    def off(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    for r, d, f, a in zip(ref, dynamic, first, again, strict=True):
        assert 0 < off(d, r) < 0.25  # fp8 at all (about 0.01-0.1 on CPU at width 256), not broken
        assert off(f, r) <= 1.25 * off(d, r) and off(a, r) <= 1.25 * off(d, r)


@pytest.mark.parametrize("fast", ["forward", "grad_input", "all"])
def test_fp8_head_and_fast_accum_reach_the_scaled_mms(monkeypatch, fast):
    """Every torch._scaled_mm of a forward and backward, with the head in fp8: the forward
    GEMMs accumulate fast always, the grad-input ones with grad_input or all, the grad-weight
    ones with all only; the head's three GEMMs among them."""
    pytest.importorskip("torchao")
    from dataclasses import replace

    from dtrain.config import PrecisionConfig
    from dtrain.model import ModelConfig, build_model
    from dtrain.precision import apply_precision, build_precision

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no fp8 tensor cores")
    cuda = torch.device("cuda")
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=128, vocab_size=512, max_seq_len=64)
    model = build_model(replace(cfg, tie_embeddings=True), cuda, seed=0)
    prec = PrecisionConfig(name="fp8", fp8_lm_head=True, fp8_fast_accum=fast)
    apply_precision(model, build_precision(prec, cuda))
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randint(0, cfg.vocab_size, (2, 64), device=cuda)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    n = 7 * cfg.n_layer + 1  # the blocks' linears and the head
    assert calls == [True] * n
    logits.float().logsumexp(-1).mean().backward()
    backward = calls[n:]
    want = n * ({"forward": 0, "grad_input": 1, "all": 2}[fast])
    assert len(backward) == 2 * n and sum(backward) == want, backward
    assert torch.isfinite(model.tok_embeddings.weight.grad).all()


def test_weight_shards_are_cast_in_one_compiled_call_with_torchaos_bits():
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    from dtrain.lowp.fp8 import linear as fp8

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

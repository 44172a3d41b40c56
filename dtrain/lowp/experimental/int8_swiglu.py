"""precision=int8's SwiGLU as one autograd function (precision.int8_swiglu=fused; not a default):
w2(silu(w1 x) * w3 x) with the three int8 linears' matmuls (dtrain/lowp/int8/linear.py), the gate's
product and w2's input quantize in one kernel, and the gate's backward with w1's and w3's
output-gradient quantizes in one kernel (int8_swiglu_triton.py beside this file, on the
Triton kernels; eager torch ops otherwise).

Same numbers as the three Int8Linear layers and the eager silu * product between them: the same
quantizes, matmuls and roundings, so on the portable path (torch._int_mm) the outputs and every
gradient are bitwise those of the unfused layers (tested). What changes is what is stored and
launched:
  - x is quantized once for w1 and w3 (the unfused layers quantize it twice in eager code;
    under torch.compile Inductor may merge the two);
  - h = silu(a) * b is never written: w2 reads its int8 quantization, and SwitchBack's
    grad-weight of w2 dequantizes that, as the unfused w2 does from what it saved;
  - autograd's silu(a), saved for the product's backward, is not kept (a and b are, to
    recompute it), nor is w2's int8 input: the gate's backward kernel recomputes it with the
    gradients, for w2's grad-weight. F x 3 bytes a token less memory per layer (16.5 KiB at
    1b) than the eager layers keep; compiled, AOTAutograd's partitioner chooses what the
    unfused gate saves (at 1b it recomputes h: a fused gate that kept hq had 2.06 GiB more
    peak allocated, 24 layers x 16,384 tokens x 5,632 bytes);
  - under torch.compile the two fused kernels are opaque custom ops, so Inductor cannot turn
    the gate's pointwise kernels into the looped row reductions that took 18.7 ms a step more
    than bf16's pointwise ones in a 1b trace (`bash bench/lowp.sh profile1b`;
    dtrain/lowp/experimental/int8_swiglu_triton.py).

Applies to modules that declare `swiglu = (gate, up, down)` (dtrain.model.FeedForward) whose
three linears were swapped to Int8Linear without bias: `fuse_swiglu` changes their class to a
subclass with this forward, keeping parameters, names and state dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.lowp.dispatch import register
from dtrain.lowp.int8 import linear as i8


def _triton_swiglu():
    # registers torch.ops.dtrain.*; imports triton
    from dtrain.lowp.experimental import int8_swiglu_triton

    return int8_swiglu_triton


def _fused(t: torch.Tensor, kernel: str) -> bool:
    """Whether the Triton kernels run `t`'s gate (else eager torch ops)."""
    return kernel == "triton" and i8.triton_applies(t)


def _swiglu_quantize(a, b, kernel: str, apart: bool):
    """(hq, hs): h = silu(a) * b quantized per row, h not kept."""
    if _fused(a, kernel):
        return _triton_swiglu().swiglu_quantize(a, b)
    return i8._quantize(F.silu(a) * b, kernel, apart=apart)


def _swiglu_backward(dh, a, b, kernel: str, apart_g: bool, apart: bool):
    """(ga, gb, (gaq, gas), (gbq, gbs), (hq, hs)): the gate's input gradients, as autograd
    computes them for silu(a) * b, their per-row quantizations, and the forward's (hq, hs)
    recomputed (`apart`: where the forward's quantize ran)."""
    if _fused(a, kernel):
        ga, gb, gaq, gas, gbq, gbs, hq, hs = _triton_swiglu().swiglu_backward_quantize(dh, a, b)
        return ga, gb, (gaq, gas), (gbq, gbs), (hq, hs)
    s = F.silu(a)
    gb = dh * s
    ga = torch.ops.aten.silu_backward(dh * b, a)
    qa = i8._quantize(ga, kernel, apart=apart_g)
    qb = i8._quantize(gb, kernel, apart=apart_g)
    return ga, gb, qa, qb, i8._quantize(s * b, kernel, apart=apart)


class _Int8SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2, out_dtype, grad_weight, kernel, quantize):
        apart, ctx.apart_g, ctx.apart_w = i8.apart_flags(quantize)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, D)
        xq, xs = i8._quantize(x2, kernel, apart=apart)
        a = i8.mm_forward(xq, xs, w1, out_dtype, kernel, apart)  # (M, F)
        b = i8.mm_forward(xq, xs, w3, out_dtype, kernel, apart)
        hq, hs = _swiglu_quantize(a, b, kernel, apart)
        y = i8.mm_forward(hq, hs, w2, out_dtype, kernel, apart)  # (M, D)
        # hq is not kept: the backward recomputes it from a and b (the same bits eagerly and
        # on the Triton kernels; compiled, Inductor may round silu differently), as the
        # compiled three linears do, where the partitioner recomputes the gate's pointwise ops.
        ctx.save_for_backward(xq, xs, a, b, w1, w3, w2)
        ctx.apart = apart
        ctx.x_shape, ctx.x_dtype, ctx.out_dtype = shape, x.dtype, out_dtype
        ctx.grad_weight, ctx.kernel = grad_weight, kernel
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, xs, a, b, w1, w3, w2 = ctx.saved_tensors
        kernel, gw, cd = ctx.kernel, ctx.grad_weight, ctx.out_dtype
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (M, D)
        dx = dw1 = dw3 = dw2 = None
        if not (need_x or need_w1 or need_w3):
            if need_w2:
                hq, hs = _swiglu_quantize(a, b, kernel, ctx.apart)
                dw2 = i8.mm_grad_weight(g, hq, hs, w2.dtype, cd, gw, kernel, ctx.apart_g)
            return dx, dw1, dw3, dw2, None, None, None, None
        # w2: its input h is in the compute dtype, so is dh (as the unfused w2's grad-input).
        gq, gs = i8._quantize(g, kernel, apart=ctx.apart_g)
        dh = i8.mm_grad_input(gq, gs, w2, cd, kernel, ctx.apart_w)  # (M, F)
        ga, gb, (gaq, gas), (gbq, gbs), (hq, hs) = _swiglu_backward(
            dh, a, b, kernel, ctx.apart_g, ctx.apart
        )
        if need_w2:
            dw2 = i8.mm_grad_weight(g, hq, hs, w2.dtype, cd, gw, kernel, ctx.apart_g)
        del hq, hs
        if need_x:
            dx = i8.mm_grad_input(gaq, gas, w1, cd, kernel, ctx.apart_w)
            dx = dx.to(ctx.x_dtype) + i8.mm_grad_input(gbq, gbs, w3, cd, kernel, ctx.apart_w).to(
                ctx.x_dtype
            )
            dx = dx.view(ctx.x_shape)
        # Once, for w1 and w3 (and not at all when neither needs its gradient).
        x_deq = i8.dequantize(xq, xs, cd) if gw == "bf16" and (need_w1 or need_w3) else None
        if need_w1:
            dw1 = i8.mm_grad_weight(ga, xq, xs, w1.dtype, cd, gw, kernel, ctx.apart_g, x_deq)
        if need_w3:
            dw3 = i8.mm_grad_weight(gb, xq, xs, w3.dtype, cd, gw, kernel, ctx.apart_g, x_deq)
        return dx, dw1, dw3, dw2, None, None, None, None


def int8_swiglu(x, gate: nn.Module, up: nn.Module, down: nn.Module) -> torch.Tensor:
    """down(silu(gate x) * up x) for three bias-free Int8Linear layers, as one function; the
    matmuls' settings are the gate's (apply_int8 gives the three the same)."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    return _Int8SwiGLUFn.apply(
        x,
        gate.weight,
        up.weight,
        down.weight,
        out_dtype,
        gate.grad_weight,
        gate.kernel,
        gate.quantize,
    )


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (getattr(self, name) for name in self.swiglu)
    return int8_swiglu(x, gate, up, down)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """cls with the fused forward: a subclass, so isinstance checks and state dicts hold."""
    if cls not in _FUSED_CLASSES:
        name = f"Int8Fused{cls.__name__}"
        _FUSED_CLASSES[cls] = type(name, (cls,), {"forward": _fused_forward})
    return _FUSED_CLASSES[cls]


def fuse_swiglu(module: nn.Module) -> int:
    """Give every SwiGLU in `module` whose three linears are bias-free Int8Linear layers with
    the same settings the fused forward. Returns how many."""
    n = 0
    for m in module.modules():
        names = getattr(type(m), "swiglu", None)
        if not names or type(m) in _FUSED_CLASSES.values():
            continue
        parts = [getattr(m, name, None) for name in names]
        if not all(type(p) is i8.Int8Linear and p.bias is None for p in parts):
            continue
        settings = {(p.grad_weight, p.kernel, p.quantize) for p in parts}
        if len(settings) != 1:
            continue
        if parts[0].kernel == "triton":
            _triton_swiglu()  # import (and register the ops) now, not inside a compiled region
        m.__class__ = _fused_class(type(m))
        n += 1
    return n


register("int8_swiglu", fuse_swiglu)

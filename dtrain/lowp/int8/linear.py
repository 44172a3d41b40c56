"""int8 training for linear layers: all three matmuls on int8 tensor cores, inputs saved in int8.

For y = x W^T with x (M, K) activations and W (N, K) the fp32 master weight:

    forward      y  = x W^T     x row-wise (per token), W row-wise (per output channel)
    grad_input   dx = dy W      dy row-wise (per token), W column-wise (per input channel)
    grad_weight  dW = dy^T x    reduces over tokens: see below

Each operand is quantized symmetrically to [-127, 127] with one fp32 scale per row of the
reduction (`quantize_rowwise`), so the scales factor out of the sum and the int32 result of
`torch._int_mm` is dequantized by an outer product of two scale vectors.

Only the int8 x and its per-token scales are saved for backward (1 byte per element instead of
bf16's 2). The grad_weight matmul needs x with scales that do not vary along the tokens it sums
over; rather than dequantize and quantize x again (a second rounding), the per-token scales are
folded into dy:

    dW[n, k] = sum_m dy[m, n] x[m, k] = sum_m (dy[m, n] sx[m]) xq[m, k]

so the saved xq is used as is and only (dy * sx) is quantized, per output channel n.

That quantization is the coarsest of the three: one scale per output channel over every token of
the batch, so a few large gradients flatten the rest. With `grad_weight="bf16"` (SwitchBack,
Wortsman et al. 2023, "Stable and low-precision training for large-scale vision-language
models") grad_weight instead runs in the compute dtype from the same saved int8 input,

    dW = dy^T (xq * sx)        xq * sx dequantized to the compute dtype (bf16 under autocast)

so nothing more is saved (memory is unchanged), dy is not quantized for it, and forward and
grad_input stay int8: two int8 matmuls per linear instead of three. `grad_weight="int8_grouped"`
(dtrain/lowp/int8/grouped.py) keeps it in int8 with (dy * sx) scaled per output channel per
128 tokens instead of over all of them.

Operand layouts follow what int8 GEMMs want (cuBLASLt's "TN": first operand row-major, second
column-major), so no int8 copy is needed except the transpose of xq for grad_weight. Every
quantize is a row reduction plus a pointwise op, which torch.compile fuses into one kernel
(including the transposes); eagerly each is a few passes over the tensor.

Two sets of kernels run these matmuls (`select_kernel`, chosen once per process when the layers
are swapped and logged in one line):

    "triton"  dtrain/lowp/int8/triton_gemm.py, on CUDA GPUs of compute capability 9.0+ (Hopper) with
              Triton installed: int8 wgmma GEMMs with the dequantization (the outer product of
              the scales and the cast) fused into their epilogue, and, outside torch.compile,
              a fused quantize kernel. Under torch.compile the output gradients' quantizes
              stay that kernel and Inductor fuses the others into the producers of their
              inputs (precision.int8_quantize says where each runs). Same numbers as
              "torch": the integer products are exact and the fp32 dequantization is the same
              operations in the same order.
    "torch"   torch._int_mm plus eager (or Inductor-fused) dequantization: portable (CPU, any
              CUDA GPU), but on Hopper it runs CUTLASS's sm80 kernels, slower than bf16.

precision.int8_kernel=triton|torch forces one; `auto` chooses as above. precision.int8_quantize
=gradients|fused|apart says where the quantizes run under compile (gradients: the output
gradients' apart, the rest fused; fused: all fused; apart: all apart). For an input wider than
the compute dtype the grad-input GEMM writes the compute dtype, then casts, as autocast's linear
does.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from dtrain.lowp.int8.options import Int8Options
from dtrain.lowp.int8.quant import (  # noqa: F401 - the layer's arithmetic, named here too
    INV_QMAX,
    MAX_REDUCTION,
    QMAX,
    codes,
    dequantize,
    int_mm,
    quantize_rowwise,
    scaled_int_mm,
    triton_applies,
)

log = logging.getLogger("dtrain")
DEFAULT_OPTIONS = Int8Options()

# How grad_weight is computed: "int8" (torch._int_mm, like forward and grad_input), "bf16"
# (SwitchBack: a matmul in the compute dtype from the dequantized int8 input) or "int8_grouped"
# (int8 with one scale per output channel per 128 tokens: dtrain/lowp/int8/grouped.py).
GRAD_WEIGHT_MODES = ("int8", "bf16", "int8_grouped")
# Which kernels run the int8 matmuls: "triton" (Hopper wgmma, dequantization fused) or "torch"
# (torch._int_mm, portable). precision.int8_kernel=auto|triton|torch overrides the choice.
KERNELS = ("triton", "torch")
# Where each quantize runs under torch.compile with the Triton kernels: "fused" (Inductor fuses
# it into the kernel that produces its input) or "apart" (the Triton quantize op, a kernel of
# its own). precision.int8_quantize sets it: in a 1b trace the fusion turned pointwise producers
# into row reductions (the SwiGLU backward with w1's and w3's gradient quantize took 0.72 ms a
# block, 0.22 ms without it), which "apart" leaves pointwise at the cost of one more read of
# each quantized tensor. "gradients", the default, keeps only the output gradients' quantizes
# apart: at 1b on one H200 it measured 1.086x and 1.077x bf16's tokens/s against "fused"'s
# 1.065x and 1.062x in the same calls, at 0.789x bf16's peak reserved against 0.794x
# (docs/benchmarks.md). The grad-input GEMM writes the compute dtype for a wider input (bf16,
# then cast, as autocast's linear does): 1.063x bf16 against the fp32 epilogue's 1.042x.
QUANTIZE_MODES = ("gradients", "fused", "apart")
# Triton's interpreter runs the Triton kernels on CPU tensors (CPU tests of the kernels).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# --- which kernels ------------------------------------------------------------------------------


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_kernel(device: torch.device | str, forced: str = "auto") -> tuple[str, str]:
    """("triton" or "torch", why) for int8 matmuls on `device`; `forced`
    (precision.int8_kernel) can force either (forcing "triton" takes it on any CUDA GPU, e.g.
    to try it on an A100)."""
    device = torch.device(device)
    if forced == "torch":
        return "torch", "precision.int8_kernel=torch"
    if device.type != "cuda":
        if _INTERPRET and forced == "triton" and _triton_installed():
            return "triton", "Triton's interpreter on CPU (TRITON_INTERPRET=1)"
        return "torch", "no CUDA device"
    if not _triton_installed():
        return "torch", "Triton is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    name = f"{torch.cuda.get_device_name(device)}, sm{major}{minor}"
    if forced == "triton":
        return "triton", f"{name}; forced by precision.int8_kernel=triton"
    if major < 9:
        return "torch", f"{name}: the Triton int8 kernels are for sm90+ (Hopper)"
    return "triton", name


_LOGGED: set[str] = set()


def _log_choice(kernel: str, why: str) -> None:
    what = "Triton sm90 kernels" if kernel == "triton" else "torch._int_mm"
    line = f"int8 matmuls: {what} ({why})"
    if line not in _LOGGED:  # once per process (per distinct choice)
        _LOGGED.add(line)
        log.info(line)


def _default_device(module: nn.Module) -> torch.device:
    """Where `module` will run: its parameters' device, or for a model built on the meta device
    (FSDP builds there) the current CUDA device when there is one."""
    p = next(module.parameters(), None)
    if p is not None and p.device.type != "meta":
        return p.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _triton_ops():
    from dtrain.lowp.int8 import triton_gemm  # registers torch.ops.dtrain.*; imports triton

    return triton_gemm


def _quantize(
    x: torch.Tensor, kernel: str, col_scale: torch.Tensor | None = None, apart: bool = False
):
    """quantize_rowwise(x * col_scale) (col_scale (C,) multiplies x's columns; None: x) with the
    chosen kernels. Under torch.compile the eager code is traced, so that Inductor fuses it into
    the producer of x, which the opaque Triton op would prevent; unless `apart` (int8_quantize)."""
    compiled = torch.compiler.is_compiling()
    if kernel == "triton" and triton_applies(x) and (apart or not compiled):
        return _triton_ops().quantize_rowwise(x, col_scale)
    if col_scale is not None:
        x = x.float() * col_scale.reshape(1, -1)
    return quantize_rowwise(x)


def _scaled_mm(a, a_scale, b, b_scale, out_dtype: torch.dtype, kernel: str) -> torch.Tensor:
    """scaled_int_mm with the chosen kernels (b_scale may be the number 1.0: no scale)."""
    if not (kernel == "triton" and triton_applies(a)):
        return scaled_int_mm(a, a_scale, b, b_scale, out_dtype)
    ops = _triton_ops()
    sb = b_scale if isinstance(b_scale, torch.Tensor) else None
    if sb is None and b_scale != 1.0:
        raise ValueError(f"b_scale must be a tensor or 1.0, got {b_scale!r}")
    k = a.shape[1]
    if k <= MAX_REDUCTION:
        return ops.int8_mm(a, b, a_scale, sb, out_dtype)
    # As int_mm: int32 partial products over chunks of the reduction, summed in fp32, then
    # dequantized (the same operations as the portable path).
    out = None
    for s in range(0, k, MAX_REDUCTION):
        a_part = a[:, s : s + MAX_REDUCTION].contiguous()
        b_part = b[s : s + MAX_REDUCTION].t().contiguous().t()  # column-major
        part = ops.int8_mm(a_part, b_part, None, None, torch.float32)
        out = part if out is None else out + part
    out = out * a_scale
    if sb is not None:
        out = out * sb
    return out.to(out_dtype)


# --- the matmuls of a layer, shared with dtrain/lowp/experimental/int8_swiglu.py ----------------


def mm_forward(xq, xs, weight, out_dtype, kernel: str, apart: bool) -> torch.Tensor:
    """y = x W^T from the quantized input (M, K) and the weight, quantized per output channel."""
    wq, ws = _quantize(weight, kernel, apart=apart)  # (N, K) int8, (N, 1)
    return _scaled_mm(xq, xs, wq.t(), ws.t(), out_dtype, kernel)  # (M, N)


def mm_grad_input(gq, gs, weight, out_dtype, kernel: str, apart_w: bool) -> torch.Tensor:
    """dx = dy W from the quantized output gradient (M, N), W quantized per input channel."""
    wtq, wts = _quantize(weight.t(), kernel, apart=apart_w)  # (K, N)
    return _scaled_mm(gq, gs, wtq.t(), wts.t(), out_dtype, kernel)  # (M, K)


def mm_grad_weight(
    g, xq, xs, weight_dtype, compute_dtype, mode: str, kernel: str, apart_g: bool, x_deq=None
) -> torch.Tensor:
    """dW = dy^T x from the output gradient g (M, N) and the saved int8 input, as `mode` (one
    of GRAD_WEIGHT_MODES) says: in int8 with one scale per output channel ("int8") or per
    output channel per 128 tokens ("int8_grouped"), or SwitchBack's compute-dtype matmul from
    the dequantized input ("bf16"; `x_deq` if given)."""
    if mode == "int8_grouped":
        from dtrain.lowp.int8.grouped import grad_weight_grouped

        return grad_weight_grouped(g, xq, xs, weight_dtype, kernel, apart_g)
    if mode == "int8":
        # Fold the per-token input scales into dy (see the module docstring), then quantize
        # per output channel over the tokens: (N, M) int8, (N, 1).
        gtq, gts = _quantize(g.t(), kernel, col_scale=xs, apart=apart_g)
        xq_colmajor = xq.t().contiguous().t()  # (M, K) column-major for the int8 GEMM
        return _scaled_mm(gtq, gts, xq_colmajor, 1.0, weight_dtype, kernel)  # (N, K)
    # SwitchBack: dequantize the saved input (in fp32, one rounding to the compute dtype) and
    # multiply in the compute dtype, as a bf16 linear's grad_weight does.
    if x_deq is None:
        x_deq = dequantize(xq, xs, compute_dtype)
    return torch.mm(g.to(compute_dtype).t(), x_deq).to(weight_dtype)  # (N, K)


def apart_flags(quantize: str) -> tuple[bool, bool, bool]:
    """(forward's, dy's, transposed weights') quantizes apart, for QUANTIZE_MODES' `quantize`."""
    return (
        quantize == "apart",
        quantize in ("apart", "gradients"),
        quantize == "apart",
    )


# --- the layer ----------------------------------------------------------------------------------


class _Int8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, grad_weight, kernel, quantize):
        apart, ctx.apart_g, ctx.apart_w = apart_flags(quantize)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        xq, xs = _quantize(x2, kernel, apart=apart)  # (M, K) int8, (M, 1)
        y = mm_forward(xq, xs, weight, out_dtype, kernel, apart)  # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        # The weight is the parameter itself (no copy); the input only as int8 + scales.
        ctx.save_for_backward(xq, xs, weight)
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = shape, x.dtype, bias is not None
        ctx.out_dtype, ctx.grad_weight, ctx.kernel = out_dtype, grad_weight, kernel
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, xs, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        kernel = ctx.kernel
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gq, gs = _quantize(g, kernel, apart=ctx.apart_g)  # per token, over N
            grad_x = mm_grad_input(gq, gs, weight, ctx.out_dtype, kernel, ctx.apart_w)
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = mm_grad_weight(
                g, xq, xs, weight.dtype, ctx.out_dtype, ctx.grad_weight, kernel, ctx.apart_g
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def _check_grad_weight(grad_weight: str) -> None:
    if grad_weight not in GRAD_WEIGHT_MODES:
        raise ValueError(f"grad_weight={grad_weight!r}; choose one of {GRAD_WEIGHT_MODES}")


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; choose one of {KERNELS}")


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    grad_weight: str = "int8",
    kernel: str = "torch",
    quantize: str = "fused",
) -> torch.Tensor:
    """F.linear with int8 matmuls. Returns autocast's dtype inside autocast, else x's dtype.

    `grad_weight`: "int8" (all three matmuls int8), "int8_grouped" (the same, grad_weight's
    output gradients scaled per 128 tokens) or "bf16" (SwitchBack: grad_weight in the compute
    dtype from the saved int8 input). `kernel`: "torch" (torch._int_mm) or "triton"
    (dtrain/lowp/int8/triton_gemm.py; CUDA tensors only, others take torch._int_mm). `quantize`:
    under torch.compile with "triton", "fused" into the producer, "apart", or apart for the
    output gradients only ("gradients"; QUANTIZE_MODES).
    """
    _check_grad_weight(grad_weight)
    _check_kernel(kernel)
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize={quantize!r}; choose one of {QUANTIZE_MODES}")
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    args = (out_dtype, grad_weight, kernel, quantize)
    return _Int8LinearFn.apply(x, weight, bias, *args)


class Int8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in int8. Same parameters, names and state dict as the
    nn.Linear it replaces (the swap only changes the class), so DDP, fully_shard, optimizers
    and checkpoints are unaffected."""

    # Plain attributes (set per instance by apply_int8): torch.compile treats them as constants.
    grad_weight: str = "int8"
    kernel: str = "torch"
    quantize: str = "fused"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(
            x,
            self.weight,
            self.bias,
            grad_weight=self.grad_weight,
            kernel=self.kernel,
            quantize=self.quantize,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, grad_weight={self.grad_weight}, kernel={self.kernel}, "
            f"quantize={self.quantize}"
        )


def apply_int8(
    module: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool],
    *,
    grad_weight: str = "int8",
    kernel: str | None = None,
    options: Int8Options = DEFAULT_OPTIONS,
) -> int:
    """Swap, in place, every nn.Linear in `module` for which filter_fn(linear, fqn) holds;
    `grad_weight` (GRAD_WEIGHT_MODES) is how the swapped layers compute grad_weight, `kernel`
    ("triton" or "torch") which kernels run their matmuls: None chooses by the device the
    module will run on (`select_kernel`, `options.kernel`) and logs the choice in one line.
    `options`: the run's precision.int8_* choices.

    Returns the number of layers swapped.
    """
    _check_grad_weight(grad_weight)
    if kernel is None:
        kernel, why = select_kernel(_default_device(module), options.kernel)
        _log_choice(kernel, why)
    _check_kernel(kernel)
    # Only the Triton kernels have a quantize op to keep apart.
    options = replace(options, quantize=options.quantize if kernel == "triton" else "fused")
    if kernel == "triton":
        _setup_triton(grad_weight, options)
    n = 0
    for fqn, m in module.named_modules():
        if type(m) is nn.Linear and filter_fn(m, fqn):
            m.__class__ = Int8Linear
            m.grad_weight = grad_weight
            m.kernel = kernel
            m.quantize = options.quantize
            n += 1
    if options.swiglu == "fused":
        from dtrain.lowp.dispatch import variant

        fused = variant("int8_swiglu")(module)
        log.info("int8 SwiGLU: %d gate(s) as one function (precision.int8_swiglu)", fused)
    return n


_QUANTIZE_KEY = "precision.int8_quantize"
# What the Triton path says at start-up where a choice is not the default (one line each).
_GEMM_LINES = {
    "pointer": "the pointer-load kernel, not the TMA one",
    "gluon": "the warp-specialized Gluon kernel where it applies (Hopper, scaled), else the "
    "TMA one",
    "fastest": "per shape the faster of the Gluon and TMA kernels, timed once, where the Gluon "
    "one applies (Hopper, scaled), else the TMA one",
}


def _setup_triton(grad_weight: str, options: Int8Options) -> None:
    """Import (and register) the Triton ops now, not inside a compiled region; hand them the
    run's kernel choices; log those that are not the default."""
    ops = _triton_ops()
    ops.configure(gemm=options.gemm, quantize_tiles=options.quantize_tiles)
    if grad_weight == "int8_grouped":
        from dtrain.lowp.int8 import grouped_triton

        grouped_triton.configure(options.grouped_gemm)
    if options.gemm in _GEMM_LINES:
        log.info("int8 GEMMs: %s (precision.int8_gemm)", _GEMM_LINES[options.gemm])
    if options.quantize_tiles != "tuned":
        log.info(
            "int8 quantize op: two sweeps of a fixed tile, not autotuned "
            "(precision.int8_quantize_tiles)"
        )
    if options.quantize == "fused":
        log.info("int8 quantizes: all fused into their producers by Inductor (%s)", _QUANTIZE_KEY)
    elif options.quantize == "apart":
        log.info("int8 quantizes: the Triton op, apart from their producers (%s)", _QUANTIZE_KEY)

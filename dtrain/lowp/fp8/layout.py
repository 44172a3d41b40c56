"""fp8 transposes in a kernel of their own under torch.compile.

fp8 GEMMs (torch._scaled_mm) take the first operand row-major and the second column-major, so
for the weight gradient, dW = dyᵀ·x, torchao makes token-contiguous copies of both
token-major fp8 activations (`clone(permute(t, [1, 0]))` in the compiled graph). Inductor fuses
each such copy into the kernel that produces the fp8 tensor. Where that kernel works row by row
(the RMSNorm backward that yields the gradient w2's backward reads, the SwiGLU backward), one
row's bytes go one per row of the transposed output: uncoalesced writes. In an 8b fsdp trace
(seq 8192, 2x H200; `bash bench/lowp.sh profile8b`, docs/benchmarks.md) the RMSNorm backward
took 1.94 ms a layer under fp8 against 0.19 ms under bf16, 56 ms of a 718 ms step, and the
SwiGLU backward 12 ms more than bf16's.

`TransposesApart`, a post-grad graph pass that `apply_fp8` installs, replaces every such copy
of a contiguous 2-D fp8 tensor with `dtrain::fp8_transpose`, an op Inductor cannot fuse: the
producer then writes only the row-major fp8 tensor it writes anyway (the grad-input GEMM reads
it), coalesced, and the op transposes it in one tiled pass (a byte read and a byte written per
element; dtrain/lowp/fp8/triton_transpose.py). Data movement only: on CPU a compiled step gives
the same bits with it as without; on a GPU the kernels around it may fuse differently, so the
results agree to rounding (tests/gpu/test_fp8_and_staging.py).

`WeightTransposesInBackward`, a joint-graph pass installed with it where fsdp gathers the
weights in fp8, marks each transposed copy of an fp8 *weight* (a graph input) to be made in
backward. Left to itself the partitioner made the MLP weights' copies in the forward and saved
them: 8b under fsdp on 2x H200 held 5.25 GiB of them at the peak (96 of 58.7 MB, three a block),
alive from each block's forward to its backward even where fsdp reshards the weights after
forward, and not in the memory plan (it under-predicted the run by 7-9%). Made in backward, the
copy reads the gathered weight fsdp holds for the backward anyway.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger("dtrain")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton kernel on CPU (tests)


@torch.library.custom_op("dtrain::fp8_transpose", mutates_args=())
def fp8_transpose(x: torch.Tensor) -> torch.Tensor:
    """x (M, N), contiguous -> its transpose (N, M), contiguous. On CUDA a tiled Triton kernel
    (dtrain/lowp/fp8/triton_transpose.py); elsewhere torch's copy."""
    if x.device.type == "cuda" or _INTERPRET:
        from dtrain.lowp.fp8.triton_transpose import transpose_bytes

        return transpose_bytes(x)
    return x.t().clone(memory_format=torch.contiguous_format)  # a copy even where t() is one


@fp8_transpose.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0]))


def _contiguous_copy_of(node: fx.Node):
    """What `node` copies, where it is an explicit contiguous copy (torchao asks for one: a
    clone without it keeps its input's layout, which a contiguous output would not), or None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.clone.default:
        return None
    if node.kwargs.get("memory_format") is not torch.contiguous_format:
        return None
    return node.args[0]


def _fp8_2d(node) -> torch.Tensor | None:
    """The example value of `node` where it is a 2-D fp8 tensor, or None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    ok = isinstance(val, torch.Tensor) and val.dtype in _FP8 and val.dim() == 2
    return val if ok else None


def _transposed_source(node: fx.Node) -> fx.Node | None:
    """The contiguous 2-D fp8 tensor `node` copies transposed, or None."""
    perm = _contiguous_copy_of(node)
    if not (isinstance(perm, fx.Node) and perm.target is torch.ops.aten.permute.default):
        return None
    if list(perm.args[1]) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return None
    src = perm.args[0]
    val = _fp8_2d(src)
    return src if val is not None and val.is_contiguous() else None


class TransposesApart(CustomGraphPass):
    """The post-grad pass (module docstring)."""

    def __call__(self, graph: fx.Graph) -> None:
        for node in list(graph.nodes):
            src = _transposed_source(node)
            if src is None:
                continue
            perm = node.args[0]
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.dtrain.fp8_transpose.default, (src,))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            if not perm.users:  # only what this pass orphaned: Inductor runs no general DCE here
                graph.erase_node(perm)

    def uuid(self):  # Inductor's FX graph cache keys on this
        return get_hash_for_files((__file__,))


# Ops that only view their input: a chain of them from a graph input is that input.
_VIEWS = ("permute", "t", "transpose", "view", "_unsafe_view", "alias", "reshape")


def _copied_input(node: fx.Node) -> fx.Node | None:
    """The 2-D fp8 graph input `node` is a contiguous copy of through views only (in the
    joint graph torchao's weight transpose is clone(permute(permute(w))): the forward's w.t()
    and the backward's .t() again), or None."""
    src = _contiguous_copy_of(node)
    while isinstance(src, fx.Node) and src.op == "call_function":
        packet = getattr(src.target, "overloadpacket", None)
        if packet is None or packet.__name__ not in _VIEWS:
            return None
        src = src.args[0]
    if not (isinstance(src, fx.Node) and src.op == "placeholder"):
        return None
    return src if _fp8_2d(src) is not None else None


class WeightTransposesInBackward(CustomGraphPass):
    """The joint-graph pass (module docstring): only copies of an fp8 graph input are
    marked, so a weight cast inside the graph (fp8 without fsdp's fp8 all-gather) and the
    activations' transposes are left alone."""

    def __call__(self, graph: fx.Graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        for node in graph.nodes:
            if _copied_input(node) is not None:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self):
        return get_hash_for_files((__file__,))


def install_weight_transposes_in_backward() -> None:
    """Install the joint-graph pass for every graph Inductor compiles in this process
    (idempotent); another joint pass installed already is left alone (said in the log)."""
    _install(
        "joint_custom_pre_pass",
        WeightTransposesInBackward,
        "the fp8 weights' transposed copies may be saved for backward",
    )


def _install(slot: str, pass_type: type, otherwise: str) -> None:
    """Put a `pass_type` in Inductor's config `slot` unless one is there; where another pass
    holds it, leave it and say `otherwise` in the log (chaining passes of unknown kinds could
    make Inductor's cache serve graphs compiled under another pass)."""
    import torch._inductor.config as inductor_config

    current = getattr(inductor_config, slot)
    if isinstance(current, pass_type):
        return
    if current is not None:
        log.warning(
            "fp8: another Inductor pass is installed in %s (%r); %s (dtrain/lowp/fp8/layout.py)",
            slot,
            current,
            otherwise,
        )
        return
    setattr(inductor_config, slot, pass_type())


def install_transposes_apart() -> None:
    """Install the pass for every graph Inductor compiles in this process (idempotent). It
    touches only transposed copies of fp8 tensors, so other graphs are unchanged. Where another
    post-grad pass is installed already it is left alone, and so are the transposes (said once
    in the log): chaining passes of unknown kinds could make Inductor's cache serve graphs
    compiled under another pass."""
    _install(
        "post_grad_custom_post_pass",
        TransposesApart,
        "the weight-gradient transposes stay fused by Inductor",
    )

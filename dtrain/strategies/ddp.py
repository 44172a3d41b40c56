"""strategy=ddp: DistributedDataParallel, every rank a full replica, gradients all-reduced.

Gradients are views into DDP's buckets (gradient_as_bucket_view), so a rank holds one copy of
them, not two. Non-final micro-steps skip the all-reduce (no_sync). Gradients are all-reduced in
fp32 unless precision.reduce_dtype asks for bf16 (DDP's compress hook: half the bytes to send).

Compiled whole by default (strategy.compile_scope=model): Dynamo's DDPOptimizer splits the graph
at bucket boundaries so all-reduces still overlap the backward, which is why the buckets are
large (strategy.bucket_cap_mb, 400 MB); `compile_scope=blocks` compiles each block and the loss,
then wraps. Compiling before wrapping gives the same split graph, so it is not offered.
Measurements of both choices: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.config import StrategyConfig
from dtrain.strategies.base import Collective, MemoryFacts, SpeedFacts, Strategy, compile_blocks


class DDPStrategy(Strategy):
    name = "ddp"
    names = ("ddp",)
    needs_distributed = True
    options = ("compile_scope",)
    # Gradients are views into DDP's buckets, which live from one step to the next.
    memory = MemoryFacts(persistent_grads=True, graph_split_buckets=True)
    speed = SpeedFacts(
        collectives=(
            Collective(
                "all_reduce",
                "grads",
                "reduce",
                calls="buckets",
                overlap=0.5,
                why="each bucket is reduced as the backward fills it, but the graph cut at "
                "bucket boundaries waits on the last ones (fitted: 1b, 2x H200)",
            ),
        ),
    )

    @classmethod
    def memory_options(cls, cfg: StrategyConfig, device_type: str) -> dict:
        return {**super().memory_options(cfg, device_type), "ddp_bucket_mb": cfg.bucket_cap_mb}

    def wrap(self, module: nn.Module) -> nn.Module:
        compiled = self.compile_enabled
        if compiled and self.compile_scope == "blocks":
            compile_blocks(module)
        if self.precision.fp8_scaling == "delayed":
            # Each rank's own amaxes (lowp/fp8/delayed): not broadcast from rank 0 every forward.
            from dtrain.lowp.fp8.delayed import state_buffer_names

            DDP._set_params_and_buffers_to_ignore_for_model(module, state_buffer_names(module))
        self._ddp = DDP(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        reduce = self.precision.reduce_dtype
        if reduce != self.precision.param_dtype:  # precision.reduce_dtype: another wire dtype
            self._ddp.register_comm_hook(None, reduce_in(reduce))
        if compiled and self.compile_scope == "model":
            return torch.compile(self._ddp)
        return self._ddp

    def no_sync(self, last_micro: bool):
        return contextlib.nullcontext() if last_micro else self._ddp.no_sync()


def reduce_in(dtype: torch.dtype):
    """A DDP comm hook that all-reduces each bucket in `dtype` (the mean, written back into the
    bucket in the gradients' own dtype). torch's bf16_compress_hook does the same but refuses
    anything but NCCL, so the CPU (gloo) tests could not run the path that GPUs take."""

    # No annotations: DDP checks them against the real classes, and this module's are strings.
    def hook(group, bucket):
        group = group if group is not None else dist.group.WORLD
        buf = bucket.buffer()
        narrow = buf.to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(narrow, group=group, async_op=True).get_future()

        def widen(f):
            return buf.copy_(f.value()[0])

        return fut.then(widen)

    return hook

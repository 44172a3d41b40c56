"""Run by tests/gpu/test_two_gpus.py: train through dtrain.train.run with CUDA's sync debug
mode set to "error" from step FROM_STEP to the last step's report, so that any host-device
sync in a step that is not logged (an .item(), a copy from pageable memory, a nonzero) raises.

    torchrun --standalone --nproc_per_node=2 tests/gpu/sync_free_worker.py OVERRIDES...

Two ranks, because the per-step stop vote (StopSignal.poll) only runs where there is more than
one; the worker fails unless that vote ran under the strict mode.

Under fsdp with fp8 it also counts, from optimizer step FROM_STEP + 1 on, the fp8 weight
all-gathers and how many sent the shard cast right after the step (dtrain/lowp/fp8/linear.py)
instead of casting their own, and whether that cast ran compiled: "fp8 gathers N cached M compiled
0|1" on stdout.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from dtrain import train as loop
from dtrain.config import compose
from dtrain.reliability.preemption import StopSignal
from dtrain.run.report import StepReport
from tests.fsdp_fp8_worker import gathers_seen

FROM_STEP = 3  # steps 1-3 compile and warm up; the ones after must not sync


def main(overrides: list[str]) -> None:
    cfg = compose(overrides)
    end = cfg.trainer.max_steps
    one_step, step_done, poll = loop.one_step, StepReport.step_done, StopSignal.poll
    strict_votes, watch = [], contextlib.ExitStack()
    fp8_gathers = None

    def strict_step(r, report, step, heartbeat):
        nonlocal fp8_gathers
        if step == FROM_STEP and fp8_cache_installed():  # after set-up: spy on the cached path
            fp8_gathers = watch.enter_context(gathers_seen())
        if step >= FROM_STEP:
            torch.cuda.set_sync_debug_mode("error")
        return one_step(r, report, step, heartbeat)

    def counted_poll(self):
        if self.distributed and torch.cuda.get_sync_debug_mode() == 2:  # 2: "error"
            strict_votes.append(1)
        return poll(self)

    def lenient_report(self, step, lr, grad_norm):
        if step == end or step % cfg.trainer.log_every == 0:  # a logged step syncs on purpose
            torch.cuda.set_sync_debug_mode(0)
        return step_done(self, step, lr, grad_norm)

    loop.one_step, StepReport.step_done = strict_step, lenient_report
    StopSignal.poll = counted_poll
    with watch:
        summary = loop.run(cfg)
    if not strict_votes:
        raise SystemExit("the stop vote never ran under the sync debug mode: nothing was tested")
    if fp8_gathers is not None:
        from dtrain.lowp.fp8 import linear as fp8

        compiled = int(fp8._compiled_cast_all is not None)  # the shards' cast, compiled
        print("fp8 gathers", len(fp8_gathers), "cached", sum(fp8_gathers), "compiled", compiled)
    print("steps", summary["step"])


def fp8_cache_installed() -> bool:
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W
    except ImportError:
        return False
    return getattr(W, "_dtrain_cached_cast", False)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Run by tests/gpu/test_single_gpu.py: train through dtrain.train.run with CUDA's sync debug
mode set to "error" from step FROM_STEP to the last step's report, so that any host-device
sync in a step that is not logged (an .item(), a copy from pageable memory, a nonzero) raises.

    python tests/gpu/sync_free_worker.py OVERRIDES...   (one process, a one-rank NCCL group)
"""

from __future__ import annotations

import sys

import torch

from dtrain import train as loop
from dtrain.config import compose
from dtrain.run.report import StepReport

FROM_STEP = 3  # steps 1-3 compile and warm up; the ones after must not sync


def main(overrides: list[str]) -> None:
    cfg = compose(overrides)
    end = cfg.trainer.max_steps
    one_step, step_done = loop.one_step, StepReport.step_done

    def strict_step(r, report, step, heartbeat):
        if step >= FROM_STEP:
            torch.cuda.set_sync_debug_mode("error")
        return one_step(r, report, step, heartbeat)

    def lenient_report(self, step, lr, grad_norm):
        if step == end or step % cfg.trainer.log_every == 0:  # a logged step syncs on purpose
            torch.cuda.set_sync_debug_mode(0)
        return step_done(self, step, lr, grad_norm)

    loop.one_step, StepReport.step_done = strict_step, lenient_report
    summary = loop.run(cfg)
    print("steps", summary["step"])


if __name__ == "__main__":
    main(sys.argv[1:])

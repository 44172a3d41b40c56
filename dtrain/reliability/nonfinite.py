"""Non-finite loss or gradients: skip the update, or stop after saving the last good state.

The check is folded into the gradient norm the strategy already computes for clipping. That
norm is global (all-reduced gradients under DDP, a reduced total under FSDP), so every rank
sees the same value and all ranks skip the same step without a vote of their own.

No host sync is added on the GPU: with a fused optimizer (the default on CUDA) the flag goes
to the optimizer as `found_inf`, the same tensor GradScaler uses, and the fused AdamW kernel
leaves weights, moments and step count untouched when it is 1. The count of skipped steps
stays on the device and is read when the loop logs (it syncs there already). A non-fused
optimizer (the default on CPU, where a sync is free) reads the flag with `.item()`.

trainer.on_nonfinite=stop needs the flag on the host: on CUDA it is copied into pinned memory
behind an event and read one step later (the same pattern as the stop-signal vote), so the
loop notices at the end of step s+1 and saves; step s was skipped, so the saved state is good.
A NaN can still reach the weights by a path the norm does not see (an update that is itself
non-finite); so before that save every tensor is checked (nonfinite_tensors), and a poisoned
state is never saved.

fp16: the strategy's LossScaler (dtrain/lowp/scaling.py) steps instead of this guard. Inf/NaN
gradients are then overflows: GradScaler skips the step, halves the scale and counts it as
train/overflow_steps; they never stop the run. (A loss that is NaN for a reason other than
overflow therefore keeps being skipped under fp16; watch train/overflow_steps.)
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dtrain")


class NonfiniteGuard:
    def __init__(self, mode: str, device: torch.device, start_step: int = 0):
        self.mode, self.device = mode, device
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # on device: no sync
        self._pending: tuple[torch.Tensor, object, int] | None = None
        self._prev: tuple[torch.Tensor, object, int] | None = None
        self._step = start_step  # after a resume, steps are named as the run counts them
        self.stop_step: int | None = None

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """optimizer.step() unless `grad_norm` is non-finite; call in place of it."""
        self._step += 1
        bad = ~torch.isfinite(grad_norm.detach())
        if _is_fused(optimizer):
            optimizer.found_inf = bad.float()
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif not bad.item():  # CPU / foreach: the sync costs nothing there
            optimizer.step()
        self.skipped += bad
        if self.mode == "stop":
            self._queue()

    def _queue(self) -> None:
        # The running count, not this step's flag: a snapshot read late still sees every skip.
        if self.device.type == "cuda":
            host = torch.empty((), dtype=torch.int64, pin_memory=True)
            host.copy_(self.skipped, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._prev, self._pending = self._pending, (host, event, self._step)
        else:
            self._prev, self._pending = None, (self.skipped.clone(), None, self._step)

    def poll(self) -> int | None:
        """In stop mode, once a skip is known on the host: the step it was seen by; else None.

        On CUDA this reads the previous step's snapshot (its event is behind the work already
        queued for this step, so waiting for it never idles the GPU); on CPU the current one.
        """
        if self.stop_step is not None:
            return self.stop_step
        snap = self._pending if self.device.type != "cuda" else self._prev
        if snap is None:
            return None
        host, event, at = snap
        if event is not None:
            event.synchronize()
        if int(host.item()) > 0:
            self.stop_step = at
        return self.stop_step

    def count(self) -> int:
        """Steps skipped so far (a sync: call where the loop syncs anyway)."""
        return int(self.skipped.item())


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.param_groups) and all(
        g.get("fused", False) for g in optimizer.param_groups
    )


def nonfinite_tensors(state: dict, limit: int = 3) -> tuple[int, list[str]]:
    """Floating-point tensors of a (nested) state dict that hold a NaN or inf on this rank:
    their count and the first `limit` names. One host sync per device, not per tensor."""
    named: list[tuple[str, torch.Tensor]] = []

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj  # DTensor: our shard
            if local.is_floating_point() and local.numel():
                named.append((prefix, torch.isfinite(local).all()))

    walk("", state)
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, flag) in enumerate(named):
        by_device.setdefault(flag.device, []).append(i)
    bad = []
    for idx in by_device.values():
        flags = torch.stack([named[i][1] for i in idx]).cpu().tolist()
        bad += [i for i, ok in zip(idx, flags) if not ok]
    return len(bad), [named[i][0] for i in sorted(bad)[:limit]]

"""Dynamic loss scaling for fp16, with the skipped (overflowing) steps counted on the device.

torch.amp.GradScaler multiplies the loss by a scale S (2**16 at first) so that small fp16
gradients do not flush to zero; before the step the gradients are divided by S, and if any is
inf/NaN the step is skipped and S halved (S doubles after 2000 clean steps). Under FSDP the
gradients are sharded, so the inf check must be reduced over ranks: ShardedGradScaler.
"""

from __future__ import annotations

import torch


class LossScaler:
    def __init__(self, device: torch.device, *, sharded: bool = False):
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type)
        else:
            self.scaler = torch.amp.GradScaler(device.type)
        # Counted on the device so that a normal step never waits for the host.
        self.overflow_steps = torch.zeros((), dtype=torch.int64, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale (before clipping, so the norm is the true one)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """Step unless a gradient overflowed; update the scale. `grad_norm` is the global norm
        of the unscaled gradients: non-finite exactly when the scaler skips the step."""
        self.scaler.step(optimizer)
        self.scaler.update()
        self.overflow_steps += (~torch.isfinite(grad_norm)).to(torch.int64)

    def metrics(self) -> dict[str, float]:
        """For the logs: steps skipped so far and the current scale (syncs: call when logging)."""
        return {
            "train/overflow_steps": float(self.overflow_steps.item()),
            "train/loss_scale": float(self.scaler.get_scale()),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors (so DCP saves and loads them in place like any other state)."""
        sd = self.scaler.state_dict()
        return {
            "scale": torch.tensor(float(sd.get("scale", self.scaler.get_scale()))),
            "growth_tracker": torch.tensor(int(sd.get("_growth_tracker", 0))),
            "overflow_steps": self.overflow_steps.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        sd = self.scaler.state_dict()
        sd.update(scale=float(state["scale"]), _growth_tracker=int(state["growth_tracker"]))
        self.scaler.load_state_dict(sd)
        self.overflow_steps.fill_(int(state["overflow_steps"]))

"""Run under torchrun (2 ranks, gloo): fsdp's fp16 step path on CPU, the one GPUs take.

fp16 is refused on CPU at config time (it needs CUDA), so this builds the strategy with the fp16
Precision directly: fp16 autocast, ShardedGradScaler and the foreach AdamW beside it, and the
gradient norm that FSDP returns as a DTensor meeting the scaler's plain overflow counter (that
crashed on 2x H100 before clip_and_step made it one tensor). Writes rank{r}.txt into argv[1]:
the losses, the overflow count and the loss scale.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dtrain import dist as ddist  # noqa: E402
from dtrain.config import compose  # noqa: E402
from dtrain.precision import PRECISIONS  # noqa: E402
from dtrain.strategies import build_strategy  # noqa: E402


def main() -> None:
    env = ddist.init_distributed("cpu", timeout_s=120, force_group=True)
    cfg = compose(["model=tiny", "strategy=fsdp", "strategy.compile=false"])
    cfg.model.vocab_size = 64
    s = build_strategy(cfg.strategy, PRECISIONS["fp16"], env)
    s.configure(micro_batch_size=2, grad_accum_steps=1, grad_clip=1.0)
    s.setup(cfg.model, cfg.optim, seed=0)
    assert s.loss_scaler is not None
    gen = torch.Generator().manual_seed(env.rank)
    losses = []
    for _ in range(3):
        tok = torch.randint(0, 64, (2, 17), generator=gen)
        losses.append(
            float(s.forward_backward(tok[:, :-1], tok[:, 1:], last_micro=True, loss_div=1))
        )
        norm = s.clip_and_step(1e-3, 1.0)
        assert not hasattr(norm, "full_tensor") and torch.isfinite(norm)
    m = s.step_metrics()
    Path(sys.argv[1], f"rank{env.rank}.txt").write_text(
        f"{losses} {m['train/overflow_steps']} {m['train/loss_scale']}\n"
    )
    ddist.shutdown()


if __name__ == "__main__":
    main()

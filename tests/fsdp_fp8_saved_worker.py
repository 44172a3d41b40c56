"""Run under torchrun (2 ranks, gloo): what a compiled fp8 block under fsdp (fp8 all-gather,
blocks kept gathered) saves for backward. torch._scaled_mm runs in real fp8 on CPU, so the
graphs are CUDA's. argv[2] "on": dtrain's joint-graph pass (lowp/fp8/layout.py,
WeightTransposesInBackward) as apply_fp8 installs it; "off": taken out before the first
compile. Writes rank{r}_{argv[2]}.txt into argv[1]: fp8 tensors saved by the forward, how many
of them hold memory of their own (not a gathered weight's), the loss and every gradient.
"""

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dtrain import dist as ddist  # noqa: E402
from dtrain.config import compose  # noqa: E402
from dtrain.precision import PRECISIONS  # noqa: E402
from dtrain.strategies import build_strategy  # noqa: E402

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    env = ddist.init_distributed("cpu", timeout_s=300, force_group=True)
    cfg = compose(
        [
            "model=tiny",
            "strategy=fsdp",
            "strategy.compile=true",
            "strategy.reshard_after_forward=false",
            "model.d_model=64",
            "model.ffn_hidden=128",
            "model.n_head=4",
            "model.n_layer=2",
        ]
    )
    cfg.model.vocab_size = 64
    s = build_strategy(cfg.strategy, replace(PRECISIONS["fp8"], fp8_emulate=False), env)
    s.configure(micro_batch_size=2, grad_accum_steps=1, grad_clip=1.0)
    s.setup(cfg.model, cfg.optim, seed=0)
    import torch._inductor.config as inductor_config

    from dtrain.lowp.fp8.layout import WeightTransposesInBackward

    assert isinstance(inductor_config.joint_custom_pre_pass, WeightTransposesInBackward)
    if mode == "off":
        inductor_config.joint_custom_pre_pass = None
    tok = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(env.rank))
    saved = []

    def pack(t):
        if t.dtype in _FP8:
            saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = s.module(tok[:, :-1], tok[:, 1:])
    # The blocks stay gathered: each linear's weight is its gathered fp8 tensor now.
    gathered = set()
    for m in s.module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            gathered.add(getattr(w, "_data", w).untyped_storage().data_ptr())
    loss.backward()
    own = sum(p not in gathered for p in saved)
    grads = [p.grad.to_local().flatten() for p in s.module.parameters() if p.grad is not None]
    torch.save(
        {"saved": len(saved), "own": own, "loss": loss.detach(), "grads": torch.cat(grads)},
        Path(out_dir, f"rank{env.rank}_{mode}.pt"),
    )
    ddist.barrier()
    ddist.shutdown()


if __name__ == "__main__":
    main()

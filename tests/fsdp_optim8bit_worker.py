"""Run under torchrun (2 ranks, gloo): the grouped 8-bit AdamW step on FSDP2's DTensors.

Two copies of one model, each sharded with fully_shard, train 3 steps on the same data: one
with dtrain's GroupedAdamW8bit, one with torchao's AdamW8bit (eager both: torch.compile is
the identity here). Writes rank{r}.txt into argv[1]: whether the two ended on the same
parameters and optimizer states bit for bit, and how many of the rank's moments are 8-bit.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

torch.compile = lambda fn=None, **kw: fn  # torchao compiles its step: eager on CPU

from torchao.optim import AdamW8bit  # noqa: E402

from dtrain.config import OptimConfig  # noqa: E402
from dtrain.lowp.optim8bit import build_adamw8bit  # noqa: E402
from dtrain.optim import param_groups  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    # Shards of 128x256 and 32x256 (8-bit moments), and of the biases (plain moments).
    m = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    for layer in (m[0], m[2]):
        fully_shard(layer)
    return fully_shard(m)


def local_states(opt) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            t = st[key].to_local()
            out += [t.codes, t.scale] if hasattr(t, "codes") else [t]
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours, ref = model(), model()
    opt = build_adamw8bit(ours, cfg, compiled=False)
    ref_opt = AdamW8bit(
        param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 256, generator=g)
        for m, o in ((ours, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True)
    )
    same_states = all(
        torch.equal(a, b) for a, b in zip(local_states(opt), local_states(ref_opt), strict=True)
    )
    eight = sum(t.dtype == torch.uint8 for t in local_states(opt))
    moved = not torch.equal(ours[0].weight.full_tensor(), model()[0].weight.full_tensor())
    (Path(sys.argv[1]) / f"rank{rank}.txt").write_text(
        f"params {same} states {same_states} eight_bit {eight} moved {moved}\n"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

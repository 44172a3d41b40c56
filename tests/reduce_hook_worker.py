"""Run under torchrun (2 ranks, gloo): DDP with dtrain's bf16 comm hook (ddp.reduce_in).

Two micro-steps, the first under no_sync, on a small linear layer with different inputs per rank;
writes rank{r}.pt into argv[1]: the DDP gradient and every rank's local (unreduced) gradient,
for the test to recompute the mean the hook should give.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from dtrain import dist as ddist  # noqa: E402
from dtrain.strategies.ddp import reduce_in  # noqa: E402


def main() -> None:
    env = ddist.init_distributed("cpu", timeout_s=120, force_group=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, bias=False)
    plain = torch.nn.Linear(64, 32, bias=False)
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, reduce_in(torch.bfloat16))
    gen = torch.Generator().manual_seed(100 + env.rank)
    xs = [torch.randn(5, 64, generator=gen) for _ in range(2)]
    with ddp.no_sync():
        ddp(xs[0]).square().sum().backward()
    ddp(xs[1]).square().sum().backward()
    for x in xs:
        plain(x).square().sum().backward()
    local = [torch.empty_like(plain.weight.grad) for _ in range(env.world_size)]
    dist.all_gather(local, plain.weight.grad)
    torch.save({"grad": model.weight.grad, "local": local}, Path(sys.argv[1], f"rank{env.rank}.pt"))
    ddist.shutdown()


if __name__ == "__main__":
    main()

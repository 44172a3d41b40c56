"""Run under torchrun (2 ranks, gloo): fsdp's fp8 step path on CPU (torchao's emulated casts).

FSDP2 all-gathers fp8 weights; every shard must cast with the same scale. After each optimizer
step the strategy precomputes all weights' scales in one all-reduce (precision.precision_hooks)
instead of one all-reduce per linear in the next forward. This trains 3 steps with the hook and
3 without, from the same weights and data, and writes rank{r}.txt into argv[1]: how many fp8
weights carry a precomputed scale and a cached fp8 shard
(lowp/fp8/linear.install_cached_weight_cast) after the hooked run, and whether both runs ended
on the same weights bit for bit (the scale and the cast are the ones the forward would compute,
and a stale cache would change step 2).
The hook casts every shard right after the step (lowp/fp8/linear.precompute_fp8_scales): each cache
must hold the scale just computed and the shard cast from the weights just updated. Then, with
precision.fp8_all_gather=false, 3 steps more: the weights stay plain (gathered in the compute
dtype, cast by each block), no post-step hook, and they train.
"""

import contextlib
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


def assert_fresh(locals_) -> None:
    """Every fp8 weight's cached shard is torchao's cast of its weight now, with its scale now."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    fp8 = [t for t in locals_ if isinstance(t, W)]
    assert fp8 and all(hasattr(t, "_dtrain_fp8") for t in fp8)
    for t in fp8:
        scale, shard = t._dtrain_fp8
        assert scale is t._precomputed_scale
        ref = hp_tensor_and_scale_to_float8(t._tensor, scale, t._dtype)._data
        assert torch.equal(shard.view(torch.uint8), ref.view(torch.uint8))


@contextlib.contextmanager
def gathers_seen():
    """Records, for each fp8 weight all-gather, whether it sent the cached shard."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    installed, seen = W.fsdp_pre_all_gather, []

    def spy(self, mesh):  # FSDP2 checks this signature
        out = installed(self, mesh)
        seen.append(out[0][0] is getattr(self, "_dtrain_fp8", (None, None))[1])
        return out

    W.fsdp_pre_all_gather = spy
    try:
        yield seen
    finally:
        W.fsdp_pre_all_gather = installed


def strategy(env, cfg, **precision):
    s = build_strategy(cfg.strategy, replace(PRECISIONS["fp8"], fp8_emulate=True, **precision), env)
    s.configure(micro_batch_size=2, grad_accum_steps=1, grad_clip=1.0)
    s.setup(cfg.model, cfg.optim, seed=0)
    return s


def gathered_wide(env, cfg) -> tuple[int, int, int]:
    """precision.fp8_all_gather=false: (fp8-gathered weights, whether a post-step hook is set,
    whether 3 steps changed the weights); the block linears stay fp8 (Float8Linear)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    s = strategy(env, cfg, fp8_all_gather=False)
    assert sum(isinstance(m, Float8Linear) for m in s.module.modules()) == 4 * 7
    locals_ = [getattr(p, "_local_tensor", None) for p in s.module.parameters()]
    start = [t.clone() for t in locals_ if t is not None]
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(3):
        tok = torch.randint(0, 64, (2, 17), generator=gen)
        s.forward_backward(tok[:, :-1], tok[:, 1:], last_micro=True, loss_div=1)
        s.clip_and_step(1e-2, 1.0)
    now = [t for t in locals_ if t is not None]
    trained = all(not torch.equal(a, b) for a, b in zip(start, now, strict=True) if a.dim() == 2)
    return sum(isinstance(t, W) for t in locals_), int(s.post_step is not None), int(trained)


def train(env, cfg, hooked: bool):
    s = strategy(env, cfg)
    assert (s.post_step is not None) == True  # noqa: E712 - fsdp + tensorwise fp8 has a hook
    if not hooked:
        s.post_step = None
    gen = torch.Generator().manual_seed(env.rank)
    locals_ = [getattr(p, "_local_tensor", None) for p in s.module.parameters()]
    for step in range(3):
        tok = torch.randint(0, 64, (2, 17), generator=gen)
        with gathers_seen() as seen:
            s.forward_backward(tok[:, :-1], tok[:, 1:], last_micro=True, loss_div=1)
        # After the first step every fp8 all-gather sends the shard cast after the step, and
        # casts nothing itself (forward, and the backward's re-gathers of the blocks resharded).
        assert len(seen) >= 4 * 7, len(seen)
        assert all(seen) == (hooked and step > 0), (hooked, step, seen)
        cached = sum(hasattr(t, "_dtrain_fp8") for t in locals_)  # cast for this step's gathers
        s.clip_and_step(1e-2, 1.0)
        if hooked:  # the step changed the weights: every shard is cast again, from the new ones
            assert_fresh(locals_)
    scaled = sum(getattr(t, "_precomputed_scale", None) is not None for t in locals_)
    if hooked:  # loading weights (a resume) casts every shard again, from the loaded ones
        s.forward_backward(tok[:, :-1], tok[:, 1:], last_micro=True, loss_div=1)
        # Weights other than the cached ones (doubled: exact in fp32), then back (halved).
        for factor in (2.0, 0.5):
            before = {id(t): t._dtrain_fp8[0] for t in locals_ if hasattr(t, "_dtrain_fp8")}
            state = s.state_dict()
            state["model"] = {
                k: v * factor if v.is_floating_point() else v for k, v in state["model"].items()
            }
            s.load_state_dict(state)
            assert all(t._dtrain_fp8[0] is not before[id(t)] for t in locals_ if id(t) in before)
            assert_fresh(locals_)
        s.optimizer.zero_grad(set_to_none=True)
    weights = {
        k: v.full_tensor().clone()
        for k, v in s.module.state_dict().items()
        if hasattr(v, "full_tensor")
    }
    return scaled, cached, weights


def main() -> None:
    env = ddist.init_distributed("cpu", timeout_s=120, force_group=True)
    cfg = compose(
        [
            "model=tiny",
            "strategy=fsdp",
            "strategy.compile=false",
            "model.d_model=64",
            "model.ffn_hidden=128",
            "model.n_head=4",
        ]
    )
    cfg.model.vocab_size = 64
    scaled, cached, hooked = train(env, cfg, hooked=True)
    from dtrain.lowp.fp8 import linear as fp8

    assert fp8._compiled_cast_all is None  # strategy.compile=false: the shards cast eagerly
    unscaled, _, plain = train(env, cfg, hooked=False)
    same = hooked.keys() == plain.keys() and all(torch.equal(hooked[k], plain[k]) for k in hooked)
    wide = " ".join(map(str, gathered_wide(env, cfg)))
    Path(sys.argv[1], f"rank{env.rank}.txt").write_text(
        f"{scaled} {cached} {unscaled} {int(same)} {wide}\n"
    )
    ddist.barrier()
    ddist.shutdown()


if __name__ == "__main__":
    main()

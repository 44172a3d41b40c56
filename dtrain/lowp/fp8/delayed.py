"""precision.fp8_scaling=delayed: fp8 casts of activations and gradients in one pass.

torchao's tensorwise recipe scales dynamically: each input and output gradient is read once for
its amax and again for the cast, since the cast's scale depends on the whole tensor. At
model=1b on one H200 those amax-only reads were about 20 ms of fp8's 254 ms of GPU time a step
(the SwiGLU backward's gradient 6.8 ms, the forward's norms about 7.6, the RoPE backward's 4.0,
the SwiGLU forward's 3.1: raw outputs of 2026-11-30). torchao has
dropped its delayed scaling; this is Transformer Engine's recipe on torchao's Float8Linear.
Measured at 1b on one H200: 1.046x dynamic fp8's tokens/s, 1.24x bf16's (three benchmark runs,
raw outputs of 2026-11-30). At 8b under fsdp on two GPUs it is 0.986x dynamic fp8 (the same
day's): the amax passes are a smaller part of the wider GEMMs there, so it
is not the default. The kernels' fusion is not yet seen in a trace.

Delayed scaling casts with a scale known before the tensor is made: fmax / (the largest amax
of the last `history` optimizer steps). The cast then no longer waits for its own tensor's
amax, so Inductor fuses it into the kernel that produces the tensor, and the amax this step
contributes to later steps is a row reduction in that same kernel (one pass: row maxima, then
the max of those). Weights keep torchao's dynamic scales (their amax is cheap, and under fsdp
the precomputed one is already off the critical path).

- The first step of a run has no history: it scales dynamically (torchao's numerics, bit for
  bit) and records the amaxes. Where the model compiles with whole parameters (single, ddp),
  `runs_eager` tells the strategy to run that step eagerly (dtrain/strategies/eager_step.py),
  so the only graphs compiled are the delayed ones that every later step runs. On 8b's blocks
  cut to 16 on one H200, from empty compile caches, step 5 came 106 s into the loop against
  161 s with the dynamic step compiled too (bf16: 43 s), at the same speed and memory after;
  at 1b 142 s and 155 s, where the compiled first step had not reached step 5 after 300 s
  (docs/benchmarks.md, "Start-up"; `startup/first_step.json` in bench/results).
  `precision.fp8_first_step=compiled` compiles it too. Each rank's
  histories go into its own file of a checkpoint (`state_dict()`, through the strategy's
  `rank_state`), so a resume goes on with delayed scales: the same steps as a run that was
  never stopped, bit for bit, and one compile instead of two. Saved by another number of
  ranks, rank r takes the histories of their rank r modulo their number (the same tensors'
  range, seen on other data). A checkpoint without them (an older dtrain) starts again from
  dynamic scales, and says so.
- A value above the scale's range saturates at fp8's largest (torchao's saturated cast), as in
  Transformer Engine; the history's maximum keeps that rare.
- Linears that read one tensor (a block's wq/wk/wv, w1/w3: `same_input` in dtrain/model.py)
  share the input's state, so the tensor is cast once, as dynamic scaling's common
  subexpression gave.
- Each rank keeps its own amaxes (no communication): only where a tensor was made matters.
"""

from __future__ import annotations

import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import amax_to_scale


def _amax(t: torch.Tensor) -> torch.Tensor:
    """|t|'s largest value, fp32, with no gradient. Row maxima first: Inductor puts a row
    reduction in the kernel that makes `t` (a full reduction would be a split reduction of its
    own, reading `t` again)."""
    return t.detach().reshape(-1, t.shape[-1]).abs().amax(-1).max().to(torch.float32)


def _scale(history: torch.Tensor, now: torch.Tensor | None, dtype: torch.dtype, delayed: bool):
    return amax_to_scale(history.max() if delayed else now, dtype)


class _Fp8State(nn.Module):
    """One cast site's amax: `amax` (this step's so far; the max over micro-batches and over
    recomputation, which gives the same value again) and `history` (the last steps', newest
    first). Buffers, not persistent: they follow the module to its device and stay out of the
    model's state dict (it is the same on every rank; these are each rank's own):
    DelayedScaling.state_dict() saves them."""

    def __init__(self, length: int, device):
        super().__init__()
        self.register_buffer("amax", torch.zeros((), device=device), persistent=False)
        self.register_buffer("history", torch.zeros(length, device=device), persistent=False)

    def record(self, t: torch.Tensor) -> torch.Tensor:
        now = _amax(t)
        self.amax.copy_(torch.maximum(self.amax, now))
        return now


class _GradCast(torch.autograd.Function):
    """Identity forward; the backward casts the output gradient to fp8 with the delayed scale
    (a Float8TrainingTensor, which torchao's matmul backward takes as it is) and records its
    amax. The state rides on ctx, not in saved tensors: it is written in backward."""

    @staticmethod
    def forward(ctx, y, state, delayed, linear_mm_config, dtype):
        ctx.state, ctx.delayed, ctx.linear_mm_config, ctx.dtype = (
            state,
            delayed,
            linear_mm_config,
            dtype,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        now = ctx.state.record(dy)
        scale = _scale(ctx.state.history, now, ctx.dtype, ctx.delayed)
        dy8 = hp_tensor_and_scale_to_float8(
            dy, scale, ctx.dtype, ctx.linear_mm_config, GemmInputRole.GRAD_OUTPUT
        )
        return dy8, None, None, None, None


class DelayedFloat8Linear(Float8Linear):
    """torchao's Float8Linear with delayed scales for its input and output gradient."""

    def init_delayed(self, history: int, input_state: _Fp8State | None = None) -> None:
        device = self.weight.device
        # The state of a shared input belongs to its first reader; the others reach it by a
        # plain reference (not a submodule: it is counted, moved and named once).
        if input_state is None:
            self.fp8_input = _Fp8State(history, device)
        object.__setattr__(self, "_shared_input", input_state)
        self.fp8_grad = _Fp8State(history, device)
        # The first step of a run, or after a load that restored no history: dynamic.
        self.delayed = False

    def input_state(self) -> _Fp8State:
        shared = self._shared_input
        return self.fp8_input if shared is None else shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as Float8Linear.forward: outputs in autocast's dtype
            x = x.to(torch.get_autocast_dtype("cuda"))  # its (GPU's) dtype, not the deprecated call
        c = self.config
        state = self.input_state()
        # Only forwards that train record (the trainer's eval runs under no_grad, in train
        # mode; activation checkpointing's recompute runs with grad on and records the same
        # amax again); the history is the training tensors'. A delayed forward that does not
        # record needs no amax at all.
        if self.training and torch.is_grad_enabled():
            now = state.record(x)
        else:
            now = None if self.delayed else _amax(x)
        in_dtype = c.cast_config_input.target_dtype
        x8 = hp_tensor_and_scale_to_float8(
            x,
            _scale(state.history, now, in_dtype, self.delayed),
            in_dtype,
            self.linear_mm_config,
            GemmInputRole.INPUT,
        )
        y = matmul_with_hp_or_float8_args.apply(x8, self.weight.t(), self.linear_mm_config, c)
        y = _GradCast.apply(
            y,
            self.fp8_grad,
            self.delayed,
            self.linear_mm_config,
            c.cast_config_grad_output.target_dtype,
        )
        if self.bias is not None:  # as Float8Linear.forward (dtrain's linears have none)
            y = y + self.bias.to(y.dtype)
        return y


def _roll(amaxes: list[torch.Tensor], histories: list[torch.Tensor]) -> None:
    for amax, history in zip(amaxes, histories, strict=True):
        # A non-finite step (skipped by trainer.on_nonfinite=skip) enters as the history's
        # max: recorded as it was, its inf/NaN would be every later scale's.
        kept = torch.where(amax.isfinite(), amax, history.max())
        history.copy_(torch.cat([kept[None], history[:-1]]))
        amax.zero_()


class DelayedScaling:
    """The fp8 linears of one model under delayed scaling: `step()` after each optimizer step
    pushes every site's amax into its history (one compiled call for all of them where the
    model compiles) and turns delayed scaling on, once a step's amaxes were all finite;
    `reset()` after a checkpoint load drops the history, so the next step scales dynamically
    and records again, unless `load_state_dict()` then restores the history saved with it.
    `names`: each state's module name (`of` gives them), the keys of `state_dict()`."""

    def __init__(
        self,
        linears: list[DelayedFloat8Linear],
        device,
        *,
        compiled: bool,
        names: dict[int, str] | None = None,
        eager_first: bool = False,
    ):
        self.linears = linears
        states = {id(s): s for m in linears for s in (m.input_state(), m.fp8_grad)}
        self.states = list(states.values())
        names = names or {}
        self.names = [names.get(id(s), str(i)) for i, s in enumerate(self.states)]
        for s in self.states:  # fsdp's to_empty left them unset, and on the host if offloaded
            s.to(device)
        self._roll = torch.compile(_roll, dynamic=False) if compiled else _roll
        # Whether a dynamic step runs eagerly: where the model compiles, the strategy can run
        # a step eagerly and precision.fp8_first_step=eager (the caller decides).
        self.eager_first = eager_first
        self.reset()

    @classmethod
    def of(
        cls, module: nn.Module, device, *, compiled: bool, eager_first: bool = False
    ) -> DelayedScaling:
        linears = [m for m in module.modules() if isinstance(m, DelayedFloat8Linear)]
        names = {
            id(m): _plain_name(name)
            for name, m in module.named_modules()
            if isinstance(m, _Fp8State)
        }
        return cls(linears, device, compiled=compiled, names=names, eager_first=eager_first)

    def runs_eager(self) -> bool:
        """Whether the next step should run eagerly: its scales are dynamic (a first step, or
        after a load that restored no history) and eager_first was asked. Compiling that one
        step's graphs would cost about as much time as the delayed ones' that every other step
        runs."""
        return self.eager_first and bool(self.linears) and not self.linears[0].delayed

    def step(self) -> None:
        amaxes = [s.amax for s in self.states]
        histories = [s.history for s in self.states]
        if self.linears and not self.linears[0].delayed:
            # Still dynamic (a first step: no history yet): turn delayed only on amaxes
            # that are all finite, else the history would start empty. One sync, only then.
            if not bool(torch.stack(amaxes).isfinite().all()):
                self.reset()
                return
            for m in self.linears:
                m.delayed = True
        self._roll(amaxes, histories)

    @torch.no_grad()
    def reset(self) -> None:
        for s in self.states:
            s.amax.zero_()
            s.history.zero_()
        for m in self.linears:
            m.delayed = False

    def state_dict(self) -> dict:
        """This rank's scaling state, on the host (a copy: an async save writes it while
        training goes on): whether scales are delayed, and each site's history. A save comes
        after an optimizer step, when every amax was rolled into its history and zeroed."""
        delayed = bool(self.linears) and self.linears[0].delayed
        # One copy to the host for all of them (at 1b, 176 histories), not one per tensor.
        host = torch.stack([s.history.detach() for s in self.states]).cpu() if self.states else []
        return {"delayed": delayed, "history": dict(zip(self.names, host, strict=True))}

    @torch.no_grad()
    def load_state_dict(self, state: dict | None) -> str | None:
        """Restore what state_dict() saved; None, or why it could not be (nothing saved, or
        another model's or history length's sites): the state is then left reset, and the
        next step scales dynamically."""
        if not isinstance(state, dict) or not state:
            return "the checkpoint holds no amax history for this rank"
        saved = state.get("history")
        mine = dict(zip(self.names, self.states, strict=True))
        if not isinstance(saved, dict) or saved.keys() != mine.keys():
            n = len(saved) if isinstance(saved, dict) else 0
            return f"its amax histories are another model's ({n} cast sites; {len(mine)} here)"
        for name, s in mine.items():
            t, length = saved[name], s.history.numel()
            if not (
                isinstance(t, torch.Tensor)
                and t.layout == torch.strided
                and not t.is_meta
                and t.dtype == torch.float32
                and t.shape == s.history.shape
            ):
                return (
                    f"its amax history for {name} is not {length} fp32 values "
                    f"(precision.fp8_amax_history={length})"
                )
            if not bool((t.isfinite() & (t >= 0)).all()):
                return f"its amax history for {name} holds a negative or non-finite value"
        if not isinstance(state.get("delayed"), bool):
            return "it does not say whether scaling had turned delayed"
        for name, s in mine.items():
            s.history.copy_(saved[name])
            s.amax.zero_()
        for m in self.linears:
            m.delayed = state["delayed"]
        return None


# Module names as the model's state dict spells them: activation checkpointing's wrapper (fsdp
# wraps each block) and torch.compile's module add a segment there that DCP's state dict drops,
# so a history saved with one keeps its name in a run without it.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _plain_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def state_buffer_names(module: nn.Module) -> list[str]:
    """The fully qualified names of `module`'s delayed-scaling buffers."""
    return [
        f"{name}.{buffer}"
        for name, m in module.named_modules()
        if isinstance(m, _Fp8State)
        for buffer, _ in m.named_buffers(recurse=False)
    ]


def install_delayed_scaling(module: nn.Module, history: int) -> list[DelayedFloat8Linear]:
    """Turn the Float8Linears of `module` (convert_to_float8_training's) into
    DelayedFloat8Linears with `history` steps of amax; linears named in a parent's
    `same_input` share that input's state. Returns them."""
    linears = []
    for parent in module.modules():
        shared: _Fp8State | None = None
        same = getattr(parent, "same_input", ())
        for name, child in parent.named_children():
            if type(child) is not Float8Linear:
                continue
            child.__class__ = DelayedFloat8Linear  # only forward and state added
            child.init_delayed(history, shared if name in same else None)
            if name in same and shared is None:
                shared = child.fp8_input
            linears.append(child)
    return linears

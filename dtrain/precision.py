"""What each precision means, written once. Strategies translate it into their own mechanism
(autocast for single/DDP, MixedPrecisionPolicy for FSDP, a DeepSpeed config section).

A strategy applies a precision in three places, all driven by the fields below:

  1. `apply_precision(module, precision)` before wrapping: casts parameters (bf16-true) or swaps
     the transformer blocks' linear layers for int8 / fp8 ones. The swaps keep every weight an
     `nn.Parameter` with its name, so DDP, `fully_shard` and checkpoints see the same model.
  2. `precision.autocast(device)` around forward passes (single/DDP; FSDP uses
     `param_dtype`/`reduce_dtype` in its MixedPrecisionPolicy instead).
  3. `build_loss_scaler(precision, device, sharded=...)` for fp16 (None otherwise).

docs/precision.md renders PRECISIONS for people (tests/test_precision.py checks they agree).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch
from torch import nn

from dtrain.config import AUTO, PrecisionConfig, check_choices
from dtrain.errors import ConfigError
from dtrain.lowp.int8 import INT8_KEYS, Int8Options


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype  # stored (master) parameters
    compute_dtype: torch.dtype  # matmuls and activations outside quantized layers
    reduce_dtype: torch.dtype  # gradient all-reduce / reduce-scatter
    optim_dtype: torch.dtype  # optimizer states (AdamW's two moments)
    loss_scaling: bool = False  # dynamic loss scaling (fp16)
    tf32: bool = False
    # Which matmuls run in a narrower format than compute_dtype: "" (none), "int8" (dtrain's
    # int8 linears), "int8-torchao" (torchao's module swap, the reference), "fp8" (torchao).
    quantize: str = ""
    # precision.reduce_dtype was set (a strategy that reduces nothing refuses it).
    reduce_override: bool = False
    quantized: str = "nothing"  # for people: what exactly is quantized
    optimizer_8bit: bool = False  # torchao AdamW8bit: moments in int8 with block-wise scales
    fp8_recipe: str = "tensorwise"
    fp8_emulate: bool = False
    fp8_all_gather: bool | None = None  # precision.fp8_all_gather as set (None: the default)
    fp8_lm_head: bool = False  # the LM head in fp8 too
    fp8_fast_accum: str = "grad_input"  # which GEMMs accumulate fast: forward, grad_input, all
    fp8_scaling: str = "dynamic"  # inputs' and gradients' scales: dynamic or delayed
    fp8_amax_history: int = 16  # delayed: the steps of amax a scale is taken from
    # precision=int8 only: grad_weight matmul in "int8", "int8_grouped" (scales per 128 tokens)
    # or "bf16" (SwitchBack, from the saved int8 input); "" for every other precision.
    int8_grad_weight: str = ""
    fp8_first_step: str = "eager"  # delayed scaling's first step under compile: eager, compiled
    int8: Int8Options = Int8Options()  # precision=int8's kernel choices
    summary: str = ""

    @property
    def fp8_weight_gather(self) -> bool:
        """Under FSDP2 the block linears' weights are all-gathered in fp8: tensorwise scales
        only (one scale for a weight's shards), unless precision.fp8_all_gather=false."""
        tensorwise = self.quantize == "fp8" and self.fp8_recipe == "tensorwise"
        return tensorwise and self.fp8_all_gather is not False

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the stored parameters (autocast territory)."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device: torch.device):
        """The autocast context for forward passes (a no-op when compute is the param dtype)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def apply_backend_flags(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32


_F32, _BF16, _F16, _I8 = torch.float32, torch.bfloat16, torch.float16, torch.int8
DTYPE_NAMES = {_F32: "fp32", _BF16: "bf16", _F16: "fp16", _I8: "int8"}  # as configs spell them
_BLOCK_LINEARS = "the transformer blocks' linear layers (q, k, v, o, w1, w2, w3)"
# precision=int8's grad_weight matmul unless precision.int8_grad_weight says: bf16 (SwitchBack)
# from the saved int8 input, faster than int8 there at the same memory (docs/precision.md).
INT8_GRAD_WEIGHT_DEFAULT = "bf16"

PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        "fp32", _F32, _F32, _F32, _F32, summary="everything in fp32 (TF32 matmuls if tf32=true)"
    ),
    "bf16": Precision(
        "bf16",
        _F32,
        _BF16,
        _F32,
        _F32,
        summary="bf16 compute, fp32 master weights, fp32 gradient reduction and optimizer states",
    ),
    "bf16-true": Precision(
        "bf16-true",
        _BF16,
        _BF16,
        _BF16,
        _BF16,
        summary="pure bf16: parameters, gradients and optimizer states in bf16 (half the "
        "model-state memory of bf16; updates smaller than bf16's resolution are lost)",
    ),
    "fp16": Precision(
        "fp16",
        _F32,
        _F16,
        _F32,
        _F32,
        loss_scaling=True,
        summary="fp16 compute with dynamic loss scaling; steps whose gradients overflow are "
        "skipped and counted (train/overflow_steps)",
    ),
    "int8": Precision(
        "int8",
        _F32,
        _BF16,
        _F32,
        _F32,
        quantize="int8",
        quantized=f"{_BLOCK_LINEARS}: forward and grad-input matmuls in int8 (torch._int_mm) "
        "with dynamic row-wise scales, grad-weight in bf16 from the int8 input saved for "
        "backward (`int8_grad_weight=int8`: grad-weight in int8 too; `int8_grouped`: in int8 "
        "with the output gradients scaled per 128 tokens)",
        int8_grad_weight=INT8_GRAD_WEIGHT_DEFAULT,
        summary="int8 tensor-core matmuls for the blocks' linears, bf16 elsewhere (embeddings, "
        "norms, attention, LM head), fp32 master weights",
    ),
    "int8-torchao": Precision(
        "int8-torchao",
        _F32,
        _BF16,
        _F32,
        _F32,
        quantize="int8-torchao",
        quantized=f"{_BLOCK_LINEARS}: torchao Int8MixedPrecisionTrainingConfig(module_swap="
        "True); inputs saved in bf16",
        summary="torchao's int8 mixed-precision training (reference for benchmarks)",
    ),
    "fp8": Precision(
        "fp8",
        _F32,
        _BF16,
        _F32,
        _F32,
        quantize="fp8",
        quantized=f"{_BLOCK_LINEARS}: torchao float8 training; inputs' and gradients' scales "
        "from the last steps' amax where parameters are whole (fp8_scaling=auto: delayed on "
        "single and ddp), from each tensor's own under sharding (dynamic); weights' always "
        "their own; e4m3 inputs and weights, gradients e5m2 (tensorwise) or e4m3 (rowwise)",
        summary="fp8 matmuls through torchao.float8 (H100/H200), bf16 elsewhere",
    ),
}


def _need_torchao(what: str) -> None:
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{what} needs torchao, which is not installed: pip install torchao")


def build_precision(
    cfg: PrecisionConfig,
    device: torch.device,
    *,
    check_device: bool = True,
    shards_params: bool = False,
) -> Precision:
    """The Precision for `cfg` on `device`; refuses what this device cannot run.

    `check_device=False` (the planner, which plans for a GPU it does not run on) checks the
    values only: not this machine's hardware or installed extras. `shards_params`: the
    strategy holds a shard of each parameter (Strategy.shards_params), which decides
    precision.fp8_scaling=auto (resolve_fp8_scaling)."""
    if cfg.name not in PRECISIONS:
        raise ConfigError(
            f"unknown precision '{cfg.name}'; valid choices: {', '.join(sorted(PRECISIONS))}"
        )
    check_choices(cfg, "precision.")  # also where a PrecisionConfig is built in code
    p = PRECISIONS[cfg.name]
    if check_device:
        _check_device(cfg, p, device)
    _check_int8_grad_weight(cfg)
    _check_own_keys(cfg, p)
    asked = cfg.fp8_scaling
    cfg = replace(cfg, fp8_scaling=resolve_fp8_scaling(cfg, p.quantize == "fp8", shards_params))
    if cfg.fp8_scaling == "delayed" and cfg.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"precision.fp8_scaling=delayed applies to precision.fp8_recipe=tensorwise only "
            f"(one scale a tensor), not {cfg.fp8_recipe}; remove one of them"
        )
    if cfg.fp8_amax_history != PrecisionConfig.fp8_amax_history and cfg.fp8_scaling != "delayed":
        raise ConfigError(
            "precision.fp8_amax_history applies to precision.fp8_scaling=delayed only "
            f"(fp8_scaling={asked} takes each scale from its own tensor"
            + (" where parameters are sharded or scales rowwise" if asked == AUTO else "")
            + "); remove it or set precision.fp8_scaling=delayed"
        )
    reduce_dtype = _reduce_dtype(cfg, p)
    return replace(
        p,
        tf32=cfg.tf32,
        optimizer_8bit=cfg.optimizer_8bit,
        optim_dtype=_I8 if cfg.optimizer_8bit else p.optim_dtype,
        fp8_recipe=cfg.fp8_recipe,
        fp8_emulate=cfg.fp8_emulate,
        fp8_all_gather=cfg.fp8_all_gather,
        fp8_lm_head=cfg.fp8_lm_head,
        fp8_fast_accum=cfg.fp8_fast_accum,
        fp8_scaling=cfg.fp8_scaling,
        fp8_amax_history=cfg.fp8_amax_history,
        int8_grad_weight=cfg.int8_grad_weight or p.int8_grad_weight,
        fp8_first_step=cfg.fp8_first_step,
        int8=Int8Options(**{k: getattr(cfg, f"int8_{k}") for k in INT8_KEYS}),
        reduce_dtype=reduce_dtype or p.reduce_dtype,
        reduce_override=reduce_dtype is not None,
    )


def _check_device(cfg: PrecisionConfig, p: Precision, device: torch.device) -> None:
    """Refuse what this machine cannot run: bf16 without Ampere, fp16 on CPU, fp8 without fp8
    tensor cores (unless emulated), a missing torchao, a Gluon GEMM without Gluon."""
    if p.compute_dtype == torch.bfloat16 and device.type == "cuda":
        if not torch.cuda.is_bf16_supported():
            raise ConfigError(f"precision={cfg.name} needs a GPU with bf16 (Ampere or newer)")
    if p.loss_scaling and device.type != "cuda":
        raise ConfigError(
            f"precision={cfg.name} needs a CUDA GPU (fp16 autocast and loss scaling are for "
            "GPUs); on CPU use precision=bf16 or fp32"
        )
    if p.quantize == "fp8":
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < (8, 9) and not cfg.fp8_emulate:
                raise ConfigError(
                    f"precision=fp8 needs a GPU with fp8 tensor cores (compute capability 8.9+, "
                    f"e.g. H100/L40S); this one is {cap[0]}.{cap[1]}"
                )
        elif not cfg.fp8_emulate:
            raise ConfigError(
                "precision=fp8 on CPU runs only emulated: set precision.fp8_emulate=true "
                "(for tests; it is slow), or train fp8 on an H100/H200"
            )
    if p.quantize in ("fp8", "int8-torchao"):
        _need_torchao(f"precision={p.name}")
    if cfg.optimizer_8bit:
        _need_torchao("precision.optimizer_8bit=true")
    check_kernels(cfg)


# Keys that apply to one precision only (set to anything but their default elsewhere: an error).
_FP8_KEYS = (
    "fp8_all_gather",
    "fp8_lm_head",
    "fp8_fast_accum",
    "fp8_scaling",
    "fp8_amax_history",
    "fp8_first_step",
)
_OWN_KEYS = {"fp8": _FP8_KEYS, "int8": tuple(f"int8_{k}" for k in INT8_KEYS)}


def _check_own_keys(cfg: PrecisionConfig, p: Precision) -> None:
    """fp8's and int8's keys set only with their precision."""
    for precision, keys in _OWN_KEYS.items():
        for key in keys:  # set: not its default
            if getattr(cfg, key) != getattr(PrecisionConfig, key) and p.quantize != precision:
                raise ConfigError(
                    f"precision.{key} applies to precision={precision} only, not "
                    f"precision={cfg.name}; remove it or use precision={precision}"
                )
    if cfg.fp8_all_gather is not None and cfg.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"precision.fp8_all_gather applies to precision.fp8_recipe=tensorwise only "
            f"(with {cfg.fp8_recipe} scales weights are gathered in bf16); remove it"
        )


def check_kernels(cfg: PrecisionConfig) -> None:
    """precision=int8's Gluon GEMMs need Triton's Gluon for Hopper: checked at launch, before
    the run dir is written, with the other choices named."""
    if cfg.name != "int8":
        return
    for key, others in (("int8_grouped_gemm", "auto or triton"), ("int8_gemm", "tma or pointer")):
        if getattr(cfg, key) == "gluon":
            from dtrain.lowp.int8 import has_gluon_hopper, triton_version

            if not has_gluon_hopper():
                raise ConfigError(
                    f"precision.{key}=gluon needs Triton's Gluon for Hopper (Triton 3.6 or "
                    f"later); {triton_version()}: choose {others}"
                )


def resolve_fp8_scaling(cfg: PrecisionConfig, fp8: bool, shards_params: bool) -> str:
    """precision.fp8_scaling as set, or for auto: delayed where `fp8` trains with whole
    parameters (single, ddp) and tensorwise scales, else dynamic (what every precision but fp8
    reads as none).

    Whole, delayed was the faster in every benchmark invocation that ran both: at 1b on one
    H200, 1.242x bf16's tokens/s against dynamic's 1.188x side by side, 1.240-1.246x in three
    more, with the loss at 350m -1.8% and +0.5% against bf16's (two seeds). It is Transformer
    Engine's recipe. Under fsdp at 8b it ran 0.986x dynamic's on 2x H200, so sharded
    parameters keep dynamic scales (PRECS='bf16 fp8d fp8dyn' bash bench/lowp.sh single1b, and
    fsdp8b; raw outputs of 2026-11-30 in git history)."""
    if cfg.fp8_scaling != AUTO:
        return cfg.fp8_scaling
    return "delayed" if fp8 and not shards_params and cfg.fp8_recipe == "tensorwise" else "dynamic"


def fp8_scaling_note(cfg: PrecisionConfig, precision: Precision, shards_params: bool) -> str | None:
    """One start-up line saying what precision.fp8_scaling=auto became (resolve_fp8_scaling),
    or None where it was set or the precision is not fp8."""
    if precision.quantize != "fp8" or cfg.fp8_scaling != AUTO:
        return None
    where = "sharded" if shards_params else f"whole, {precision.fp8_recipe} scales"
    return (
        f"precision.fp8_scaling=auto: {precision.fp8_scaling} (parameters {where}; "
        'docs/precision.md, "Delayed scaling")'
    )


def _reduce_dtype(cfg: PrecisionConfig, p: Precision) -> torch.dtype | None:
    """precision.reduce_dtype: fp32, or the 16-bit dtype this precision computes in (reducing
    gradients in it halves the bytes on the wire; Lightning's "bf16-mixed" FSDP does so)."""
    if cfg.reduce_dtype is None:
        return None
    choices = {"fp32": _F32}
    if p.compute_dtype != _F32:
        choices[DTYPE_NAMES[p.compute_dtype]] = p.compute_dtype
    if cfg.reduce_dtype not in choices:
        raise ConfigError(
            f"precision.reduce_dtype={cfg.reduce_dtype!r} is not valid with "
            f"precision={p.name}; choose {' or '.join(choices)}"
        )
    return choices[cfg.reduce_dtype]


def _check_int8_grad_weight(cfg: PrecisionConfig) -> None:
    """precision.int8_grad_weight: one of int8's modes, and set only with precision=int8."""
    from dtrain.lowp.int8 import GRAD_WEIGHT_MODES

    value = cfg.int8_grad_weight
    if value is None:
        return
    if value not in GRAD_WEIGHT_MODES:
        raise ConfigError(
            f"precision.int8_grad_weight={value!r} is not valid; choose "
            + ", ".join(GRAD_WEIGHT_MODES[:-1])
            + f" or {GRAD_WEIGHT_MODES[-1]}"
        )
    if PRECISIONS[cfg.name].quantize != "int8":
        raise ConfigError(
            f"precision.int8_grad_weight applies to precision=int8 only, not "
            f"precision={cfg.name}; remove it or use precision=int8"
        )


def check_strategy(precision: Precision, strategy, name: str) -> None:
    """Refuse a precision that `strategy` (a Strategy class, by the facts it declares) cannot
    honour under strategy=`name`, with the reason."""
    if precision.reduce_override and not strategy.needs_distributed:
        raise ConfigError(
            f"precision.reduce_dtype sets how gradients are reduced across ranks; strategy={name} "
            "reduces none: remove it, or use strategy=ddp, fsdp, hsdp or zero1-3"
        )
    if precision.fp8_all_gather is not None and strategy.memory.partition != "dim0":
        raise ConfigError(
            f"precision.fp8_all_gather sets how FSDP gathers weights; strategy={name} gathers "
            "none: remove it, or use strategy=fsdp or hsdp"
        )
    if precision.fp8_lm_head and strategy.shards_params(name):
        raise ConfigError(
            f"precision.fp8_lm_head=true is not supported with strategy={name}, which shards "
            "parameters (the fp8 head, tied to the embedding, is built for whole weights): use "
            "strategy=single or ddp, or remove it"
        )
    if precision.optimizer_8bit and strategy.own_optimizer:
        raise ConfigError(
            f"precision.optimizer_8bit=true is not supported with strategy={name}: it builds "
            "its own optimizer; use strategy=single, ddp or fsdp"
        )


def block_linear_filter(module: nn.Module, fqn: str) -> bool:
    """The linears that quantized precisions swap: those inside the transformer blocks
    (`layers.<i>.`). Embeddings, norms, attention scores and the LM head stay bf16."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def block_and_head_filter(module: nn.Module, fqn: str) -> bool:
    """The block linears and the LM head (`output`): precision.fp8_lm_head=true."""
    return block_linear_filter(module, fqn) or (isinstance(module, nn.Linear) and fqn == "output")


def apply_precision(module: nn.Module, precision: Precision, *, sharded: bool = False) -> None:
    """Change `module` in place for `precision`, before any wrapping (DDP, fully_shard, compile).

    `sharded` says FSDP2 will shard the module: fp8 then all-gathers weights in fp8 (unless
    precision.fp8_all_gather=false).
    """
    if precision.param_dtype != torch.float32:
        # Parameters only: buffers such as the RoPE tables stay fp32.
        for p in module.parameters():
            p.data = p.data.to(precision.param_dtype)
    if precision.quantize == "int8":
        from dtrain.lowp.int8 import apply_int8

        apply_int8(
            module,
            block_linear_filter,
            grad_weight=precision.int8_grad_weight or INT8_GRAD_WEIGHT_DEFAULT,
            options=precision.int8,
        )
    elif precision.quantize == "int8-torchao":
        from dtrain.lowp.torchao_ref import apply_torchao_int8

        apply_torchao_int8(module, block_linear_filter)
    elif precision.quantize == "fp8":
        from dtrain.lowp.fp8 import apply_fp8, fp8_shape_ok

        head = getattr(module, "output", None)
        if precision.fp8_lm_head and isinstance(head, nn.Linear) and not fp8_shape_ok(head):
            raise ConfigError(
                f"precision.fp8_lm_head=true needs the vocabulary and d_model divisible by 16 "
                f"(fp8 GEMMs); this head is {head.in_features} x {head.out_features}: pad "
                "model.vocab_size to a multiple of 16 (e.g. 64), or remove it"
            )
        apply_fp8(
            module,
            block_and_head_filter if precision.fp8_lm_head else block_linear_filter,
            recipe=precision.fp8_recipe,
            fast_accum=precision.fp8_fast_accum,
            scaling=precision.fp8_scaling,
            amax_history=precision.fp8_amax_history,
            emulate=precision.fp8_emulate,
            fp8_all_gather=sharded and precision.fp8_weight_gather,
        )


class RankState(Protocol):
    """State a precision keeps per rank (each rank's from its own data), saved in the rank's
    own file of a checkpoint: fp8 delayed scaling's amax histories (lowp/fp8/delayed). Where
    the number of ranks changed, load_state_dict is given another rank's."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict | None) -> str | None:
        """None when restored, else why not (the state then stays as after_load left it)."""


class StepMode(Protocol):
    """Which steps of a compiled model a precision wants run eagerly: fp8 delayed scaling's
    dynamic first step (lowp/fp8/delayed; the strategy runs it, strategies/eager_step)."""

    def runs_eager(self) -> bool:
        """Whether the next step (or eval) should run eagerly."""


class PrecisionHooks(NamedTuple):
    after_step: Callable[[], None] | None
    after_load: Callable[[], None] | None
    rank_state: RankState | None
    step_mode: StepMode | None


def precision_hooks(
    precision: Precision,
    module: nn.Module,
    device: torch.device,
    *,
    sharded: bool,
    compiled: bool = False,
) -> PrecisionHooks:
    """What must run after each optimizer step for `precision`, and after each checkpoint
    load: (after_step, after_load), each None where nothing must; `rank_state`, the
    precision's state that is each rank's own and goes into its file of a checkpoint, or None;
    and `step_mode`, how the model's forward and backward run where it compiles, or None.
    Build it once the model's tensors are real (after fsdp's to_empty and init).

    - fp8 with FSDP2's fp8 all-gather needs each weight's scale to be the same on every shard.
      Left to itself torchao computes it in the next forward with one all-reduce per linear (7
      per block, each a sync point on the communication stream); torchao's precompute does all
      of them in one all-reduce right after the step, as torchtitan does, and again after a
      load (the scales follow the weights just loaded). `compiled`: the shards' fp8 cast that
      follows it runs as one compiled call (lowp/fp8/linear.cast_shards).
    - precision.fp8_scaling=delayed pushes the step's amaxes into their histories after each
      step (compiled where the model is) and starts again from dynamic scales after a load
      (lowp/fp8/delayed), unless the rank's saved histories are then loaded (rank_state). A
      step that scales dynamically runs eagerly where the model compiles with whole
      parameters (step_mode)."""
    steps: list[Callable[[], None]] = []
    loads: list[Callable[[], None]] = []
    delayed = None
    if precision.quantize == "fp8" and precision.fp8_scaling == "delayed":
        from dtrain.lowp.fp8.delayed import DelayedScaling

        # The dynamic first step eagerly where the model compiles and its blocks are whole
        # (strategies/eager_step recomputes them in backward, which FSDP's hooks would miss),
        # unless precision.fp8_first_step=compiled.
        eager_first = compiled and not sharded and precision.fp8_first_step == "eager"
        delayed = DelayedScaling.of(module, device, compiled=compiled, eager_first=eager_first)
        steps.append(delayed.step)
        loads.append(delayed.reset)
    if sharded and precision.fp8_weight_gather:
        from dtrain.lowp.fp8 import precompute_fp8_scales

        def precompute() -> None:
            precompute_fp8_scales(module, compiled=compiled)

        steps.append(precompute)
        loads.append(precompute)
    mode = delayed if delayed is not None and delayed.eager_first else None
    return PrecisionHooks(_run_all(steps), _run_all(loads), delayed, mode)


def _run_all(hooks: list[Callable[[], None]]) -> Callable[[], None] | None:
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]

    def run() -> None:
        for hook in hooks:
            hook()

    return run


def build_loss_scaler(precision: Precision, device: torch.device, *, sharded: bool = False):
    """A LossScaler for fp16 (ShardedGradScaler when FSDP shards the gradients); else None.

    DeepSpeed does not call this: its engine has its own dynamic loss scaler (fp16 config).
    """
    if not precision.loss_scaling:
        return None
    from dtrain.lowp.scaling import LossScaler

    return LossScaler(device, sharded=sharded)


def build_precision_optimizer(module: nn.Module, cfg, precision: Precision, device: torch.device):
    """The optimizer for `precision`: torchao's AdamW8bit (stepped in compiled groups:
    dtrain/lowp/optim8bit/adamw.py) when optimizer_8bit, else AdamW."""
    from dtrain.optim import build_optimizer

    if not precision.optimizer_8bit:
        return build_optimizer(module, cfg, device)
    from dtrain.lowp.optim8bit import build_adamw8bit

    return build_adamw8bit(module, cfg)


# --- docs/precision.md's table -------------------------------------------------------------


def render_table() -> str:
    """PRECISIONS as the markdown table in docs/precision.md (a test keeps them equal)."""

    def compute(p: Precision) -> str:
        base = DTYPE_NAMES[p.compute_dtype]
        if p.tf32:
            base += " (TF32 matmuls)"
        return {"int8": "int8 matmuls in blocks, ", "fp8": "fp8 matmuls in blocks, "}.get(
            p.quantize.split("-")[0], ""
        ) + (base if not p.quantize else f"{base} elsewhere")

    rows = [
        "| precision | stored params | compute | gradient reduction | optimizer states "
        "| loss scaling | quantized |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in PRECISIONS.values():
        rows.append(
            f"| `{p.name}` | {DTYPE_NAMES[p.param_dtype]} | {compute(p)} "
            f"| {DTYPE_NAMES[p.reduce_dtype]} | {DTYPE_NAMES[p.optim_dtype]} "
            f"| {'dynamic' if p.loss_scaling else 'none'} "
            f"| {p.quantized} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m dtrain.precision: print the table for the docs
    print(render_table(), end="")

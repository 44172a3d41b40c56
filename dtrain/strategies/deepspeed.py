"""strategy=zero1|zero2|zero3 (= strategy=deepspeed strategy.stage=N): a DeepSpeed ZeRO engine.

ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the parameters
(Rajbhandari et al. 2019). The DeepSpeed JSON config is generated from ours: micro-batch,
accumulation, clipping, precision, bucket sizes and offload. Our schedule owns the learning rate
(written into the optimizer's groups before each step; DeepSpeed gets no scheduler).

Checkpoints are written in the common format every strategy uses (full fp32 weights and AdamW
moments keyed by parameter name, saved with DCP), gathered through DeepSpeed's tensor-fragment
API and scattered back on load. So a ZeRO checkpoint resumes bit-exactly under the same stage and
loads as it is into single, DDP, FSDP or another ZeRO stage, and back.

deepspeed is imported lazily: `import dtrain` never needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import warnings

import torch
from torch import nn

from dtrain.config import ModelConfig, OptimConfig, StrategyConfig
from dtrain.dist import DistEnv
from dtrain.errors import ConfigError
from dtrain.model import build_model
from dtrain.optim import build_optimizer, param_groups
from dtrain.precision import DTYPE_NAMES, Precision
from dtrain.strategies.base import (
    Collective,
    MemoryFacts,
    SpeedFacts,
    StateBytes,
    Strategy,
    compile_blocks,
    tensor_bytes,
)

log = logging.getLogger("dtrain")


@contextlib.contextmanager
def quiet_unless(speak: bool):
    """DeepSpeed's start-up lines (its logger, its prints, torch's warnings on its calls) once
    for the job, from rank 0, not once a rank."""
    if speak:
        yield
        return
    ds_log = logging.getLogger("DeepSpeed")
    level = ds_log.level
    ds_log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        ds_log.setLevel(level)


# What each stage splits (Rajbhandari et al. 2019); every stage steps fp32 master partitions.
_ZERO = dict(autocast=False, fp32_master=True)
ZERO_MEMORY = {
    "zero1": MemoryFacts(shards=frozenset({"optim"}), partition="groups", **_ZERO),
    "zero2": MemoryFacts(shards=frozenset({"optim", "grads"}), partition="groups", **_ZERO),
    "zero3": MemoryFacts(
        shards=frozenset({"optim", "grads", "params"}),
        partition="flat",
        persistent_grads=True,
        **_ZERO,
    ),
}


# What each stage communicates per step (DeepSpeed 0.19.8's stage_1_and_2.py / stage3.py).
_ZERO_GATHER_UPDATED = Collective(
    "all_gather",
    "params",
    "compute",
    calls="buckets",
    why="the updated 16-bit partitions are gathered after the step, before the next forward",
)
_ZERO_REDUCE = dict(op="reduce_scatter", tensor="grads", dtype="reduce", calls="buckets")
# ZeRO-3 without DeepCompile: each module's parameters are fetched and released by Python hooks,
# one collective at a time. 1b, 2x H200, bf16, micro-batch 8 x 2048, tokens/s per GPU (each
# run's summary figure): eager 36,968 (2026-11-26), 33,158 and 30,344 (2026-11-27, two runs,
# bench/launch_times.py's median of steps 13-20; fsdp beside the second: 56,424);
# under plain torch.compile, whose graphs break at every hook, 25,959 (2026-11-27). The shares of
# the compiled matmul rate that plan them: eager 33.6k (−9%..+11% of the three), compiled 26.0k.
# docs/benchmarks.md, "Throughput against a hand-written loop and other frameworks"
# (`throughput/zero3_1b_2gpu.json`); the 2026-11-27 runs' raw outputs are in git history
# (bench/results/README.md).
EAGER_ZERO3 = 0.51
HOOKED_COMPILED_ZERO3 = 0.39
ZERO_SPEED = {
    "zero1": SpeedFacts(
        (
            Collective(
                **_ZERO_REDUCE,
                overlap=0.5,
                why="with overlap_comm gradients move into "
                "buckets as the backward produces them; the last buckets wait",
            ),
            _ZERO_GATHER_UPDATED,
        ),
        graph="blocks",
    ),
    "zero2": SpeedFacts(
        (
            Collective(
                **_ZERO_REDUCE,
                overlap=0.5,
                why="buckets reduced during the backward (overlap_comm); the last buckets wait",
            ),
            _ZERO_GATHER_UPDATED,
        ),
        graph="blocks",
    ),
    "zero3": SpeedFacts(
        (
            Collective(
                "all_gather",
                "params",
                "compute",
                times=2,
                per_micro=True,
                calls="blocks",
                overlap=0.9,
                window="step",
                why="DeepCompile prefetches each block's parameters under compute",
            ),
            Collective(**_ZERO_REDUCE, overlap=0.9, why="reduced during the backward"),
        ),
        graph="blocks",
        eager_factor=EAGER_ZERO3,  # without DeepCompile (above)
    ),
}


def zero_stage(cfg: StrategyConfig) -> int:
    """The ZeRO stage from strategy=zeroN or strategy=deepspeed strategy.stage=N."""
    if cfg.name.startswith("zero"):
        implied = int(cfg.name[4:])
        if cfg.stage is not None and cfg.stage != implied:
            raise ConfigError(
                f"strategy={cfg.name} is ZeRO stage {implied} but strategy.stage={cfg.stage}; "
                f"use strategy=zero{cfg.stage} or strategy=deepspeed strategy.stage={cfg.stage}"
            )
        return implied
    if cfg.stage is None:
        raise ConfigError("strategy=deepspeed needs strategy.stage=1, 2 or 3 (or strategy=zeroN)")
    return cfg.stage


def bucket_elements(cfg: StrategyConfig) -> int:
    """DeepSpeed's reduce and all-gather bucket size: strategy.bucket_cap_mb, counted in
    elements of 4 bytes (DeepSpeed counts elements, not bytes)."""
    return cfg.bucket_cap_mb * 2**20 // 4


# strategy.deepcompile_schedule -> DeepSpeed's `engine.compile(schedule=...)` for ZeRO-3.
# DeepSpeed's own (None) gathers and releases at step 0, then at optimizer step 5 resets Dynamo
# and compiles everything again with prefetch and selective gather: two whole-model compiles,
# each profiled op by op (deepspeed/compile/init_z3.py, backend.py). The others compile once:
# "once" every pass at step 0; "resident" without prefetch (and its all-gather benchmark),
# keeping the parameters that fit gathered; "gather" the gather/release pass alone.
DEEPCOMPILE_SCHEDULES: dict[str, list | None] = {
    "deepspeed": None,
    "once": [(0, ["zero3_compile", "prefetch", "selective_gather"])],
    "resident": [(0, ["zero3_compile", "selective_gather"])],
    "gather": [(0, ["zero3_compile"])],
}


def uses_deepcompile(cfg: StrategyConfig, device_type: str) -> bool:
    """strategy.deepcompile, or its default: on for ZeRO-3 on CUDA, only where it was measured
    (not with ZeRO-Offload: DeepCompile has offload passes of its own that dtrain does not
    drive)."""
    if cfg.deepcompile is not None:
        return cfg.deepcompile
    offload = cfg.offload_params or cfg.offload_optimizer
    return (
        device_type == "cuda" and zero_stage(cfg) == 3 and cfg.compile is not False and not offload
    )


def _tensors_in(obj):
    """Every tensor inside nested lists/tuples/dicts (ZeRO keeps its buffers in such)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    names = ("deepspeed", *ZERO_MEMORY)  # zero1/2/3: deepspeed with the stage set
    needs_distributed = True
    # What this translation covers (bf16: DeepSpeed's bf16 section, fp32 masters). fp16 would
    # need DeepSpeed's own loss scaler wired to our overflow metrics; the quantized linears
    # cannot live in DeepSpeed's flat bf16 buffers (ZeRO-3 gathers them in its own hooks).
    precisions = ("fp32", "bf16")
    own_optimizer = True
    options = (
        "stage",
        "offload_optimizer",
        "offload_params",
        "deepcompile",
        "deepcompile_schedule",
    )

    def __init__(self, cfg: StrategyConfig, precision: Precision, env: DistEnv):
        self.stage = zero_stage(cfg)
        self.name = f"zero{self.stage}"  # what the manifest and the logs call it
        super().__init__(cfg, precision, env)
        self.engine = None

    @classmethod
    def memory_facts(cls, name: str) -> MemoryFacts | None:
        return ZERO_MEMORY.get(name)  # strategy=deepspeed is planned as the zeroN of its stage

    @classmethod
    def speed_facts(cls, name: str, setup) -> SpeedFacts:
        facts = ZERO_SPEED.get(name, cls.speed)  # planned by stage (zeroN), as memory_facts
        if name == "zero3" and setup.compile and setup.deepcompile is False:
            # torch.compile over the engine's hooks: not DeepCompile's graph (above)
            return dataclasses.replace(facts, compiled_factor=HOOKED_COMPILED_ZERO3)
        return facts

    @classmethod
    def memory_options(cls, cfg: StrategyConfig, device_type: str) -> dict:
        return {
            **super().memory_options(cfg, device_type),
            "strategy": f"zero{zero_stage(cfg)}",
            "deepcompile": uses_deepcompile(cfg, device_type),
            "ds_bucket_elements": bucket_elements(cfg),
        }

    @classmethod
    def check_config(cls, cfg: StrategyConfig, precision: Precision, device_type: str) -> None:
        super().check_config(cfg, precision, device_type)
        stage = zero_stage(cfg)
        if cfg.deepcompile and stage == 2:  # explicit true only (None: automatic)
            raise ConfigError(
                "strategy.deepcompile has passes for ZeRO stages 1 and 3 only; use "
                "strategy=zero1 or strategy=zero3, or strategy.deepcompile=false"
            )
        if cfg.deepcompile and cfg.compile is False:
            raise ConfigError(
                "strategy.deepcompile=true compiles the model; it cannot go with "
                "strategy.compile=false"
            )
        offload = cfg.offload_params or cfg.offload_optimizer
        if cfg.deepcompile_schedule != "deepspeed" and (
            stage != 3 or offload or not uses_deepcompile(cfg, device_type)
        ):
            # With offload DeepSpeed builds its own schedule with offload passes; a fixed one
            # would drop them.
            raise ConfigError(
                f"strategy.deepcompile_schedule={cfg.deepcompile_schedule} chooses DeepCompile's "
                "ZeRO-3 passes, but this run does not use them as scheduled (it needs "
                "strategy=zero3 on CUDA, strategy.deepcompile not false, no offload); remove it"
            )
        if cfg.deepcompile and device_type != "cuda":
            raise ConfigError(
                "strategy.deepcompile needs CUDA (DeepSpeed's compiler passes are CUDA-only); "
                "drop it on this machine"
            )
        grads = precision.compute_dtype if precision.mixed else precision.param_dtype
        wanted = precision.reduce_dtype
        if precision.reduce_override and wanted != grads and uses_deepcompile(cfg, device_type):
            # DeepSpeed 0.19.8's DeepCompile reduce-scatters gradients in their own dtype
            # (csrc/compile/z3.cpp flushReduceBucket) and reads no communication_data_type.
            raise ConfigError(
                f"precision.reduce_dtype={DTYPE_NAMES[wanted]} cannot be honoured with "
                "DeepSpeed's DeepCompile (on by default for zero3 on CUDA), which reduces "
                f"gradients in their own dtype ({DTYPE_NAMES[grads]}); remove it, or set "
                "strategy.deepcompile=false"
            )
        if cfg.offload_params and stage != 3:
            raise ConfigError(
                f"strategy.offload_params needs ZeRO stage 3 (strategy=zero3); stage {stage} "
                "keeps full parameters on every rank"
            )

    @classmethod
    def check_installed(cls, cfg: StrategyConfig) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"strategy={cfg.name} needs DeepSpeed: pip install 'dtrain[deepspeed]'"
            )

    @property
    def deepcompile(self) -> bool:
        """DeepSpeed's DeepCompile: its compiler passes replace ZeRO-3's parameter-fetch hooks
        (on by default for ZeRO-3 on CUDA, where it measured faster: docs/strategies.md)."""
        return uses_deepcompile(self.cfg, self.device.type)

    def first_step_work(self) -> str | None:
        if self.deepcompile:
            return (
                "DeepCompile is tracing the model, profiling it and running its ZeRO passes "
                "(strategy.deepcompile=false starts at once, eager)"
            )
        return super().first_step_work()

    def slow_steps(self, first_step: int) -> dict[int, str]:
        steps = super().slow_steps(first_step)
        if self.deepcompile and self.stage == 3 and self.cfg.deepcompile_schedule == "deepspeed":
            # DeepSpeed's schedule compiles again once the engine has taken WARMUP optimizer
            # steps (counted from this process's start: dtrain loads checkpoints itself).
            from deepspeed.compile.init_z3 import WARMUP

            steps[first_step + WARMUP] = (
                "DeepCompile is compiling the model again, with its prefetch and selective-gather "
                "passes (DeepSpeed's schedule; strategy.deepcompile_schedule=once compiles at "
                "the first step only)"
            )
        return steps

    @classmethod
    def compiles(cls, cfg: StrategyConfig, device_type: str) -> bool:
        # DeepSpeed's stage-3 parameter-fetch hooks break compiled graphs: eager unless asked
        # (or DeepCompile, which replaces the hooks by compiler passes, is on).
        if uses_deepcompile(cfg, device_type):
            return True
        if cfg.compile is None:
            return device_type == "cuda" and zero_stage(cfg) < 3
        return cfg.compile

    # --- building ----------------------------------------------------------------------
    def ds_config(self, model_cfg: ModelConfig) -> dict:
        """DeepSpeed's JSON config, generated from ours."""
        on_cuda = self.device.type == "cuda"
        bucket = bucket_elements(self.cfg)
        zero: dict = {
            "stage": self.stage,
            "overlap_comm": on_cuda,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        }
        if self.stage == 3:
            # Vectors (norm gains, <= d_model elements) stay whole on every rank: gathering
            # them costs a collective each for no memory worth saving. Matrices are sharded.
            zero["stage3_param_persistence_threshold"] = model_cfg.d_model
        if self.cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
        if self.cfg.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
        p = self.precision
        config = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum_steps,
            "train_batch_size": self.micro_batch_size * self.grad_accum_steps * self.env.world_size,
            "gradient_clipping": self.grad_clip,  # 0 disables it in DeepSpeed too
            "zero_optimization": zero,
            # Our AdamW is not on DeepSpeed's tested list; it is the one single/DDP/FSDP run.
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.deepcompile:
            config["compile"] = {"deepcompile": True}
        if p.mixed:
            # bf16 parameters for compute, fp32 master weights and moments in the optimizer.
            config[DTYPE_NAMES[p.compute_dtype]] = {"enabled": True}
            config["communication_data_type"] = DTYPE_NAMES[p.reduce_dtype]
        return config

    def build_ds_optimizer(self, module: nn.Module, cfg: OptimConfig):
        """DeepSpeed's fused Adam on CUDA (CPU Adam when offloading) when its op builds;
        otherwise torch's AdamW, the same optimizer single/DDP/FSDP use."""
        if self.device.type == "cuda":
            try:
                kw = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
                groups = param_groups(module, cfg.weight_decay)
                if self.cfg.offload_optimizer:
                    from deepspeed.ops.adam import DeepSpeedCPUAdam

                    return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
                from deepspeed.ops.adam import FusedAdam

                return FusedAdam(groups, adam_w_mode=True, **kw)
            except Exception as e:  # the op needs nvcc/a C++ toolchain; torch's works anyway
                log.warning("DeepSpeed's Adam op did not build (%s); using torch.optim.AdamW", e)
        return build_optimizer(module, cfg, self.device)

    def setup(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, seed: int) -> None:
        # The first run on a machine is silent for ~90 s while DeepSpeed JIT-builds an op.
        log.info("DeepSpeed: loading its ops (the first run on a machine builds them: minutes)")
        with quiet_unless(self.env.rank == 0):
            import deepspeed
        if self.env.rank != 0:  # its collectives' deprecation warnings come from rank 0 alone
            warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

        module = build_model(model_cfg, self.device, seed)
        # Parameter names in the common checkpoint format; tied weights have two names.
        self._names: dict[nn.Parameter, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._names.setdefault(p, []).append(name)
        # The hyperparameters of torch's AdamW: what single/DDP/FSDP checkpoints carry.
        reference = build_optimizer(module, optim_cfg, self.device)
        self._groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [self._names[p][0] for p in g["params"]],
            }
            for g in reference.param_groups
        ]
        del reference
        if self.deepcompile:
            pass  # engine.compile() below compiles the whole model with DeepSpeed's passes
        elif self.compile_enabled and self.stage < 3:
            compile_blocks(module)  # in place: names unchanged
        elif self.device.type == "cuda" and self.cfg.compile is not False:
            compile_blocks(module, blocks=False)  # ZeRO-3 eager: the loss alone has no params
        rope = module.rope_cache
        optimizer = self.build_ds_optimizer(module, optim_cfg)
        with quiet_unless(self.env.rank == 0):
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=module,
                optimizer=optimizer,
                config=self.ds_config(model_cfg),
                dist_init_required=False,
            )
        # DeepSpeed's bf16 casts every buffer; RoPE angles in bf16 lose positions. Keep fp32.
        module.rope_cache = rope
        self._compile_engine()
        self.module, self.model = module, self.engine
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._grad_bytes = 0
        if self.stage == 1:
            self._watch_reduction()

    def _compile_engine(self) -> None:
        """DeepCompile (its ZeRO-3 passes on the chosen schedule), or the engine compiled plainly
        where that was asked for; nothing for an eager engine."""
        if self.deepcompile and self.stage == 3:
            self.engine.compile(schedule=DEEPCOMPILE_SCHEDULES[self.cfg.deepcompile_schedule])
        elif self.deepcompile or (self.compile_enabled and self.stage == 3):
            self.engine.compile()

    def _watch_reduction(self) -> None:
        """ZeRO-1: count gradient bytes as each backward hands over to the engine's reduction
        (first optimizer step only), since ZeRO-1 reduces only at the accumulation boundary and
        may hold the full gradients until then (docs/memory.md, "What ZeRO-1 holds"). ZeRO-2/3
        reduce during the backward: their gradients are counted after it."""
        original = self.engine.allreduce_gradients

        def measured(*args, **kwargs):
            self._grad_bytes = max(self._grad_bytes, self._measure_grads())
            return original(*args, **kwargs)

        self.engine.allreduce_gradients = measured  # an instance attribute: del restores

    # --- training ----------------------------------------------------------------------
    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, *, last_micro: bool, loss_div: int
    ) -> torch.Tensor:
        assert loss_div == self.grad_accum_steps, "DeepSpeed was built for another accumulation"
        loss = self.engine(x, y)
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
        if last_micro:
            if self._state_bytes is None:  # gradients exist until the step consumes them
                self._grad_bytes = max(self._grad_bytes, self._measure_grads())
        else:
            # Off the accumulation boundary step() only counts the micro-step (no update);
            # the engine needs the count to know where the boundary is.
            self.engine.step()
        return loss.detach()

    def clip_and_step(self, lr: float, grad_clip: float) -> torch.Tensor:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()  # reduces, clips to gradient_clipping, steps, zeroes gradients
        if self._state_bytes is None:
            self._state_bytes = self.measure_state_bytes()
            vars(self.engine).pop("allreduce_gradients", None)  # back to the engine's own
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y).detach()

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.engine(x).detach()

    # --- accounting --------------------------------------------------------------------
    def _zero_param_tensors(self) -> list[torch.Tensor]:
        # Stage 3 keeps this rank's partition in ds_tensor (p.data is empty between uses).
        return [getattr(p, "ds_tensor", p) for p in self.module.parameters()]

    def _measure_grads(self) -> int:
        """Gradient storage now: p.grad and the partitioned buffers ZeRO reduces into (views
        of one buffer count once), not the reduce buckets: those are communication workspace
        (planned as transient), though under ZeRO-1 some p.grad stay views into them."""
        opt = self.engine.optimizer
        buckets = {
            t.untyped_storage().data_ptr()
            for bucket in getattr(opt, "ipg_buckets", {}).values()
            for t in _tensors_in(getattr(bucket, "buffer", None))
        }
        tensors = [p.grad for p in self.module.parameters()]
        for name in ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"):
            tensors += list(_tensors_in(getattr(opt, name, None)))
        return tensor_bytes(
            t for t in tensors if t is not None and t.untyped_storage().data_ptr() not in buckets
        )

    def measure_state_bytes(self) -> StateBytes:
        opt = self.engine.optimizer
        params = self._zero_param_tensors()
        param_storages = {t.untyped_storage().data_ptr() for t in params if t.numel()}
        masters = [
            t
            for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
            for t in getattr(opt, name, [])
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in param_storages
        ]
        inner = opt.optimizer
        moments = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        return StateBytes(
            params_bytes=tensor_bytes(params),
            grads_bytes=self._grad_bytes,
            optim_bytes=tensor_bytes(moments),
            master_bytes=tensor_bytes(masters),
        )

    # --- checkpoints: the common format ------------------------------------------------
    @torch.no_grad()
    def _ensure_optimizer_states(self) -> None:
        """ZeRO creates AdamW's moments at the first step; a checkpoint may be loaded before
        it. One step with zero gradients at lr 0 creates them and leaves the weights exactly
        as they are (the moments and step count are then overwritten by the load)."""
        opt = self.engine.optimizer
        inner = opt.optimizer
        if self.stage == 3:
            self._ensure_zero3_optimizer_states(opt)
            return
        flat = [p for g in inner.param_groups for p in g["params"]]
        if not all(p in inner.state for p in flat):
            self._create_optimizer_states(inner)
        # Point every parameter's fragment at its slice of the moments. DeepSpeed (0.19) links
        # them once, right after stepping the first parameter group, when the later groups'
        # moments do not exist yet; ours has two (decayed matrices, undecayed gains).
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        for i, hp in enumerate(opt.single_partition_of_fp32_groups):
            lazy_init_hp_params_optimizer_state(opt.bit16_groups[i], hp, inner.state)

    def _ensure_zero3_optimizer_states(self, opt) -> None:
        """ZeRO-3 keeps its inner optimizer's param groups empty and binds each sub-group's
        fp32 partition only while stepping it (DeepSpeed 0.19's `_optimizer_step`), so the
        moments of a run that has not stepped yet are created with the partitions bound the
        same way, then unbound."""
        inner = opt.optimizer
        flats = opt.fp32_partitioned_groups_flat
        if all("exp_avg" in inner.state.get(f, {}) for f in flats):
            return
        bound = {gid: list(g["params"]) for gid, g in enumerate(inner.param_groups)}
        for g in inner.param_groups:
            g["params"] = []
        for sub, flat in enumerate(flats):
            inner.param_groups[opt.sub_group_to_group_id[sub]]["params"].append(flat)
        try:
            self._create_optimizer_states(inner)
        finally:
            for gid, g in enumerate(inner.param_groups):
                g["params"] = bound[gid]

    @staticmethod
    def _create_optimizer_states(inner: torch.optim.Optimizer) -> None:
        saved = [(p.grad, g["lr"]) for g in inner.param_groups for p in g["params"]]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        it = iter(saved)
        for g in inner.param_groups:
            for p in g["params"]:
                p.grad, g["lr"] = next(it)

    def _adam_step(self) -> float:
        inner = self.engine.optimizer.optimizer
        for st in inner.state.values():
            if "step" in st:
                return float(st["step"])
        return float(inner.param_groups[0].get("step", 0))  # DeepSpeed's FusedAdam

    def state_dict(self) -> dict:
        """Full fp32 weights and AdamW moments keyed by name (collective: every rank calls)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._ensure_optimizer_states()
        step = torch.tensor(self._adam_step(), dtype=torch.float32)
        model, state = {}, {}
        for p in self._params:
            names = self._names[p]
            full = safe_get_full_fp32_param(p).detach().cpu()
            for name in names:
                model[name] = full
            state[names[0]] = {
                "step": step.clone(),
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().cpu(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().cpu(),
            }
        groups = [dict(g, params=list(g["params"])) for g in self._groups]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        self._ensure_optimizer_states()
        dev = self.device
        for p in self._params:
            name = self._names[p][0]
            safe_set_full_fp32_param(p, state["model"][name].to(dev))
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state["optim"]["state"][name][key].to(dev), key)
        step = float(next(iter(state["optim"]["state"].values()))["step"])
        inner = self.engine.optimizer.optimizer
        for st in inner.state.values():
            if "step" in st:
                st["step"] = (
                    torch.full_like(st["step"], step) if torch.is_tensor(st["step"]) else int(step)
                )
        for g in inner.param_groups:
            if "step" in g:
                g["step"] = int(step)
        # The fp32 masters are set; copy them into the (bf16 or fp32) working parameters.
        opt = self.engine.optimizer
        if self.stage < 3:
            opt.update_lp_params()
        else:  # the routine ZeRO-3's own step ends with (copy, or swap out when offloaded)
            for i in range(len(opt.fp16_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)

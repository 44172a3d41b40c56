"""Predicted time of one optimizer step per GPU, and tokens/s and MFU from it.

    step = compute + recompute + exposed communication + optimizer + other

- compute: the model's FLOPs per token (dtrain.model.flops_per_token) x tokens
  per GPU per step, at the matmul peak of the compute dtype x MATMUL_EFFICIENCY; quantized
  linears (Precision.quantize) run their share at the narrow dtype's peak and pay casts
  (memory-bound passes over their operands);
- recompute: activation checkpointing re-runs each block's forward (full: its matmuls, a third
  of the block's FLOPs; selective: only the memory-bound ops between them);
- communication: each collective the strategy declares (Strategy.speed_facts), priced by the
  ring formulas (all-reduce 2(n-1)/n x bytes / bus bandwidth, all-gather and reduce-scatter
  (n-1)/n) plus a latency per ring step, on NVLink within a node or the network between nodes;
  the declared overlap share hides under compute (what exceeds its window is exposed too);
- optimizer: memory-bound, bytes of params, grads, states (and master) read and written /
  (HBM bandwidth x HBM_EFFICIENCY); on the host when offloaded;
- other: a small constant per step and per micro-step (data, launches, the loss read).

The constants are calibrated on measured runs (docs/planner.md lists them and the error on
every measured point).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from dtrain.hardware import fp8_gemm_dims_ok, matmul_kind
from dtrain.memory.machine import Machine
from dtrain.memory.setup import MemorySetup, strategy_facts
from dtrain.memory.state import state_bytes_per_element
from dtrain.model import (
    ModelConfig,
    count_param_tensors,
    count_params,
    embedding_params,
    flops_per_token,
)
from dtrain.strategies import STRATEGIES, Collective

# Share of the datasheet peak the model's matmuls run at, compiled as one graph: fitted to
# model=1b on one H200 (bf16, micro-batch 8 x 2048: 59.3-59.6k tokens/s, 55.5% MFU;
# raw outputs of 2026-11-26); its trace put the matmuls at 0.59.
MATMUL_EFFICIENCY = 0.66
# Attention (cuDNN, causal) by the 12·L·d·T convention: 729 TFLOP/s on an H100 (seq 2048,
# docs/benchmarks.md's kernel table), 722 on an H200 in the 8b trace (seq 8192): 0.74 of peak.
ATTENTION_EFFICIENCY = 0.74
# Memory passes per token and layer over (d_model + ffn_hidden) elements of the compute dtype
# by the ops between the matmuls (norms, RoPE, SwiGLU, residuals, casts), and over the fp32
# logits by the loss: Inductor's fused kernels took 45 ms of the 1b step and 52 ms of the 8b
# step in the traces above, which these reproduce within ~20%.
POINTWISE_PASSES = 8
LOSS_PASSES = 4
# A graph cut into blocks (FSDP, DeepSpeed) or at DDP's buckets fuses less across the cuts:
# blocks compiled one by one ran at 0.95x the whole-model graph (1b, 1x H100: 54.7k per-block
# in docs/benchmarks.md's precision table vs 57.6k whole; real text vs synthetic aside).
SPLIT_GRAPH_FACTOR = 0.95
# Eager (not compiled): DeepSpeed ZeRO-2's eager loop ran at 0.78x dtrain's compiled zero2 (1b,
# 2x H200, docs/benchmarks.md). A strategy whose eager loop does more declares its own
# (SpeedFacts.eager_factor: ZeRO-3's hooks).
EAGER_FACTOR = 0.75
# Share of HBM bandwidth a memory-bound step reaches: fused AdamW took 49 ms for 4.0B params
# per rank (28 bytes each) on an H200 (8b fsdp trace, docs/benchmarks.md "Low precision at
# scale"): 2.3 of 4.8 TB/s.
HBM_EFFICIENCY = 0.475
OTHER_S_PER_STEP = 2e-3  # the loss and norm reads, LR and scheduler, host-side bookkeeping
OTHER_S_PER_MICRO = 0.5e-3  # a micro-batch to the GPU, launches outside compiled graphs
# Offloaded optimizers step on the CPU (DeepSpeed's CPU Adam, torch's AdamW for FSDP's
# offload): bytes of state per second of one rank's share of a host, and PCIe per direction.
HOST_OPTIM_BYTES_PER_S = 20e9
PCIE_BYTES_PER_S = 25e9
# precision.optimizer_8bit steps AdamW with 8-bit moments (GroupedAdamW8bit, dtrain/lowp/
# optim8bit.py): on CUDA a Triton kernel per fp32 tensor whose moments are 8-bit, compiled
# groups for the rest. Two measured costs, on H200s:
# - Its kernel moves the fewer bytes of 8-bit moments at 1/2.3 the rate the bytes model gives
#   fused AdamW (each element also looks its two codes up in a 256-entry table, and computes
#   each new code from its value). Fitted to model=8b under fsdp on 2 GPUs: with fp8 and int8
#   it ran at 1.244x and 1.046x the bf16 run measured beside it; the factor that gives the plan
#   those ratios is 2.3 (1.244x, 1.045x; raw outputs of 2026-11-30). Alone at 8b's
#   shapes (2.16B parameters, bench/optim8bit.py, the same day) it took 21.0 ms of GPU time against
#   fused AdamW's 17.2 ms (32.7 ms before the codes were computed, raw outputs of 2026-11-29).
# - Its host: 16.8 ms a step for 1b's 218 tensors, 10.4 ms for the 75 tensors of 8b's shapes
#   cut to 8 blocks (raw outputs of 2026-11-29, the kernel before the codes were computed; a
#   Triton launch a tensor), a floor that binds where the bytes are few (model=tiny); 0.123 ms
#   a tensor, as the compiled groups before it held the host (raw outputs of 2026-11-29).
# torchao's own AdamW8bit (a call per tensor) held the host 0.77 ms a tensor under FSDP2
# (raw outputs of 2026-11-29), the cost the grouping removed.
EIGHT_BIT_STEP_SLOWDOWN = 2.3
HOST_S_PER_8BIT_TENSOR = 0.123e-3


@dataclass(frozen=True)
class QuantSpeed:
    """How a Precision.quantize kind runs the blocks' linears."""

    kind: str  # the matmul peak column (Machine.peak_flops)
    efficiency: float  # its achieved share of that peak, relative to MATMUL_EFFICIENCY
    cast_passes: float  # memory passes over each quantized operand (amax, scale, cast)
    share: float = 1.0  # of the three matmuls (forward, grad-input, grad-weight)


QUANT_SPEED = {
    # torchao float8 tensorwise: all three matmuls in fp8; fitted to 1b on one H200 (1.21x bf16)
    "fp8": QuantSpeed("fp8", efficiency=0.93, cast_passes=3.0),
    # dtrain's int8 on Hopper's Triton GEMMs: the persistent TMA kernel ran model=1b's forward
    # and grad-input GEMMs (weighted by how often a block runs each) 1.588x bf16 torch.mm, so
    # 0.79 of the bf16 share of the int8 peak (twice bf16's); 8b's 1.722x, 0.86
    # (raw outputs of 2026-12-01; the pointer kernel before it: 1b
    # 0.74, which this was). Grad-weight in bf16 (SwitchBack) unless int8_grad_weight says
    # int8 (GROUPED_GRAD_WEIGHT_VS_BF16 for int8_grouped). Cast passes 1.5, not 3.0: the
    # quantizes multiply by a reciprocal (copy speed, most of them fused into their
    # producers); fitted to 1b on one H200, 1.100x bf16 (planned 1.100), and
    # not fitted, 8b's blocks on one, 1.128x (planned 1.111; 3.0 planned 1.017x and 1.077x):
    # raw outputs of 2026-12-03.
    "int8": QuantSpeed("int8", efficiency=0.79, cast_passes=1.5, share=2 / 3),
    # torchao's module swap (the reference): 0.34x bf16 under fsdp (docs/benchmarks.md).
    "int8-torchao": QuantSpeed("int8", efficiency=0.2, cast_passes=6.0),
}

# precision.int8_grad_weight=int8_grouped: its grad-weight GEMM on Hopper is the warp-specialized
# Gluon kernel (dtrain/lowp/int8/grouped_gluon.py), 1.47x cuBLAS's bf16 on model=1b's
# grad-weights weighted by how often a block runs each (four of q,o's shape, two of w1,w3's, one
# of w2's; 1x H200, raw outputs of 2026-12-03: its default tile with
# each group's scale-and-add one fused multiply-add): planned at the bf16 rate times that. Its
# operands, dy and the saved input, are quantized along the tokens in groups, which the
# default's bf16 grad-weight reads as they are: GROUPED_CAST_PASSES more passes over each
# block's features. Fitted on 1b on one H200 to the grouped run over the default int8 run of one
# benchmark invocation, 66,957 over 65,763 tokens/s (1.018): planned 1.023. Earlier kernels, each
# against the default measured beside it, are planned within 1% too (tests/test_planner.py): the
# Gluon kernel's 128-wide tile (1.20x bf16; 0.987, raw outputs of 2026-12-02) and the
# Triton kernel (0.946x; 0.943, raw outputs of 2026-12-02). Not fitted, 8b's widths (16 of
# its blocks, seq 8192, one H200): 22,161 over 21,231 (1.044), planned 1.056
# (raw outputs of 2026-12-04).
GROUPED_GRAD_WEIGHT_VS_BF16 = 1.47
GROUPED_CAST_PASSES = 1.0

# precision.fp8_fast_accum: each fp8 GEMM that accumulates fast (no periodic promotion to fp32)
# runs this much faster than a promoted one. QUANT_SPEED's fp8 efficiency was fitted with
# torchao's recipe, the forward GEMM fast and the two backward ones promoted, so that mix keeps
# it (`fast_accum_factor`). Fitted to one side-by-side A/B: 8b's blocks cut to 16 on one
# H200, grad_input over forward 23,281 / 22,919 tokens/s, 1.0158 (planned 1.0157;
# raw outputs of 2026-12-04). Not fitted: "all" over "forward" with the LM head
# in fp8 at 1b, 73,839 / 71,608, 1.031 (planned 1.044; raw outputs of 2026-11-29), and 1b at
# fp8's defaults, 75,986 and 76,191 (planned 76,777; raw outputs of 2026-12-04; 75,227 unpriced).
FAST_ACCUM_SPEEDUP = 1.145
FAST_GEMMS = {"forward": 1, "grad_input": 2, "all": 3}  # of forward, grad-input, grad-weight


def fast_accum_factor(mode: str) -> float:
    """The fp8 GEMMs' time under fp8_fast_accum=`mode` over their time under torchao's recipe
    ("forward": the one QUANT_SPEED's efficiency was fitted with)."""

    def time(fast: int) -> float:  # of the three GEMMs, `fast` at the fast rate
        return fast / FAST_ACCUM_SPEEDUP + (3 - fast)

    return time(FAST_GEMMS[mode]) / time(FAST_GEMMS["forward"])


# precision.fp8_scaling=delayed: the amax pass over each cast operand is fused into the kernel
# that makes it (dtrain/lowp/fp8/delayed.py). One pass of three: 1b on one H200 is planned at
# 75.2k tokens/s (dynamic 70.8k), measured 74.2k and 75.0k in two runs (dynamic 70.9k beside the
# first; raw outputs of 2026-11-30).
DELAYED_SAVED_PASSES = 1.0


@dataclass
class SpeedPlan:
    """Seconds per optimizer step on one GPU, by part, and what follows from them."""

    compute_s: float
    recompute_s: float
    comm_s: float  # all collectives, hidden or not
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    tokens_per_step: int  # per GPU
    mfu: float | None
    collectives: list[dict] = field(default_factory=list)
    machine: str = "datasheet"
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return (
            self.compute_s
            + self.recompute_s
            + self.exposed_comm_s
            + self.optimizer_s
            + self.other_s
        )

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["step_s"] = self.step_s
        d["tokens_per_s_per_gpu"] = self.tokens_per_s_per_gpu
        return d


def linear_params_per_block(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters of one block's linears, their in + out features summed): what quantized
    precisions swap, and what their casts read per token."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_hidden
    shapes = [
        (cfg.n_head * hd, d),
        (cfg.n_kv_head * hd, d),
        (cfg.n_kv_head * hd, d),
        (d, cfg.n_head * hd),
        (f, d),
        (f, d),
        (d, f),
    ]
    return sum(o * i for o, i in shapes), sum(o + i for o, i in shapes)


def _compute_rate(setup: MemorySetup, machine: Machine, kind: str) -> float:
    """The peak of one matmul kind, less what the graph's cuts and eager mode cost."""
    rate = machine.peak_flops[kind]
    facts = STRATEGIES[setup.strategy].speed_facts(setup.strategy, setup)
    graph = setup.compile_scope or facts.graph
    if not setup.compile:
        return rate * (EAGER_FACTOR if facts.eager_factor is None else facts.eager_factor)
    if facts.compiled_factor is not None:
        return rate * facts.compiled_factor
    if graph == "blocks" or (setup.facts.graph_split_buckets and setup.world_size > 1):
        return rate * SPLIT_GRAPH_FACTOR
    return rate


def compute_times(cfg: ModelConfig, setup: MemorySetup, machine: Machine):
    """(seconds of the model's work per step, of the blocks' share of it, of the blocks'
    memory-bound ops): one GPU. Matmuls at
    MATMUL_EFFICIENCY, attention at ATTENTION_EFFICIENCY (FLOPs by the 12·L·d·T convention),
    and the memory-bound ops between them (norms, activations, the loss) at HBM speed."""
    pr = setup.precision
    # Each rank of a tp x cp group does 1/(tp x cp) of its replica's work; the loss too, unless
    # the logits are gathered whole on every tp rank (parallel.loss_parallel=false).
    tokens = setup.micro_batch_size * setup.seq_len * setup.grad_accum_steps / (setup.tp * setup.cp)
    kind = matmul_kind(pr)
    rate = _compute_rate(setup, machine, kind) * MATMUL_EFFICIENCY
    attn_kind = "bf16" if kind == "bf16" else "fp32"  # fp32 SDPA: no tensor-core kernel
    attn_rate = _compute_rate(setup, machine, attn_kind) * ATTENTION_EFFICIENCY
    hbm = machine.hbm_bytes_per_s * HBM_EFFICIENCY
    lin_params, lin_features = linear_params_per_block(cfg)
    lin = 6 * cfg.n_layer * lin_params * tokens
    attn = 12 * cfg.n_layer * cfg.d_model * setup.seq_len * tokens
    # the embedding's gradient priced as a matmul, as when the constants were fitted
    head = (flops_per_token(cfg, setup.seq_len) + 6 * embedding_params(cfg)) * tokens - lin - attn
    c = pr.compute_dtype.itemsize
    pointwise = POINTWISE_PASSES * cfg.n_layer * (cfg.d_model + cfg.ffn_hidden) * c * tokens
    gathered = 1 if setup.loss_parallel else setup.tp
    loss = LOSS_PASSES * cfg.vocab_size * 4 * tokens * gathered  # fp32 log-softmax and its grad
    q = QUANT_SPEED.get(pr.quantize)
    t_head = head / rate
    if q is None or not machine.peak_flops.get(q.kind):
        t_lin = lin / rate
    else:
        grad_weight = getattr(pr, "int8_grad_weight", "")
        share = 1.0 if grad_weight == "int8" else q.share  # of the matmuls at the narrow rate
        wide = rate * (GROUPED_GRAD_WEIGHT_VS_BF16 if grad_weight == "int8_grouped" else 1.0)
        narrow = _compute_rate(setup, machine, q.kind) * MATMUL_EFFICIENCY * q.efficiency
        if q.kind == "fp8":
            narrow /= fast_accum_factor(getattr(pr, "fp8_fast_accum", "forward"))
        passes = q.cast_passes - DELAYED_SAVED_PASSES * (
            getattr(pr, "fp8_scaling", "dynamic") == "delayed"
        )
        block_passes = passes + GROUPED_CAST_PASSES * (grad_weight == "int8_grouped")
        t_cast = block_passes * cfg.n_layer * lin_features * c * tokens / hbm
        t_lin = lin * ((1 - share) / wide + share / narrow) + t_cast
        fp8_head = fp8_gemm_dims_ok(cfg.d_model, cfg.vocab_size)
        if getattr(pr, "fp8_lm_head", False) and fp8_head:  # its matmuls and casts as a block's
            head_cast = passes * (cfg.d_model + cfg.vocab_size) * c * tokens / hbm
            t_head = head / narrow + head_cast
    blocks = t_lin + attn / attn_rate + pointwise / hbm
    return blocks + t_head + loss / hbm, blocks, pointwise / hbm


def recompute_time(setup: MemorySetup, blocks_s: float, pointwise_s: float) -> float:
    """Activation checkpointing re-runs each block's forward in its backward: full, all of it
    (a third of the blocks' work); selective, only the memory-bound ops between the saved
    matmul and attention outputs (a third of those)."""
    mode = setup.activation_checkpointing
    return {"none": 0.0, "full": blocks_s / 3, "selective": pointwise_s / 3}[mode]


def group_size(c: Collective, setup: MemorySetup) -> int:
    r = max(1, setup.replicate_degree) if setup.honours("replicate_degree") else 1
    shard = setup.world_size // (r * setup.tp)  # FSDP shards over dp x cp beside tp
    groups = {"world": setup.world_size, "shard": shard, "replicate": r}
    return {**groups, "tp": setup.tp, "cp": setup.cp}[c.group]


def crosses_nodes(c: Collective, setup: MemorySetup, machine: Machine, n: int) -> bool:
    """Shard and world groups are consecutive ranks; replica groups stride over them."""
    if c.group == "replicate":
        return setup.world_size > machine.gpus_per_node
    if c.group in ("cp", "shard"):  # strided by the tp ranks inside each replica
        return n * setup.tp > machine.gpus_per_node
    return n > machine.gpus_per_node


def collective_bytes(cfg: ModelConfig, c: Collective, setup: MemorySetup) -> float:
    """Bytes of the whole tensor a collective gathers or reduces, in the group it runs in."""
    pr = setup.precision
    elem = (pr.compute_dtype if c.dtype == "compute" else pr.reduce_dtype).itemsize
    if c.tensor in ("activations", "kv"):
        return activation_collective_bytes(cfg, c, setup, elem)
    n_params = count_params(cfg) / setup.tp  # this tp rank's share of every tensor
    blocks = cfg.n_layer
    if c.payload == "resharded":  # the freed blocks' linears (their norms are noise)
        blocks = max(0, cfg.n_layer - 1)
        total = blocks * linear_params_per_block(cfg)[0] * elem
    else:
        total = n_params * elem
    if c.narrow_weights and getattr(pr, "fp8_weight_gather", False):
        lin = blocks * linear_params_per_block(cfg)[0]
        total -= lin * (elem - 1)  # linear weights travel as fp8
    if c.payload == "shard":
        total /= max(1, group_size(replace(c, group="shard"), setup))
    return total


def activation_collective_bytes(cfg: ModelConfig, c: Collective, setup: MemorySetup, elem: int):
    """Tensor parallelism's gathered residual stream, (B, T/cp, d) per block and the root
    (activations); context parallelism's gathered keys and values of this rank's heads, two
    (B, T, kv heads/tp, hs) per block (kv)."""
    b, s = setup.micro_batch_size, setup.seq_len
    if c.tensor == "activations":
        return (cfg.n_layer + 1) * b * (s // setup.cp) * cfg.d_model * elem
    kv = -(-cfg.n_kv_head // setup.tp) * cfg.head_dim
    return cfg.n_layer * 2 * b * s * kv * elem


def collective_time(cfg: ModelConfig, c: Collective, setup: MemorySetup, machine: Machine):
    """(seconds per optimizer step, dict describing it), or None where the group is one rank."""
    n = group_size(c, setup)
    if n <= 1:
        return None
    nbytes = collective_bytes(cfg, c, setup)
    inter = crosses_nodes(c, setup, machine, n)
    bw, latency = machine.link(c.op, inter)
    ring = 2 * (n - 1) / n if c.op == "all_reduce" else (n - 1) / n
    steps = (2 if c.op == "all_reduce" else 1) * (n - 1)
    if c.calls == "blocks":
        calls = cfg.n_layer + 1
    elif c.calls == "resharded":
        calls = max(0, cfg.n_layer - 1)
    elif c.calls == "buckets":
        calls = max(1, math.ceil(nbytes / _bucket_bytes(setup)))
    else:
        calls = 1
    times = c.times * (setup.grad_accum_steps if c.per_micro else 1)
    seconds = times * (ring * nbytes / bw + calls * steps * latency)
    info = {
        "op": c.op,
        "tensor": c.tensor,
        "group": c.group,
        "ranks": n,
        "link": "network" if inter else "nvlink",
        "bytes": nbytes * times,
        "seconds": seconds,
        "overlap": c.overlap,
        "why": c.why,
    }
    return seconds, info


def _bucket_bytes(setup: MemorySetup) -> float:
    if setup.facts.partition in ("flat", "groups"):  # DeepSpeed counts 4-byte elements
        return setup.ds_bucket_elements * 4
    return setup.ddp_bucket_mb * 2**20


def comm_times(cfg, setup: MemorySetup, machine: Machine, compute_s: float):
    """(all communication, the exposed part, per-collective dicts). Each collective's declared
    overlap hides under its window (the backward: 2/3 of the compute; or the whole step); what
    the window cannot hold is exposed too."""
    facts = STRATEGIES[setup.strategy].speed_facts(setup.strategy, setup)
    windows = {"backward": 2 / 3 * compute_s, "step": compute_s}
    hidden = dict.fromkeys(windows, 0.0)
    total, exposed, rows = 0.0, 0.0, []
    for c in facts.collectives:
        priced = collective_time(cfg, c, setup, machine)
        if priced is None:
            continue
        seconds, info = priced
        total += seconds
        exposed += seconds * (1 - c.overlap)
        hidden[c.window] += seconds * c.overlap
        info["exposed_s"] = seconds * (1 - c.overlap)
        rows.append(info)
    for w, s in hidden.items():
        exposed += max(0.0, s - windows[w])
    return total, exposed, rows


def optimizer_time(cfg: ModelConfig, setup: MemorySetup, machine: Machine) -> float:
    """AdamW is memory-bound: every state element read and written once, gradients read twice
    (the norm for clipping, then the step)."""
    facts = setup.facts
    b = state_bytes_per_element(setup.precision, fp32_master=facts.fp32_master)
    n = count_params(cfg)
    stepped = n / setup.world_size if "optim" in facts.shards else n
    state = 2 * (b.param + b.optim + b.master) + 2 * b.grad
    offloaded = (setup.cpu_offload and setup.honours("cpu_offload")) or (
        setup.offload_optimizer and setup.honours("offload_optimizer")
    )
    if offloaded:  # gradients down, updated parameters up, the step on the host
        return stepped * (state / HOST_OPTIM_BYTES_PER_S + (b.grad + b.param) / PCIE_BYTES_PER_S)
    gpu = stepped * state / (machine.hbm_bytes_per_s * HBM_EFFICIENCY)
    if getattr(setup.precision, "optimizer_8bit", False):
        gpu *= EIGHT_BIT_STEP_SLOWDOWN
        return max(gpu, count_param_tensors(cfg) * HOST_S_PER_8BIT_TENSOR)
    return gpu


def plan_speed(cfg: ModelConfig, setup: MemorySetup, machine: Machine) -> SpeedPlan:
    """The predicted step of rank 0 for `setup` on `machine` (see the module docstring)."""
    strategy_facts(setup.strategy)  # a ConfigError naming the valid choices
    compute, blocks, pointwise = compute_times(cfg, setup, machine)
    recompute = recompute_time(setup, blocks, pointwise)
    comm, exposed, rows = comm_times(cfg, setup, machine, compute + recompute)
    tokens = setup.micro_batch_size * setup.seq_len * setup.grad_accum_steps
    tokens //= setup.tp * setup.cp  # this GPU's share of its replica's tokens
    plan = SpeedPlan(
        compute_s=compute,
        recompute_s=recompute,
        comm_s=comm,
        exposed_comm_s=exposed,
        optimizer_s=optimizer_time(cfg, setup, machine),
        other_s=OTHER_S_PER_STEP + OTHER_S_PER_MICRO * setup.grad_accum_steps,
        tokens_per_step=tokens,
        mfu=None,
        collectives=rows,
        machine=machine.source,
        notes=list(machine.notes),
    )
    peak = machine.mfu_peak.get(matmul_kind(setup.precision))
    if peak:
        plan.mfu = flops_per_token(cfg, setup.seq_len) * plan.tokens_per_s_per_gpu / peak
    if setup.precision.quantize and not machine.peak_flops.get(
        QUANT_SPEED.get(setup.precision.quantize, QuantSpeed("bf16", 1, 0)).kind
    ):
        plan.notes.append(
            f"{machine.name} has no {setup.precision.quantize} tensor cores: "
            "its linears planned at the 16-bit rate"
        )
    return plan

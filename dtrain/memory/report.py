"""The plan in words, in TensorBoard and metrics.jsonl, and against what a run measured."""

from __future__ import annotations

from dataclasses import replace

from dtrain.hardware import GiB
from dtrain.memory.plan import MemoryPlan, plan_memory
from dtrain.memory.setup import MemorySetup, setup_from_config
from dtrain.model import ModelConfig

# The key of a run's predicted throughput in metrics.jsonl (the step-0 record and each logged
# step) and in its summary, beside the measured `tokens_per_s_per_gpu`; compare reads it.
from dtrain.reporting.summary import PREDICTED_SPEED_KEY


def layout_words(setup) -> str:
    """ " (tp 2, cp 2)" beside the world size where the mesh has those dimensions, else ""."""
    dims = [f"{k} {getattr(setup, k)}" for k in ("tp", "cp") if getattr(setup, k) > 1]
    return f" ({', '.join(dims)})" if dims else ""


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def summary_lines(plan: MemoryPlan, setup: MemorySetup, cfg: ModelConfig) -> list[str]:
    """A few sentences, the headline first: where the memory goes, and the rule of thumb
    against this breakdown."""
    n = plan.n_params
    parts = {
        "parameters": plan.params_bytes,
        "gradients": plan.grads_bytes,
        "optimizer states": plan.optim_bytes,
        "activations": plan.activations_bytes,
        "transient buffers": plan.transient_bytes,
    }
    biggest = max(parts, key=parts.get)
    per_param = plan.model_state_bytes / n if n else 0.0
    full_state = 16 * n  # 4 (fp32 weight) + 4 (grad) + 8 (Adam moments): the 1B -> ~16 GB part
    thumb = 24 * n  # "24 GB per 1B parameters at fp32": ~4 bytes of weights + 20 extra
    where = "GPU" if setup.device == "cuda" else "process"
    lines = [
        f"{setup.strategy} x {setup.precision.name} on {setup.world_size} rank(s)"
        f"{layout_words(setup)}, "
        f"{cfg.name} ({n / 1e6:.1f}M params), micro-batch {setup.micro_batch_size} x "
        f"{setup.seq_len} tokens: predicted peak {fmt_bytes(plan.total_bytes)} per {where} "
        f"({plan.phase} is the peak moment).",
        f"The largest part is {biggest} ({fmt_bytes(parts[biggest])}); model state is "
        f"{fmt_bytes(plan.model_state_bytes)} = {per_param:.1f} bytes per parameter per "
        f"{where}, activations and buffers "
        f"{fmt_bytes(plan.activations_bytes + plan.transient_bytes)}.",
        f"Rule of thumb: ~20 extra bytes per parameter on top of the weights, 24 GB per 1B "
        f"parameters at fp32, gives {fmt_bytes(thumb)} for this model; unsharded fp32 AdamW "
        f"state is really 16 bytes per parameter ({fmt_bytes(full_state)}), and the rest of "
        f"the rule is an allowance for activations, which here are "
        f"{fmt_bytes(plan.activations_bytes + plan.transient_bytes)} and grow with "
        f"micro-batch x sequence, not with parameters.",
    ]
    if setup.world_size > 1 and setup.facts.shards:
        lines.append(
            f"Sharding over {setup.world_size} ranks cuts model state to {per_param:.1f} "
            f"bytes per parameter per {where} (16 unsharded)."
        )
    return lines + list(plan.notes)


def summary_text(plan: MemoryPlan, setup: MemorySetup, cfg: ModelConfig) -> str:
    """summary_lines as one paragraph (the TensorBoard text)."""
    return " ".join(summary_lines(plan, setup, cfg))


def run_prediction(cfg, precision, env) -> tuple[MemoryPlan, MemorySetup]:
    """The plan for rank 0 of this run (the rank that holds the most under FSDP padding)."""
    setup = setup_from_config(cfg, precision, env.world_size, device=env.device.type)
    return plan_memory(cfg.model, setup), setup


def predicted_record(plan: MemoryPlan) -> dict:
    """The `memory_predicted` object of metrics.jsonl."""
    keys = (
        "params_bytes",
        "grads_bytes",
        "optim_bytes",
        "activations_bytes",
        "transient_bytes",
        "overhead_bytes",
        "context_bytes",
        "peak_bytes",
        "host_bytes",
        "master_bytes",
    )
    out = {k: getattr(plan, k) for k in keys}
    out["total_bytes"] = plan.total_bytes
    out["model_state_bytes"] = plan.model_state_bytes
    out["phase"] = plan.phase
    out["at_peak"] = dict(plan.at_peak)
    return out


# What prediction_error_pct compared -> (TensorBoard tag, words for the console): a CPU
# model-state error is not a GPU peak error, so it never shares the peak's chart.
PREDICTION_COMPARES = {
    "peak_reserved": ("memory/prediction_error_pct", "peak reserved, CUDA"),
    "model_state": ("memory/prediction_error_pct_model_state", "model state only, CPU"),
}


def prediction_error_pct(plan: MemoryPlan, memory_per_rank: list[dict]) -> tuple[float, str]:
    """(error %, what was compared) against the worst rank.

    On CUDA: predicted peak reserved vs the largest measured `peak_reserved_bytes`. Elsewhere
    (CPU: RSS holds Python, the data and torch itself, nothing a GPU plan describes): predicted
    model-state bytes vs the largest measured params + grads + optimizer bytes.
    """
    if all("peak_reserved_bytes" in m for m in memory_per_rank):
        measured = max(m["peak_reserved_bytes"] for m in memory_per_rank)
        predicted, what = plan.peak_bytes, "peak_reserved"
    else:
        measured = max(
            sum(m.get(k, 0) for k in ("params_bytes", "grads_bytes", "optim_bytes", "master_bytes"))
            for m in memory_per_rank
        )
        predicted, what = plan.model_state_bytes, "model_state"
    if measured <= 0:
        return float("nan"), what
    return 100.0 * (predicted - measured) / measured, what


def markdown_breakdown(plan: MemoryPlan, text: str) -> str:
    """The TensorBoard text summary: a table of the prediction and the sentences."""
    rows = [
        ("parameters", plan.params_bytes),
        ("gradients", plan.grads_bytes),
        ("optimizer states", plan.optim_bytes),
        ("activations", plan.activations_bytes),
        ("transient buffers", plan.transient_bytes),
        ("overhead (allocator + CUDA context)", plan.overhead_bytes),
        (f"**peak per GPU** ({plan.phase})", plan.total_bytes),
    ]
    table = "| part | predicted |\n|---|---|\n" + "\n".join(
        f"| {k} | {fmt_bytes(v)} |" for k, v in rows
    )
    return table + "\n\n" + text


def run_speed_prediction(
    cfg, world_size: int, device, *, gpu=None, profile="auto", compile_enabled: bool | None = None
):
    """The speed plan of this run (a SpeedPlan; its `tokens_per_s_per_gpu` is what to log next
    to the measured figure), or None where there is nothing to price it on (CPU, or a GPU
    missing from dtrain.hardware's table without a profile). `gpu`: a GpuSpec (default: the
    CUDA device's own); `profile`: auto (the calibrated profile of this GPU if one was
    written), none, or a path."""
    import torch

    from dtrain.hardware import gpu_named
    from dtrain.memory.machine import build_machine, find_profile
    from dtrain.memory.setup import planned_config
    from dtrain.memory.speed import plan_speed

    device = torch.device(device)
    if gpu is None and device.type == "cuda":
        gpu = gpu_named(torch.cuda.get_device_name(device))
    if gpu is None:
        return None
    from dtrain.memory.search import resolve_auto_options

    cfg, _ = resolve_auto_options(cfg, world_size, "cuda", gpu=gpu)  # as the run would
    cfg, _, setup = planned_config(cfg, world_size, "cuda")
    if compile_enabled is not None:
        setup = replace(setup, compile=compile_enabled)
    return plan_speed(cfg.model, setup, build_machine(gpu, find_profile(gpu, profile)))


def predicted_speed_record(speed) -> dict:
    """What a run logs of its speed plan: the predicted tokens/s per GPU and the breakdown."""
    keys = ("compute_s", "recompute_s", "exposed_comm_s", "comm_s", "optimizer_s", "other_s")
    return {
        PREDICTED_SPEED_KEY: speed.tokens_per_s_per_gpu,
        "speed_predicted": {
            **{k: getattr(speed, k) for k in keys},
            "step_s": speed.step_s,
            "mfu": speed.mfu,
            "machine": speed.machine,
        },
    }

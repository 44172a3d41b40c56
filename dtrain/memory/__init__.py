"""Predicted memory per GPU, and the compute budget of a run.

    plan = plan_memory(model_cfg, MemorySetup(strategy="fsdp", precision=PRECISIONS["bf16"],
                                              world_size=8, micro_batch_size=4, seq_len=2048))
    plan.total_bytes, plan.at_peak

What a rank holds, one file per part: model state (state.py: params, grads, optimizer states,
master copy, exact to the byte, laid out as the strategy declares it holds them), activations
saved for backward (activations.py: counted tensor by tensor), transient buffers and the fixed
overhead at the peak (plan.py, which also searches the largest micro-batch that fits). setup.py
reads the planner's input from a TrainConfig, asking the strategy what its options mean;
budget.py counts FLOPs and GPU-hours; report.py puts the plan in words, TensorBoard and
metrics.jsonl. The speed of a step: speed.py (on machine.py's datasheet or calibrated figures);
search.py ranks configurations and resolves micro_batch_size=auto; advice.py turns an
out-of-memory error into changes that fit (docs/planner.md). How each part is counted, and
how it compares with GPUs: docs/memory.md.
"""

from __future__ import annotations

from dtrain.hardware import GPUS, GiB, GpuSpec, gpu_peak_flops
from dtrain.memory.activations import (
    autocast_weight_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    loss_transient_bytes,
    quantized_inputs,
    uses_autocast,
)
from dtrain.memory.budget import ComputeBudget, compute_budget
from dtrain.memory.plan import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    DDP_EXTRA_GRAD_BUFFERS,
    DDP_SMALL_BUCKET_MB,
    MemoryPlan,
    largest_micro_batch,
    plan_memory,
)
from dtrain.memory.report import (
    PREDICTED_SPEED_KEY,
    PREDICTION_COMPARES,
    fmt_bytes,
    markdown_breakdown,
    predicted_record,
    predicted_speed_record,
    prediction_error_pct,
    run_prediction,
    run_speed_prediction,
    summary_lines,
    summary_text,
)
from dtrain.memory.setup import (
    MemorySetup,
    check_setup,
    plan_precision,
    planned_config,
    resolve_vocab,
    setup_from_config,
)
from dtrain.memory.speed import SpeedPlan, plan_speed
from dtrain.memory.state import (
    ModelState,
    StateBytesPerElement,
    ZeroPartition,
    ds_overlap_comm,
    ds_reduce_bucket_bytes,
    model_state_bytes,
    param_shapes,
    state_bytes_per_element,
    zero1_grad_elements,
    zero1_holds_full_grads,
    zero_partition,
    zero_step_copy_bytes,
)

__all__ = [
    "ALLOCATOR_SLACK",
    "CUDA_CONTEXT_BYTES",
    "DDP_EXTRA_GRAD_BUFFERS",
    "DDP_SMALL_BUCKET_MB",
    "GPUS",
    "PREDICTED_SPEED_KEY",
    "PREDICTION_COMPARES",
    "ComputeBudget",
    "GiB",
    "GpuSpec",
    "MemoryPlan",
    "MemorySetup",
    "ModelState",
    "SpeedPlan",
    "StateBytesPerElement",
    "ZeroPartition",
    "autocast_weight_bytes",
    "check_setup",
    "compute_budget",
    "ds_overlap_comm",
    "ds_reduce_bucket_bytes",
    "fmt_bytes",
    "gpu_peak_flops",
    "head_activation_bytes",
    "largest_micro_batch",
    "layer_activation_bytes",
    "loss_transient_bytes",
    "markdown_breakdown",
    "model_state_bytes",
    "param_shapes",
    "plan_memory",
    "predicted_record",
    "predicted_speed_record",
    "prediction_error_pct",
    "quantized_inputs",
    "plan_precision",
    "plan_speed",
    "planned_config",
    "resolve_vocab",
    "run_prediction",
    "run_speed_prediction",
    "setup_from_config",
    "state_bytes_per_element",
    "summary_lines",
    "summary_text",
    "uses_autocast",
    "zero1_grad_elements",
    "zero1_holds_full_grads",
    "zero_partition",
    "zero_step_copy_bytes",
]

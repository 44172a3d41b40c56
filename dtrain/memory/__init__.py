"""Predicted memory per GPU, and the compute budget of a run: the planner, one file per concern.

    plan = plan_memory(model_cfg, MemorySetup(strategy="fsdp", precision=PRECISIONS["bf16"],
                                              world_size=8, micro_batch_size=4, seq_len=2048))
    plan.total_bytes, plan.at_peak

What a rank holds, in five parts:

* **Model state** (params, grads, optimizer states, a separate master copy): exact. Every
  parameter tensor of the model is listed from its config and laid out the way each strategy
  stores it: whole (single, DDP), one padded shard per tensor (FSDP2, ZeRO-3), or flat
  partitions (ZeRO-1/2). Bytes
  come from the Precision's dtypes, never from its name. AdamW keeps exp_avg and exp_avg_sq per
  parameter plus a 0-d fp32 `step` tensor per parameter tensor. This reproduces, to the byte, the
  `params_bytes`/`grads_bytes`/`optim_bytes`/`master_bytes` that strategies measure (tests
  check it).
  In Ψ units this is the ZeRO paper's table (Rajbhandari et al. 2019): DDP (2+2+K)Ψ, ZeRO-1
  (2+2)Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3/FSDP (2+2+K)Ψ/N, with our byte counts.
* **Activations** saved for backward: Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models") count sbh(34 + 5as/h) bytes per layer for GPT at 16 bits. We
  count our own blocks tensor by tensor instead (see `layer_activation_bytes`): fused SDPA keeps
  no s x s scores (the 5as/h term goes; a log-sum-exp of b·a·s fp32 stays), SwiGLU keeps three
  f-wide tensors plus its product, RMSNorm keeps its fp32 input, and the residual stream stays in
  the parameter dtype under autocast. Quantized linears (precision=int8, fp8) change what is
  kept for the matmuls' backward: int8 inputs and per-token scales eagerly; compiled, only the
  scales (the quantized operands are recomputed).
* **Transient** buffers at the peak: the logits and the fp32 loss at the start of backward,
  FSDP's all-gathered block (plus the prefetched next one) and its unsharded gradients, DeepSpeed's
  communication buckets, the recomputed block under activation checkpointing.
* **Fixed overhead**: the CUDA context (outside what PyTorch reserves) and the caching allocator's
  slack (reserved minus allocated).

Gradients do not always live at the same time as activations: with set_to_none, gradients are
created during backward while activations are freed. `peak_bytes` takes the larger of the two
phases (start of backward, optimizer step); `at_peak` shows what is alive at that peak.
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
    PREDICTION_COMPARES,
    TB_LAYOUT,
    fmt_bytes,
    markdown_breakdown,
    predicted_record,
    predicted_scalars,
    prediction_error_pct,
    run_prediction,
    summary_text,
)
from dtrain.memory.setup import MemorySetup, check_setup, setup_from_config
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
    "PREDICTION_COMPARES",
    "TB_LAYOUT",
    "ComputeBudget",
    "GiB",
    "GpuSpec",
    "MemoryPlan",
    "MemorySetup",
    "ModelState",
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
    "predicted_scalars",
    "prediction_error_pct",
    "quantized_inputs",
    "run_prediction",
    "setup_from_config",
    "state_bytes_per_element",
    "summary_text",
    "uses_autocast",
    "zero1_grad_elements",
    "zero1_holds_full_grads",
    "zero_partition",
    "zero_step_copy_bytes",
]

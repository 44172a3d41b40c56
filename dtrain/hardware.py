"""The one table of GPUs: memory and dense peak FLOP/s, for MFU (dtrain.metrics) and the planner."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str  # what `gpu=` takes in dtrain.cli.plan
    device_name: str  # found in torch.cuda.get_device_name() of this card
    memory_bytes: int  # usable capacity: about what torch.cuda reports as total_memory
    bf16_flops: float  # dense 16-bit tensor-core peak (the datasheet's figure without sparsity)
    tf32_flops: float
    fp32_flops: float


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200-141gb", "H200", int(139.8 * GiB), 989e12, 494.7e12, 67e12),
        GpuSpec("h100-80gb", "H100", int(79.1 * GiB), 989e12, 494.7e12, 67e12),
        GpuSpec("h100-pcie-80gb", "H100 PCIe", int(79.1 * GiB), 756e12, 378e12, 51e12),
        GpuSpec("a100-80gb", "A100", int(79.1 * GiB), 312e12, 156e12, 19.5e12),
        GpuSpec("a100-40gb", "A100-SXM4-40GB", int(39.4 * GiB), 312e12, 156e12, 19.5e12),
        GpuSpec("l40s-48gb", "L40S", int(44.4 * GiB), 362e12, 183e12, 91.6e12),
        GpuSpec("a10g-24gb", "A10G", int(22.0 * GiB), 125e12, 62.5e12, 31.2e12),
        GpuSpec("l4-24gb", "L4", int(22.0 * GiB), 121e12, 60e12, 30.3e12),
        GpuSpec("rtx4090-24gb", "RTX 4090", int(23.6 * GiB), 165e12, 82.6e12, 82.6e12),
    )
}


def gpu_named(device_name: str) -> GpuSpec | None:
    """The card a CUDA device name belongs to: the longest `device_name` it contains, so that
    "H100 PCIe" wins over "H100" and "L40S" over "L4"; None for a card not in the table."""
    found = [g for g in GPUS.values() if g.device_name in device_name]
    return max(found, key=lambda g: len(g.device_name), default=None)


def gpu_peak_flops(gpu: GpuSpec, precision) -> float:
    """Dense peak for the precision's compute dtype. Quantized precisions count at the 16-bit
    rate too: attention and the head stay 16-bit, and one denominator keeps MFU comparable
    across precisions. fp32 runs on TF32 tensor cores only where allowed."""
    if torch.empty((), dtype=precision.compute_dtype).element_size() <= 2:
        return gpu.bf16_flops
    return gpu.tf32_flops if getattr(precision, "tf32", False) else gpu.fp32_flops

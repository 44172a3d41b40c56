"""The one table of GPUs: memory, dense peak FLOP/s per dtype, memory bandwidth and links, for
MFU (dtrain.reporting.metrics) and the planner (dtrain.memory: memory and speed).

Figures are the vendors' datasheets (dense, without sparsity). Links: `nvlink_bytes_per_s` is the
bus bandwidth one GPU can drive per direction inside a node (NVLink through NVSwitch; PCIe where
a card has no NVLink), `net_bytes_per_s` what one GPU gets between nodes (one 400 Gb/s NIC per
GPU, the usual H100/H200 cluster). A measured profile (dtrain.cli.calibrate) replaces them.
"""

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
    fp8_flops: float = 0.0  # dense fp8 tensor-core peak; 0: no fp8 tensor cores
    int8_flops: float = 0.0  # dense int8 tensor-core peak (ops/s)
    hbm_bytes_per_s: float = 0.0  # memory bandwidth
    nvlink_bytes_per_s: float = 32e9  # bus bandwidth per GPU per direction within a node
    net_bytes_per_s: float = 50e9  # between nodes, per GPU (400 Gb/s InfiniBand / RoCE)
    nvlink_latency_s: float = 5e-6  # per ring step within a node (NCCL, large-message regime)
    net_latency_s: float = 10e-6  # per ring step across nodes


_NVL_H100 = dict(nvlink_bytes_per_s=450e9)  # NVLink 4: 900 GB/s both ways per GPU
_NVL_A100 = dict(nvlink_bytes_per_s=300e9)  # NVLink 3: 600 GB/s both ways per GPU
_PCIE4, _PCIE5 = dict(nvlink_bytes_per_s=32e9), dict(nvlink_bytes_per_s=64e9)  # x16, per direction

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200-141gb", "H200", int(139.8 * GiB), 989e12, 494.7e12, 67e12,
                1979e12, 1979e12, 4.8e12, **_NVL_H100),
        GpuSpec("h100-80gb", "H100", int(79.1 * GiB), 989e12, 494.7e12, 67e12,
                1979e12, 1979e12, 3.35e12, **_NVL_H100),
        GpuSpec("h100-pcie-80gb", "H100 PCIe", int(79.1 * GiB), 756e12, 378e12, 51e12,
                1513e12, 1513e12, 2.0e12, **_PCIE5),
        GpuSpec("a100-80gb", "A100", int(79.1 * GiB), 312e12, 156e12, 19.5e12,
                0.0, 624e12, 2.039e12, **_NVL_A100),
        GpuSpec("a100-40gb", "A100-SXM4-40GB", int(39.4 * GiB), 312e12, 156e12, 19.5e12,
                0.0, 624e12, 1.555e12, **_NVL_A100),
        GpuSpec("l40s-48gb", "L40S", int(44.4 * GiB), 362e12, 183e12, 91.6e12,
                733e12, 733e12, 0.864e12, **_PCIE4),
        GpuSpec("a10g-24gb", "A10G", int(22.0 * GiB), 125e12, 62.5e12, 31.2e12,
                0.0, 250e12, 0.6e12, **_PCIE4),
        GpuSpec("l4-24gb", "L4", int(22.0 * GiB), 121e12, 60e12, 30.3e12,
                242e12, 242e12, 0.3e12, **_PCIE4),
        GpuSpec("rtx4090-24gb", "RTX 4090", int(23.6 * GiB), 165e12, 82.6e12, 82.6e12,
                330e12, 660e12, 1.008e12, **_PCIE4),
    )
}  # fmt: skip


def gpu_named(device_name: str) -> GpuSpec | None:
    """The card a CUDA device name belongs to: the longest `device_name` it contains, so that
    "H100 PCIe" wins over "H100" and "L40S" over "L4"; None for a card not in the table."""
    found = [g for g in GPUS.values() if g.device_name in device_name]
    return max(found, key=lambda g: len(g.device_name), default=None)


def gpu_peak_flops(gpu: GpuSpec, precision) -> float:
    """Dense peak for the precision's compute dtype. Quantized precisions count at the 16-bit
    rate too: attention and the head stay 16-bit, and one denominator keeps MFU comparable
    across precisions. fp32 runs on TF32 tensor cores only where allowed."""
    return peak_flops_of(gpu, matmul_kind(precision))


def matmul_kind(precision) -> str:
    """The datasheet column of the precision's compute dtype: bf16 (any 16-bit), tf32 or fp32."""
    if torch.empty((), dtype=precision.compute_dtype).element_size() <= 2:
        return "bf16"
    return "tf32" if getattr(precision, "tf32", False) else "fp32"


def fp8_gemm_dims_ok(*dims: int) -> bool:
    """fp8 GEMMs (torch._scaled_mm) need every matrix dimension divisible by 16."""
    return all(d % 16 == 0 for d in dims)


def peak_flops_of(gpu: GpuSpec, kind: str) -> float:
    """Dense peak for a matmul kind: bf16, tf32, fp32, fp8 or int8 (0.0: no such tensor cores)."""
    return getattr(gpu, f"{kind}_flops")

"""Which kernels run precision=int8's matmuls: the portable torch._int_mm path on CPU (and on
GPUs older than Hopper, or without Triton), the Triton kernels on sm90+ (here with a faked
CUDA device), precision.int8_kernel forcing either, one log line naming the choice and why."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dtrain.config import PrecisionConfig
from dtrain.errors import ConfigError
from dtrain.lowp.int8 import linear as i8
from dtrain.lowp.int8.options import Int8Options
from dtrain.model import ModelConfig, build_model
from dtrain.precision import apply_precision, build_precision

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(i8, "_LOGGED", set())  # each test sees its own first log line


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3", triton=True):
    """A CUDA device as select_kernel and apply_int8 see it, on a machine without one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(i8, "_triton_installed", lambda: triton)
    # Importing the kernels needs triton; CI may not have it, and nothing here launches them:
    # what apply_int8 reads of the module stands in for it (the default GEMM).
    ops = SimpleNamespace(configure=lambda **choices: None)
    monkeypatch.setattr(i8, "_triton_ops", lambda: ops)


def _kernels(model: nn.Module) -> set[str]:
    return {m.kernel for m in model.modules() if isinstance(m, i8.Int8Linear)}


def test_cpu_takes_the_portable_path_and_says_so_in_one_line(caplog):
    assert i8.select_kernel(CPU) == ("torch", "no CUDA device")
    model = build_model(ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64), CPU)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        apply_precision(model, build_precision(PrecisionConfig(name="int8"), CPU))
        apply_precision(model, build_precision(PrecisionConfig(name="int8"), CPU))  # 2nd model
    assert _kernels(model) == {"torch"}
    lines = [r.getMessage() for r in caplog.records if "int8 matmuls" in r.getMessage()]
    assert lines == ["int8 matmuls: torch._int_mm (no CUDA device)"]


def test_sm90_takes_the_triton_kernels(monkeypatch, caplog):
    fake_gpu(monkeypatch)
    kernel, why = i8.select_kernel(CUDA)
    assert kernel == "triton" and "sm90" in why
    fake_gpu(monkeypatch, capability=(10, 0), name="NVIDIA B200")
    assert i8.select_kernel(CUDA)[0] == "triton"

    # FSDP builds the model on the meta device: the choice is the current CUDA device's.
    fake_gpu(monkeypatch)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert i8.apply_int8(model, lambda m, n: True) == 2
    assert _kernels(model) == {"triton"}
    assert [r.getMessage() for r in caplog.records] == [
        "int8 matmuls: Triton sm90 kernels (NVIDIA H100 80GB HBM3, sm90)"
    ]
    assert "kernel=triton" in repr(model[0])


@pytest.mark.parametrize(
    "capability,triton,forced,expected,reason",
    [
        ((8, 0), True, "", "torch", "NVIDIA A100, sm80: the Triton int8 kernels are for sm90+"),
        ((9, 0), False, "", "torch", "Triton is not installed"),
        ((9, 0), True, "torch", "torch", "precision.int8_kernel=torch"),
        ((9, 0), True, "auto", "triton", "NVIDIA H100 80GB HBM3, sm90"),
        ((8, 0), True, "triton", "triton", "forced by precision.int8_kernel=triton"),
        ((8, 0), False, "triton", "torch", "Triton is not installed"),
    ],
)
def test_the_choice_and_its_reason(monkeypatch, capability, triton, forced, expected, reason):
    name = "NVIDIA A100" if capability < (9, 0) else "NVIDIA H100 80GB HBM3"
    fake_gpu(monkeypatch, capability=capability, name=name, triton=triton)
    kernel, why = i8.select_kernel(CUDA, forced or "auto")
    assert kernel == expected and reason in why, (kernel, why)


def test_forcing_triton_on_cpu_stays_portable_and_bad_values_are_config_errors(monkeypatch):
    monkeypatch.setattr(i8, "_INTERPRET", False)
    assert i8.select_kernel(CPU, "triton") == ("torch", "no CUDA device")
    with pytest.raises(ConfigError, match="precision.int8_kernel='cutlass' is not valid; choose"):
        build_precision(PrecisionConfig(name="int8", int8_kernel="cutlass"), CPU)
    with pytest.raises(ValueError, match="kernel='cutlass'"):
        i8.int8_linear(torch.randn(2, 8), torch.randn(4, 8), kernel="cutlass")


def test_the_quantize_placement_is_read_once_for_the_triton_kernels(monkeypatch, caplog):
    def swapped(kernel=None, quantize="gradients") -> nn.Module:
        with torch.device("meta"):  # as FSDP builds it: the kernels are the (faked) GPU's
            model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
        options = Int8Options(quantize=quantize)
        i8.apply_int8(model, lambda m, n: True, kernel=kernel, options=options)
        return model

    def placements(model) -> set[str]:
        return {m.quantize for m in model}

    fake_gpu(monkeypatch)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert placements(swapped()) == {"gradients"}  # the default: dy's apart, said nowhere
    assert not any("int8 quantizes" in r.getMessage() for r in caplog.records)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        assert placements(swapped(quantize="fused")) == {"fused"}
    assert any("int8 quantizes: all fused" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dtrain"):
        model = swapped(quantize="apart")
    assert placements(model) == {"apart"} and "quantize=apart" in repr(model[0])
    assert any("int8 quantizes: the Triton op, apart" in r.getMessage() for r in caplog.records)
    # torch._int_mm has no quantize op of its own: the choice does not apply to it
    assert placements(swapped(kernel="torch", quantize="apart")) == {"fused"}
    with pytest.raises(ConfigError, match="precision.int8_quantize='backward' is not valid"):
        build_precision(PrecisionConfig(name="int8", int8_quantize="backward"), CPU)
    with pytest.raises(ValueError, match="quantize='sideways'"):
        i8.int8_linear(torch.randn(2, 8), torch.randn(4, 8), quantize="sideways")


def test_a_triton_layer_given_cpu_tensors_computes_the_portable_path(monkeypatch):
    """A layer swapped for a GPU (kernel=triton) that then meets CPU tensors (e.g. built on
    meta where a GPU exists, trained on CPU) falls back to torch._int_mm: the same numbers."""
    fake_gpu(monkeypatch)
    monkeypatch.setattr(i8, "_INTERPRET", False)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 24))
    tri = nn.Sequential(nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 24))
    tri.load_state_dict(ref.state_dict())
    i8.apply_int8(ref, lambda m, n: True, kernel="torch")
    i8.apply_int8(tri, lambda m, n: True, kernel="triton")
    assert _kernels(tri) == {"triton"}
    x = torch.randn(3, 5, 48)
    for model in (ref, tri):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().pow(2).mean().backward()
    for p, q in zip(ref.parameters(), tri.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_the_rowwise_scale_is_a_multiply_by_the_fp32_reciprocal():
    """Device-independent bits: amax * fp32(1/127), which CUDA's eager `x / 127.0` (a multiply
    by the reciprocal) and CPU's (a true division) would not agree on for this row's amax."""
    amax = torch.tensor(13.69, dtype=torch.float32)
    assert amax / 127.0 != amax * torch.tensor(1 / 127, dtype=torch.float32)  # the case exists
    x = torch.tensor([[0.5, -13.69, 2.0], [0.0, 0.0, 0.0]])
    q, scale = i8.quantize_rowwise(x)
    assert scale[0, 0] == amax * torch.tensor(1 / 127, dtype=torch.float32)
    assert scale[1, 0] == torch.tensor(1e-12, dtype=torch.float32) * (1 / 127)
    assert q[0].tolist() == [5, -127, 19]

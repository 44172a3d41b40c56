"""The CUDA caching allocator's settings: expandable segments by default on GPUs, the user's
PYTORCH_CUDA_ALLOC_CONF untouched, nothing on CPU; and the setting reaches the allocator."""

import torch

from dtrain import dist as ddist

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_expandable_segments_by_default_on_gpus():
    assert ddist.allocator_settings(CUDA, True, environ={}) == "expandable_segments:True"


def test_users_alloc_conf_wins_and_off_means_untouched():
    user = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert ddist.allocator_settings(CUDA, True, environ=user) is None
    assert ddist.allocator_settings(CUDA, False, environ={}) is None
    assert ddist.allocator_settings(CPU, True, environ={}) is None


def test_configure_allocator_calls_torchs_setter(monkeypatch):
    calls = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert ddist.configure_allocator(CUDA, True) == "expandable_segments:True"
    assert calls == ["expandable_segments:True"]
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # children too
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    calls.clear()
    assert ddist.configure_allocator(CUDA, False) == "default"
    assert ddist.configure_allocator(CPU, True) == "-"
    assert calls == []


def test_torch_has_a_setter_that_takes_the_setting():
    """The name dtrain calls exists in this torch, and accepts the string (on a CPU build it is
    parsed and stored; the GPU runs of docs/benchmarks.md show its effect)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    setter = setter or torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:False")  # the allocator's own default: harmless to leave

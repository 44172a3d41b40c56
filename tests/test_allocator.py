"""The CUDA caching allocator's settings: expandable segments by default on GPUs, the user's
allocator variables untouched, nothing on CPU; and the setting reaches torch's allocator config."""

import pytest
import torch

from dtrain import dist as ddist

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_expandable_segments_by_default_on_gpus():
    assert ddist.allocator_settings(CUDA, True, environ={}) == "expandable_segments:True"


@pytest.mark.parametrize("var", ddist.USER_ALLOC_VARS)
def test_any_user_allocator_variable_wins(var):
    env = {var: "max_split_size_mb:128"}
    assert ddist.allocator_settings(CUDA, True, environ=env) is None


def test_off_or_cpu_means_untouched():
    assert ddist.allocator_settings(CUDA, False, environ={}) is None
    assert ddist.allocator_settings(CPU, True, environ={}) is None


def test_configure_allocator_calls_the_setter_and_records_what_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(ddist, "_allocator_setter", lambda: calls.append)
    assert ddist.configure_allocator(CUDA, True, environ={}) == "expandable_segments:True"
    assert calls == ["expandable_segments:True"]
    calls.clear()
    user = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    assert ddist.configure_allocator(CUDA, True, environ=user) == (
        "user: PYTORCH_ALLOC_CONF=max_split_size_mb:512"
    )
    assert ddist.configure_allocator(CUDA, False, environ={}) == "default"
    assert ddist.configure_allocator(CPU, True, environ={}) == "-"
    assert calls == []  # the user's settings, "off" and the CPU: the allocator is left alone


def test_torchs_setter_takes_the_setting():
    """The setter dtrain calls exists in this torch and stores the string, read back through
    torch's getter where it has one; the allocator's settings are put back afterwards."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:
        pytest.skip("this torch has no allocator-settings getter")
    before = getter()
    try:
        ddist._allocator_setter()(ddist.EXPANDABLE)
        assert "expandable_segments:True" in getter().replace(" ", "")
    finally:
        ddist._allocator_setter()(before or "expandable_segments:False")


def test_init_distributed_records_the_allocator_on_cpu():
    assert ddist.init_distributed("cpu").allocator == "-"

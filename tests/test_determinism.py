"""trainer.deterministic: what it switches on, that it puts everything back, and that Inductor
really takes the deterministic kernel for the embedding's gradient under it."""

from __future__ import annotations

import torch
from torch._inductor import config as inductor
from torch._inductor.utils import run_and_get_code

from dtrain.config import TrainerConfig
from dtrain.determinism import CUBLAS_WORKSPACE, deterministic


def test_off_by_default_and_on_changes_nothing_after_it():
    assert TrainerConfig().deterministic is False
    env = {}
    with deterministic(False, environ=env):
        assert not torch.are_deterministic_algorithms_enabled()
    assert env == {}
    with deterministic(True, environ=env):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # no op refused outright
        assert inductor.deterministic is True
        assert env["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert not torch.are_deterministic_algorithms_enabled()
    assert inductor.deterministic is False and env == {}


def test_a_users_cublas_workspace_is_kept():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    with deterministic(True, environ=env):
        assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


def _embedding_grad_code() -> str:
    """Inductor's code for an embedding's backward: an index_put with accumulate."""
    emb = torch.nn.Embedding(64, 8)
    ids = torch.randint(0, 64, (4, 16))

    def step():
        emb.weight.grad = None
        emb(ids).square().sum().backward()
        return emb.weight.grad

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step))
    return "\n".join(code)


def test_compiled_embedding_gradient_takes_atens_deterministic_kernel():
    # Without the switch Inductor writes the scatter itself (atomic adds on GPUs; their order
    # changes run to run); with it, it calls ATen's index_put (sorted, deterministic).
    assert "aten.index_put" not in _embedding_grad_code()
    with deterministic(True, environ={}):
        assert "aten.index_put" in _embedding_grad_code()

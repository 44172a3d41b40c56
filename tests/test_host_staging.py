"""dtrain/host_staging.py: the async checkpoints' host buffers, laid out as the state dict they
stage. On 2 gloo ranks with fully_shard and AdamW (DTensor shards, optimizer states, a step
count): the buffers mirror DCP's own, DCP stages into them without making its own, and what
it writes from them loads back as the state."""

from __future__ import annotations

import textwrap

from tests.conftest import torchrun_script

WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed._state_dict_utils import _create_cpu_state_dict
    from torch.utils._pytree import tree_flatten
    from dtrain.host_staging import host_buffers, _ALIGN

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3, bias=False))  # odd sizes: padded shards
    fully_shard(m[0]); fully_shard(m)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 7)).sum().backward(); opt.step()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "note": "x", "n": 3}

    mine, flat = host_buffers(state, pin=False)
    theirs = _create_cpu_state_dict(state)  # DCP's own, the structure to match
    a, spec_a = tree_flatten(mine); b, spec_b = tree_flatten(theirs)
    assert spec_a == spec_b, (spec_a, spec_b)
    views = 0
    for x, y in zip(a, b):
        assert type(x) is type(y), (type(x), type(y))
        if isinstance(x, DTensor):
            assert (x.shape, x.placements, x.device_mesh) == (y.shape, y.placements, y.device_mesh)
            x, y = x._local_tensor, y._local_tensor
        if isinstance(x, torch.Tensor):
            assert (x.shape, x.dtype, x.device.type) == (y.shape, y.dtype, "cpu")
            if x.dim() and x.numel():
                views += 1
                assert x.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                assert (x.data_ptr() - flat.data_ptr()) % _ALIGN == 0
        else:
            assert x == y
    assert views >= 9  # 3 weights + 2 biases... and AdamW's moments of each local shard

    writer = FileSystemWriter(sys.argv[1], cache_staged_state_dict=True)
    writer.state_dict_cache = mine
    dcp.async_save(state, storage_writer=writer, checkpoint_id=sys.argv[1]).result()
    assert writer.state_dict_cache is mine  # DCP staged into these buffers, made no others
    for k, v in msd.items():
        assert torch.equal(mine["model"][k]._local_tensor, v.to_local()), k
    back = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}
    dcp.load(back, checkpoint_id=sys.argv[1])
    for k, v in msd.items():
        assert torch.equal(back["model"][k].to_local(), v.to_local()), k
    dist.barrier()
    dist.destroy_process_group()
    print("OK")
    """
)


def test_host_buffers_stage_an_fsdp_state_as_dcp_would(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    res = torchrun_script(script, str(tmp_path / "ckpt"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("OK") == 2


def test_host_buffers_mirror_every_kind_of_value_as_dcp_does():
    import collections

    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.utils._pytree import tree_flatten

    from dtrain.host_staging import host_buffers

    Pair = collections.namedtuple("Pair", "a b")
    state = {
        "w": torch.randn(3, 5),
        "step": torch.tensor(7.0),  # 0-dim: a small tensor of its own
        "empty": torch.zeros(0, 4),
        "nested": [torch.arange(6, dtype=torch.int64), ("x", 2, None)],
        "pair": Pair(torch.ones(2, dtype=torch.bfloat16), 1.5),
    }
    mine, flat = host_buffers(state, pin=False)
    a, spec_a = tree_flatten(mine)
    b, spec_b = tree_flatten(_create_cpu_state_dict(state))
    assert spec_a == spec_b
    for x, y in zip(a, b):
        assert type(x) is type(y)
        if isinstance(x, torch.Tensor):
            assert (x.shape, x.dtype) == (y.shape, y.dtype)
    assert flat.numel() == 64 + 64 + 64  # w (60 B), arange (48 B), pair.a (4 B): 64 B apart
    _copy_state_dict(state, mine)
    assert torch.equal(mine["w"], state["w"]) and mine["step"].item() == 7.0
    assert torch.equal(mine["nested"][0], state["nested"][0])

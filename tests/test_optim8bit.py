"""dtrain's grouped step of torchao's AdamW8bit (dtrain/lowp/optim8bit/adamw.py): torchao's bits,
torchao's state dict, few compiled calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.config import OptimConfig
from dtrain.optim import set_lr

torchao = pytest.importorskip("torchao")
from torchao.optim import AdamW8bit  # noqa: E402

from dtrain.lowp.optim8bit import build_adamw8bit  # noqa: E402
from dtrain.lowp.optim8bit.adamw import chunks_of_like_tensors  # noqa: E402


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    # 8-bit moments for the two 64x128 matrices and the 80x64 one (>= 4096 elements, whole
    # 256-blocks); plain fp32 moments for the 32x16 matrix and the vectors.
    return nn.ModuleDict(
        {
            "a": nn.Linear(128, 64),
            "b": nn.Linear(128, 64, bias=False),
            "c": nn.Linear(64, 80, bias=False),
            "small": nn.Linear(16, 32),
        }
    ).to(dtype)


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _step_both(ours, opt, ref, ref_opt, step: int) -> None:
    """One step of each from the same gradients; the parameters must be equal bit for bit."""
    for m in (ours, ref):
        _grads(m, seed=step)
    opt.step()
    ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), step


def _states(opt) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = st[key]
            out += [t.codes, t.scale] if hasattr(t, "codes") else [t]
    return out


def test_grouped_step_gives_torchaos_bits_and_state_dict(monkeypatch):
    """Eager, the grouped step and torchao's per-tensor step give the same parameters and
    states bit for bit, through an lr change and a state-dict swap between the two."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)  # torchao's, eager on CPU
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours, ref = _model(), _model()
    opt = build_adamw8bit(ours, cfg, compiled=False)
    assert isinstance(opt, AdamW8bit) and type(opt).__name__ == "GroupedAdamW8bit"
    from dtrain.optim import param_groups

    ref_opt = AdamW8bit(
        param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )
    for step in range(4):
        if step == 2:  # the schedule moves lr; then each continues from the other's state
            set_lr(opt, 3e-3)
            set_lr(ref_opt, 3e-3)
            sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
            opt.load_state_dict(ref_sd)
            ref_opt.load_state_dict(sd)
        _step_both(ours, opt, ref, ref_opt, step)
        eight = [t for t in _states(opt) if t.dtype == torch.uint8]
        assert len(eight) == 6  # exp_avg and exp_avg_sq of a.weight, b.weight, c.weight
        for a, b in zip(_states(opt), _states(ref_opt), strict=True):
            assert torch.equal(a, b), step
    assert float(next(iter(opt.state.values()))["step"]) == 4


def test_bf16_parameters_round_stochastically():
    """bf16 parameters (bf16-true): updated, still bf16, and rounded stochastically (two
    optimizers from the same state part ways: the rounding draws random bits)."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.0)
    ends = []
    for seed in (1, 2):
        model = _model(torch.bfloat16)
        start = [p.detach().clone() for p in model.parameters()]
        opt = build_adamw8bit(model, cfg, compiled=False)
        assert opt.bf16_stochastic_round
        torch.manual_seed(seed)
        _grads(model, seed=0)
        opt.step()
        params = list(model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in params)
        assert all(not torch.equal(p, s) for p, s in zip(params, start, strict=True))
        ends.append(torch.cat([p.detach().flatten().float() for p in params]))
    assert not torch.equal(*ends)


def test_fp8_all_gather_weights_are_stepped_as_plain_tensors():
    """Under fsdp with precision=fp8, torchao wraps each weight in WeightWithDynamicFloat8CastTensor
    (its fp8 all-gather): the step gets the wrapped tensor, so the compiled update sees no
    subclass, and the result is the plain model's bit for bit."""
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours, ref = _model(), _model()
    for lin in ours.values():
        wrapped = Wrapped(lin.weight.data, LinearMMConfig(), torch.float8_e4m3fn)
        lin.weight = nn.Parameter(wrapped)
    opt, ref_opt = (build_adamw8bit(m, cfg, compiled=False) for m in (ours, ref))
    seen, update = set(), opt._update

    def spy(chunk, *args):
        seen.update(type(t) for item in chunk for t in (item[0], *item[3], *item[4]))
        return update(chunk, *args)

    opt._update = spy
    for step in range(3):
        _step_both(ours, opt, ref, ref_opt, step)
    assert seen == {torch.Tensor}
    assert all(isinstance(lin.weight, Wrapped) for lin in ours.values())  # still wrapped
    for a, b in zip(_states(opt), _states(ref_opt), strict=True):
        assert torch.equal(a, b)


def test_like_tensors_are_chunked_together():
    """Grouped by shape and state layout, cut into near-equal chunks of at most 32."""

    def item(shape, eight_bit=True):
        t = torch.empty(shape)
        st = (t.to(torch.uint8), torch.empty(t.numel() // 256), torch.empty(256))
        return (t, t, torch.tensor(0.0), st if eight_bit else (t,), st if eight_bit else (t,))

    items = [item((64, 128)) for _ in range(70)] + [item((16,), False)] * 3
    items += [item((128, 64)) for _ in range(2)]
    chunks = chunks_of_like_tensors(items)
    assert sorted(len(c) for c in chunks) == [2, 3, 23, 23, 24]
    for c in chunks:
        assert len({(tuple(i[0].shape), len(i[3])) for i in c}) == 1
    # at most 5 tensors of 64x128 by elements; one tensor alone where it is over the cap
    capped = chunks_of_like_tensors(items[:70], elements=5 * 64 * 128 + 1)
    assert len(capped) == 14 and {len(c) for c in capped} == {5}
    assert [len(c) for c in chunks_of_like_tensors(items[:3], elements=10)] == [1, 1, 1]


def test_grouped_step_traces_whole(monkeypatch):
    """Each group's update is one graph (fullgraph: no break, so one call), and traced it
    gives the eager step's bits (aot_eager: Dynamo and AOTAutograd, without Inductor's C++
    build on a CPU); one graph per kind of group, none retraced on the next step."""
    real = torch.compile
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def traced(fn=None, **kw):
        from torch._dynamo.backends.common import aot_autograd

        return real(fn, **{**kw, "backend": aot_autograd(fw_compiler=count)})

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    ours, ref = _model(), _model()
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", traced)
    opt = build_adamw8bit(ours, cfg, compiled=True)
    monkeypatch.setattr(torch, "compile", real)
    ref_opt = build_adamw8bit(ref, cfg, compiled=False)
    for step in range(2):
        _step_both(ours, opt, ref, ref_opt, step)
    # matrices: a, b (one shape), c, small; vectors: a's bias, small's bias (another group)
    assert len(graphs) == 5


def test_grouped_step_on_fsdp2_dtensors(tmp_path):
    """Under FSDP2 (2 ranks, gloo) the grouped step updates the DTensor parameters through
    their shards, and ends on torchao's parameters and states bit for bit."""
    from tests.conftest import ROOT, torchrun_script

    res = torchrun_script(ROOT / "tests" / "fsdp_optim8bit_worker.py", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    for r in (0, 1):
        line = (tmp_path / f"rank{r}.txt").read_text().split()
        assert line == ["params", "True", "states", "True", "eight_bit", "4", "moved", "True"]


_KERNEL_CHECK = """
import torch
torch.compile = lambda fn=None, **kw: fn  # torchao's reference step, eager on CPU
from torchao.optim import AdamW8bit
from dtrain.config import OptimConfig
from dtrain.lowp.optim8bit import build_adamw8bit
from dtrain.optim import param_groups, set_lr
from tests.test_optim8bit import _grads, _model, _states

cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
ours, ref = _model(), _model()
start = [p.detach().clone() for p in ours.parameters()]
opt = build_adamw8bit(ours, cfg, compiled=False)
groups = param_groups(ref, cfg.weight_decay)
ref_opt = AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
for step in range(4):
    if step == 2:
        set_lr(opt, 3e-3)
        set_lr(ref_opt, 3e-3)
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        opt.load_state_dict(ref_sd)
        ref_opt.load_state_dict(sd)
    for m in (ours, ref):
        _grads(m, seed=step)
    opt.step()
    ref_opt.step()
fused = sum(len(f) for f, _ in opt._chunks.values())
worst = max((a - b).abs().max().item()
            for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
moved = all(not torch.equal(a, b) for a, b in zip(ours.parameters(), start, strict=True))
codes = [(a != b).float().mean().item() for a, b in zip(_states(opt), _states(ref_opt))
         if a.dtype == torch.uint8]
print("RESULT", fused, worst, int(moved), max(codes), len(codes))
"""


def test_the_triton_kernel_steps_8bit_tensors_as_torchao_does():
    """The CUDA kernel (dtrain/lowp/optim8bit/triton_step.py) run on CPU by Triton's interpreter,
    through an lr change and a state-dict swap with torchao's own step: it takes exactly the
    three fp32 matrices with 8-bit moments (the rest stay on the compiled path) and leaves the
    parameters and states torchao's to fp32 rounding."""
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    pytest.importorskip("triton")
    env = cli_env()
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [sys.executable, "-c", _KERNEL_CHECK],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT"))
    fused, worst, moved, codes_off, n_codes = line.split()[1:]
    assert int(fused) == 3
    assert int(moved) == 1 and int(n_codes) == 6
    assert float(worst) < 1e-7  # parameters near 0.1: a few fp32 ulps after 4 steps
    assert float(codes_off) < 1e-3  # a code may round the other way where fp32 differs


def test_the_kernels_quantizer_gives_torchaos_codes():
    """The Triton kernel computes each code from its value where torchao searches the table
    (optim8bit/triton_step.py `_code_guess`): the same codes, also with the guess one code off
    either way, on the values tests/optim8bit_quantize_check.py lists (run in Triton's
    interpreter; tests/gpu runs it on CUDA)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    pytest.importorskip("triton")
    env = cli_env()
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [sys.executable, "tests/optim8bit_quantize_check.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [ln.split()[1:] for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    assert sorted((int(s), int(o)) for s, o, _, _ in rows) == [
        (s, o) for s in (0, 1) for o in (-1, 0, 1)
    ]
    for signed, off, n, bad in rows:
        assert int(n) > 400_000 and int(bad) == 0, (signed, off, bad)


def test_the_kernel_takes_only_moments_in_torchaos_maps(monkeypatch):
    """The kernel computes codes from the layout of torchao's dynamic maps: a moment with
    another map (a state built by hand) stays on the compiled step."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from dtrain.lowp.optim8bit.adamw import _state_parts, fused_kernel_takes

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = torch.zeros(4096)
    m, v = OptimState8bit.zeros(p.shape, True), OptimState8bit.zeros(p.shape, False)
    item = (p, torch.zeros(4096), torch.tensor(1.0), _state_parts(m), _state_parts(v))
    assert fused_kernel_takes(item)
    assert not fused_kernel_takes((*item[:3], _state_parts(v), _state_parts(m)))
    v.qmap[200] += 1e-3
    assert not fused_kernel_takes(item)

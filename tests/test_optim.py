import torch

from dtrain.config import OptimConfig
from dtrain.model import ModelConfig, build_model
from dtrain.optim import build_optimizer, lr_at, param_groups


def test_lr_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == 0.1
    assert lr_at(9, cfg, 100) == 1.0
    assert abs(lr_at(10, cfg, 100) - 1.0) < 1e-12
    assert abs(lr_at(55, cfg, 100) - 0.55) < 1e-9  # cosine midpoint
    assert abs(lr_at(100, cfg, 100) - 0.1) < 1e-12
    vals = [lr_at(s, cfg, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_norm_gains_are_not_decayed():
    model = build_model(ModelConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32), "cpu")
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    n = sum(len(g["params"]) for g in opt.param_groups)
    assert n == len(list(model.parameters()))


def test_short_warmup_warning_names_both_values_only_when_the_peak_is_missed():
    from dtrain.optim import short_warmup_warning

    cfg = OptimConfig(lr=1.0, warmup_steps=10)
    line = short_warmup_warning(cfg, 4)
    assert "trainer.max_steps=4 is below optim.warmup_steps=10" in line
    assert "never reaches its peak optim.lr=1" in line and "0.4 at the last step" in line
    assert short_warmup_warning(cfg, 10) is None  # the last step runs at the peak
    assert short_warmup_warning(OptimConfig(warmup_steps=0), 1) is None

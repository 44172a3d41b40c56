"""Every YAML in conf/ composes and validates; the schema rejects what it should."""

import pytest

from dtrain.config import GROUPS, TrainConfig, build_dataclass, from_dict, group_choices
from dtrain.errors import ConfigError
from tests.conftest import compose

ALL = [(g, c) for g in GROUPS for c in group_choices(g)]


@pytest.mark.parametrize("group,choice", ALL, ids=[f"{g}={c}" for g, c in ALL])
def test_every_conf_file_composes_and_validates(group, choice):
    cfg = compose(f"{group}={choice}")
    assert isinstance(cfg, TrainConfig)
    node = getattr(cfg, group)
    if hasattr(node, "name") and group != "checkpoint":
        assert node.name == choice


def test_default_run_dir_names_the_configuration():
    cfg = compose("strategy=ddp", "precision=bf16", "model=small")
    assert cfg.run_dir.endswith("ddp-bf16-w1-small")


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(ConfigError, match="valid keys under trainer: .*max_steps"):
        build_dataclass(TrainConfig, {"trainer": {"max_stepz": 3}})


@pytest.mark.parametrize(
    "data,message",
    [
        ({"trainer": {"seq_len": "long"}}, "trainer.seq_len must be an integer"),
        ({"trainer": {"grad_clip": -1.0}}, "trainer.grad_clip must be >= 0"),
        ({"optim": {"min_lr_ratio": 2.0}}, "optim.min_lr_ratio must be in"),
        ({"model": {"n_head": 4, "n_kv_head": 3}}, "divisible by n_kv_head"),
        ({"trainer": {"progress_bar": "yes"}}, "trainer.progress_bar must be true/false"),
        ({"resume": "/definitely/not/here"}, "no such checkpoint folder"),
    ],
)
def test_validation_messages(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(data)

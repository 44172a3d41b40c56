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


# (override, message): every kind of bad number, through Hydra's own parsing of nan and inf.
BAD_NUMBERS = [
    ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
    ("optim.lr=inf", "optim.lr must be a finite number > 0, got inf"),
    ("optim.lr=1e400", "optim.lr must be a finite number > 0, got inf"),
    ("optim.lr=-1", "optim.lr must be > 0, got -1.0"),
    ("optim.weight_decay=nan", "optim.weight_decay must be a finite number >= 0, got nan"),
    ("optim.weight_decay=inf", "optim.weight_decay must be a finite number >= 0, got inf"),
    ("optim.weight_decay=-1", "optim.weight_decay must be >= 0, got -1.0"),
    ("optim.beta1=1.0", "optim.beta1 must be in [0, 1), got 1.0"),
    ("optim.beta2=nan", "optim.beta2 must be a finite number in [0, 1), got nan"),
    ("optim.eps=0", "optim.eps must be > 0, got 0.0"),
    ("optim.eps=-inf", "optim.eps must be a finite number > 0, got -inf"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio must be a finite number in [0, 1], got nan"),
    ("optim.min_lr_ratio=-0.5", "optim.min_lr_ratio must be in [0, 1], got -0.5"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, got -1"),
    ("trainer.grad_clip=nan", "trainer.grad_clip must be a finite number >= 0, got nan"),
    ("trainer.grad_clip=-1", "trainer.grad_clip must be >= 0, got -1.0"),
    ("trainer.collective_timeout_s=inf", "trainer.collective_timeout_s must be a finite number"),
    ("trainer.collective_timeout_s=-1", "trainer.collective_timeout_s must be > 0, got -1.0"),
    ("inspect.temperature=nan", "inspect.temperature must be a finite number >= 0, got nan"),
    ("inspect.temperature=-1", "inspect.temperature must be >= 0, got -1.0"),
    ("inspect.top_p=1.5", "inspect.top_p must be in (0, 1], got 1.5"),
    ("inspect.top_p=0", "inspect.top_p must be in (0, 1], got 0.0"),
    ("inspect.top_p=nan", "inspect.top_p must be a finite number in (0, 1], got nan"),
    ("metrics.peak_tflops=inf", "metrics.peak_tflops must be a finite number > 0, got inf"),
    ("metrics.peak_tflops=-1", "metrics.peak_tflops must be > 0, got -1.0"),
    ("data.eval_fraction=nan", "data.eval_fraction must be a finite number in (0, 1), got nan"),
    ("model.norm_eps=nan", "model.norm_eps must be a finite number > 0, got nan"),
    ("model.init_std=-0.02", "model.init_std must be > 0, got -0.02"),
    ("model.rope_theta=inf", "model.rope_theta must be a finite number > 0, got inf"),
]


@pytest.mark.parametrize("override,message", BAD_NUMBERS, ids=[o for o, _ in BAD_NUMBERS])
def test_non_finite_and_out_of_range_numbers_are_refused(override, message):
    with pytest.raises(ConfigError) as e:
        compose(override)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("override", ["optim.beta1=0", "inspect.top_p=1", "optim.lr=1e-12"])
def test_range_edges_that_are_valid_pass(override):
    compose(override)


def test_every_number_in_the_schema_has_a_range():
    """A new numeric key must say its range in config.RANGES (or it gets finiteness only)."""
    import dataclasses
    import typing

    from dtrain.config import RANGES

    def numeric(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from numeric(tp, f"{prefix}{f.name}.")
            elif {int, float} & set(typing.get_args(tp) or (tp,)):
                yield f"{prefix}{f.name}"

    # Integers whose checks need more than a range (the data builder or another key).
    elsewhere = {
        "data.vocab_size",
        "data.num_streams",
        "data.num_workers",
        "data.prefetch_factor",
        "data.shuffle_window",
        "data.bpe_train_bytes",
        "strategy.stage",
        "inspect.seed",
        "seed",
    }
    missing = set(numeric(TrainConfig)) - set(RANGES) - elsewhere
    assert not missing, f"add a range to config.RANGES for: {sorted(missing)}"
    assert set(RANGES) <= set(numeric(TrainConfig)), set(RANGES) - set(numeric(TrainConfig))


def _literal_keys(cls, prefix=""):
    """(dotted key, its choices) of every Literal-typed field of the schema."""
    import dataclasses
    import typing

    from dtrain.config import choices_of

    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _literal_keys(tp, f"{prefix}{f.name}.")
        elif choices_of(tp) is not None:
            yield f"{prefix}{f.name}", choices_of(tp)


LITERALS = list(_literal_keys(TrainConfig))


@pytest.mark.parametrize("key,choices", LITERALS, ids=[k for k, _ in LITERALS])
def test_every_choice_is_checked_from_its_type(key, choices):
    """A Literal-typed key refuses anything else in one line naming the choices, and every
    choice it lists passes."""
    from dtrain.config import say_choices

    data: dict = {}
    node = data
    *groups, leaf = key.split(".")
    for group in groups:
        node = node.setdefault(group, {})
    node[leaf] = "bogus"
    with pytest.raises(ConfigError) as e:
        from_dict(data)
    assert str(e.value) == f"{key}='bogus' is not valid; choose {say_choices(choices)}"
    for choice in choices:
        node[leaf] = choice
        from_dict(data)


def _restated(data: dict, base: dict, prefix: str = "") -> list[str]:
    """Keys of `data` whose value is the one `base` has: defaults written a second time."""
    out = []
    for key, value in data.items():
        if key not in base:
            continue
        if isinstance(value, dict) and isinstance(base[key], dict):
            out += _restated(value, base[key], f"{prefix}{key}.")
        elif value == base[key] and key != "name":  # a file names its choice
            out.append(f"{prefix}{key}")
    return out


def test_every_default_is_written_once():
    """Defaults live in the schema (dtrain/config.py); a conf/ file extends its base and lists
    only what differs, so a default cannot drift between a dataclass and a YAML copy of it."""
    from omegaconf import OmegaConf

    from dtrain.config import CONF_DIR, PRECISION_OWN_KEYS, schema_defaults

    defaults = schema_defaults(TrainConfig)
    for key in PRECISION_OWN_KEYS:  # not in precision_base: the precisions that own them say so
        del defaults["precision"][key]
    files = [(CONF_DIR / "train.yaml", defaults)]
    files += [(f, defaults[g]) for g in GROUPS for f in sorted((CONF_DIR / g).glob("*.yaml"))]
    for path, base in files:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        data.pop("hydra", None)
        data.pop("defaults", None)
        assert not _restated(data, base), f"{path} restates defaults: {_restated(data, base)}"
    # train.yaml's own sections are the schema's, as composed.
    cfg = compose()
    for key in ("trainer", "metrics", "inspect", "profile", "debug", "seed", "resume"):
        assert getattr(cfg, key) == getattr(TrainConfig(), key), key

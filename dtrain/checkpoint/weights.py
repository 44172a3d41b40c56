"""Model weights outside training: load any training checkpoint on one device, consolidate one.

A checkpoint folder (`checkpoints/step_NNNNNNN/`) is a torch.distributed.checkpoint (DCP) save
by every rank of the run plus a manifest holding the run's config. DCP stores each tensor with
its global shape and where every shard lives, so it reshards on load: a checkpoint written by
8 FSDP ranks loads into one plain model, in one process, with no process group.

Both loaders check the checkpoint as resume does (checksums against the manifest, the DCP
index, every pickled item a plain value: check_checkpoint) before reading it,
and the model config the manifest holds as a run's config is checked, and its parameters
counted against the memory they would take, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrain.checkpoint.host_memory import available_host_bytes
from dtrain.checkpoint.integrity import check_checkpoint
from dtrain.checkpoint.layout import latest_complete
from dtrain.checkpoint.manifest import read_manifest
from dtrain.config import (
    DataConfig,
    ModelConfig,
    TrainConfig,
    TrainerConfig,
    build_dataclass,
    validate,
)
from dtrain.errors import CheckpointError, ConfigError
from dtrain.model import GPT, rope_tables

MODEL_KEY = "model"  # the model's part of the DCP state dict (Strategy.state_dict)


@dataclass
class LoadedCheckpoint:
    model: GPT
    model_cfg: ModelConfig
    data_cfg: DataConfig
    manifest: dict


def _config_from(cls: type, values: dict, what: str) -> typing.Any:
    """A dataclass from a saved dict, each value of its field's type; keys this version does
    not know are ignored (a newer checkpoint may carry more settings than the model needs)."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return build_dataclass(cls, {k: v for k, v in values.items() if k in names}, f"{what}.")
    except ConfigError as e:
        raise CheckpointError(f"the {what} config in the manifest is unusable: {e}") from None


def check_model_config(path: Path, cfg: ModelConfig) -> None:
    """The saved model config passes the checks a run's config does (a run of it at its
    longest sequence), or one line naming the bad field."""
    try:
        validate(TrainConfig(model=cfg, trainer=TrainerConfig(seq_len=cfg.max_seq_len)))
    except ConfigError as e:
        raise CheckpointError(
            f"checkpoint {path}: the model config in manifest.json: {e}"
        ) from None


def check_fits(path: Path, cfg: ModelConfig, device: torch.device | str) -> None:
    """Refuse, before allocating, a model whose weights and RoPE tables would not fit in the
    memory free on `device` (the planner's parameter shapes)."""
    from dtrain.memory.state import param_shapes

    bytes_per = torch.get_default_dtype().itemsize
    need = sum(math.prod(s) for s in param_shapes(cfg)) * bytes_per
    need += cfg.max_seq_len * cfg.head_dim * 4  # rope_tables: (T, hs/2, 2) fp32
    device = torch.device(device)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        have = available_host_bytes()
    if have is not None and need > have:
        raise CheckpointError(
            f"checkpoint {path}: its model ({cfg.n_layer} layers, d_model {cfg.d_model}, "
            f"vocab {cfg.vocab_size}) needs {need / 2**30:.1f} GiB for its weights on {device} "
            f"and {have / 2**30:.1f} GiB are free; refused to allocate it"
        )


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run dir (its newest complete checkpoint)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        latest = latest_complete(path / "checkpoints")
        if latest is None:
            raise CheckpointError(f"run dir {path} holds no complete checkpoint")
        return latest
    read_manifest(path)  # exists and complete, or a one-line error
    return path


def checkpoint_configs(path: Path) -> tuple[ModelConfig, DataConfig, dict]:
    """The model and data configs a checkpoint was trained with, and its manifest."""
    manifest = read_manifest(Path(path))
    config = manifest.get("config")
    if not isinstance(config, dict) or "model" not in config:
        raise CheckpointError(
            f"checkpoint {path}: manifest.json has no run config (saved by an older dtrain?)"
        )
    model_cfg = _config_from(ModelConfig, config["model"], "model")
    data_cfg = _config_from(DataConfig, config.get("data", {}), "data")
    if model_cfg.vocab_size is None:
        raise CheckpointError(f"checkpoint {path}: the saved model config has no vocab_size")
    check_model_config(Path(path), model_cfg)
    return model_cfg, data_cfg, manifest


def saved_keys(path: Path, manifest: dict) -> set[str]:
    """Names of the tensors in a DCP checkpoint (from its .metadata index, read safely)."""
    from dtrain.checkpoint.safe_load import load_metadata

    return set(load_metadata(path, manifest["files"]).state_dict_metadata)


def empty_model(cfg: ModelConfig, device: torch.device | str) -> GPT:
    """The model with uninitialised weights (they are about to be loaded: drawing a random
    init for billions of parameters would only waste time) and its RoPE tables."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.rope_cache = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
    return model


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> LoadedCheckpoint:
    """Build the checkpoint's model on `device` and load its weights (any strategy, any world
    size). Only the model is read; optimizer shards stay on disk."""
    from dtrain.checkpoint.safe_load import load_into

    path = Path(path)
    model_cfg, data_cfg, manifest = checkpoint_configs(path)
    check_checkpoint(path, manifest)
    # The weights come from the checkpoint: never re-import the run's starting point.
    model_cfg = dataclasses.replace(model_cfg, init_from=None)
    check_fits(path, model_cfg, device)
    model = empty_model(model_cfg, device)
    state = {MODEL_KEY: model.state_dict()}  # tensors share storage with the parameters
    have = saved_keys(path, manifest)
    missing = sorted(f"{MODEL_KEY}.{k}" for k in state[MODEL_KEY] if f"{MODEL_KEY}.{k}" not in have)
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} model tensors (first: {missing[0]}); "
            "it was not saved by dtrain's Strategy.state_dict"
        )
    load_into(path, state, manifest["files"])
    # DCP loads in place into the state dict's tensors, which are the parameters; should it
    # ever hand back a new tensor instead, copy it in.
    params = dict(model.named_parameters(remove_duplicate=False))
    for k, t in state[MODEL_KEY].items():
        if k in params and t.data_ptr() != params[k].data_ptr():
            params[k].data.copy_(t)
    model.eval()
    return LoadedCheckpoint(model, model_cfg, data_cfg, manifest)


def load_hf_model(hf_dir: str | Path, device: torch.device | str = "cpu") -> GPT:
    """A Hugging Face Llama directory (an export) as our model on `device`, in eval mode."""
    from dtrain.hf import load_hf_into, model_config_from_hf

    cfg = model_config_from_hf(hf_dir)
    check_fits(Path(hf_dir), cfg, device)
    model = empty_model(cfg, device)
    load_hf_into(model, hf_dir)
    model.eval()
    return model


def consolidate(path: str | Path, out_file: str | Path) -> Path:
    """Write a (possibly sharded) DCP checkpoint as one torch.save file: {"model": ..., "optim":
    ..., "manifest": ...}, loadable with torch.load(weights_only=True) on one process."""
    from dtrain.checkpoint.safe_load import load_all

    path, out_file = Path(path), Path(out_file)
    manifest = read_manifest(path)
    check_checkpoint(path, manifest)
    # Not dcp_to_torch_save: it unpickles the pickled items with weights_only off.
    state = load_all(path, manifest["files"])
    state["manifest"] = manifest  # the run config and step make the file self-describing
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_file)
    return out_file

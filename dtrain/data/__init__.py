"""Data: sources, tokenizers, packing into blocks, per-rank batches with an exact position.

build_data(cfg) -> DataBundle(train, evals, tokenizer, vocab_size, weights); the loop reads
training batches through BatchStream(bundle.train, ...) and each source's eval batches through
eval_batches(bundle.evals[name]). One source is a mixture of one (mixture.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dtrain.config import DataConfig
from dtrain.data.loader import (
    BatchStream,
    EvalBlocks,
    SyntheticBlocks,
    TrainStreams,
    eval_batches,
    sharing_note,
)
from dtrain.data.mixture import GroupSpec, Mixture
from dtrain.data.sources import SOURCES, SourceSpec, build_source_spec, check_source, open_records
from dtrain.data.stream import StreamSpec, classify, is_heldout
from dtrain.data.tokenizer import build_tokenizer, default_cache_dir, padded_vocab
from dtrain.errors import ConfigError

log = logging.getLogger("dtrain")


@dataclass
class DataBundle:
    train: object  # TrainStreams | SyntheticBlocks
    evals: dict  # source name -> EvalBlocks | SyntheticBlocks, in the mixture's order
    tokenizer: object | None
    vocab_size: int  # the tokenizer's vocab, padded for the model's embedding
    weights: dict[str, float]  # source name -> its share of the training blocks

    @property
    def eval(self):
        """The first source's eval blocks (the only source's, without a mixture)."""
        return next(iter(self.evals.values()))

    @property
    def mixed(self) -> bool:
        """Several sources: each has its own eval loss beside the mixture's."""
        return len(self.weights) > 1


@dataclass(frozen=True)
class Part:
    """One source of the run, resolved: its documents, its eval set and its weight."""

    name: str
    weight: float
    spec: SourceSpec
    eval_spec: SourceSpec | None  # a held-out split (None: hold out documents)
    holdout: float  # share of documents held out (0 with an eval split)


def parts_of(cfg: DataConfig) -> list[Part]:
    """The run's sources: data.mixture's, or the one source of data.source. Resolves files;
    opens nothing."""
    if not cfg.mixture:
        return [_part(cfg, cfg.name, 1.0)]
    parts = []
    for src in cfg.mixture:
        one = replace(cfg, mixture=[], **{k: v for k, v in asdict(src).items() if k != "weight"})
        parts.append(_part(one, src.name, src.weight))
    return parts


def _part(cfg: DataConfig, name: str, weight: float) -> Part:
    spec = build_source_spec(cfg)
    eval_spec = _eval_spec(cfg, spec)
    return Part(name, weight, spec, eval_spec, 0.0 if eval_spec else cfg.eval_fraction)


def _training_texts(spec: SourceSpec, holdout: float, max_bytes: int):
    """Documents for training a tokenizer: training documents only, up to max_bytes."""
    total = 0
    for rec in open_records(spec):
        text = rec.get(spec.text_field)
        if classify(text) is not None or is_heldout(text, holdout):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def _share_from_rank0(obj):
    """rank 0's obj on every rank (a collective under torchrun; identity alone)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def build_data(
    cfg: DataConfig,
    *,
    seq_len: int,
    seed: int,
    device: torch.device,
    is_main: bool = True,
    run_dir: str | None = None,
) -> DataBundle:
    """Check the source and build the tokenizer (one-line errors at start-up), then describe
    the training streams and the eval set. Nothing is read for training until the first step."""
    _check(cfg)
    if cfg.source == "synthetic":
        train = SyntheticBlocks(cfg.vocab_size, seq_len, seed, device)
        evals = {cfg.name: SyntheticBlocks(cfg.vocab_size, seq_len, seed + 1, device)}
        return DataBundle(train, evals, None, padded_vocab(cfg.vocab_size), {cfg.name: 1.0})
    parts = parts_of(cfg)
    for part in parts:
        check_source(part.spec)
        if part.eval_spec is not None:
            check_source(part.eval_spec)

    if cfg.num_workers > 0:
        # Each worker tokenizes on its own core; Rust threads inside every worker would
        # oversubscribe them (and tokenizers warns after a fork).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = _tokenizer(cfg, parts, is_main=is_main, share=_share_from_rank0)
    if run_dir and is_main and getattr(tokenizer, "tok", None) is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.tok.save(str(Path(run_dir) / "tokenizer.json"))  # the run's own copy

    specs = []
    for part in parts:
        specs.append(
            StreamSpec(
                part.spec,
                tokenizer,
                seq_len,
                cfg.num_streams,
                seed,
                cfg.shuffle_window,
                part.holdout,
            )
        )
        _say_sharding(part, cfg.num_streams)
    mix = Mixture.of({p.name: p.weight for p in parts}, seed)
    train = TrainStreams(
        GroupSpec(tuple(specs), mix, cfg.on_exhausted),
        cfg.num_workers,
        cfg.prefetch_factor,
        named=bool(cfg.mixture),
    )
    evals = {
        p.name: EvalBlocks(
            StreamSpec(p.eval_spec or p.spec, tokenizer, seq_len, 1, seed, 1, p.holdout), p.holdout
        )
        for p in parts
    }
    log.debug(
        "data: %s | tokenizer %s (vocab %d) | %d streams, %d workers per rank",
        ", ".join(p.name for p in parts),
        cfg.tokenizer,
        tokenizer.vocab_size,
        cfg.num_streams,
        cfg.num_workers,
    )
    weights = dict(zip(mix.names, mix.weights))
    return DataBundle(train, evals, tokenizer, padded_vocab(tokenizer.vocab_size), weights)


def _say_sharding(part: Part, num_streams: int) -> None:
    n_shards = open_records(part.spec).n_shards
    if n_shards % num_streams:
        # debug, not info: start-up errors must stay the only line on stderr
        log.debug(
            "source %s has %d shards, not a multiple of data.num_streams=%d: every stream "
            "reads all records and keeps every %d-th",
            part.name,
            n_shards,
            num_streams,
            num_streams,
        )


def _check(cfg: DataConfig) -> None:
    """The values of `cfg` that the data, rather than the schema's ranges, constrains."""
    if cfg.source not in SOURCES:
        raise ConfigError(
            f"unknown data.source '{cfg.source}'; valid choices: {', '.join(SOURCES)}"
        )
    if cfg.source == "synthetic":
        if not cfg.vocab_size or cfg.vocab_size < 2:
            raise ConfigError(
                f"data.vocab_size must be >= 2 for synthetic data, got {cfg.vocab_size}"
            )
        return
    for key in ("num_streams", "shuffle_window", "prefetch_factor", "bpe_train_bytes"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"data.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {cfg.num_workers}")


def _eval_spec(cfg: DataConfig, spec: SourceSpec) -> SourceSpec | None:
    """data.eval_split: a held-out split of a hub dataset (None: hold out documents)."""
    if not cfg.eval_split:
        return None
    if spec.kind != "hub":
        raise ConfigError(
            "data.eval_split is for hub datasets; local data holds out "
            "data.eval_fraction of its documents"
        )
    return SourceSpec("hub", spec.text_field, spec.path, spec.name, cfg.eval_split)


def _tokenizer(cfg: DataConfig, parts: list[Part], *, is_main: bool, share):
    """The one tokenizer every source shares (a BPE is trained on all of them, by weight)."""
    if len(parts) == 1:
        p = parts[0]
        key = f"{p.spec.key()}|holdout={p.holdout}"
    else:
        key = "mixture|" + "|".join(
            f"{p.name}:{p.weight}:{p.spec.key()}|holdout={p.holdout}" for p in parts
        )
    total = sum(p.weight for p in parts)

    def texts():
        for p in parts:
            budget = max(1, int(cfg.bpe_train_bytes * p.weight / total))
            yield from _training_texts(p.spec, p.holdout, budget)

    return build_tokenizer(
        cfg.tokenizer,
        vocab_size=cfg.vocab_size,
        train_texts=texts,
        data_key=key,
        train_bytes=cfg.bpe_train_bytes,
        cache_dir=Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir(),
        is_main=is_main,
        share=share,
    )


def tokenizer_for(cfg: DataConfig):
    """The tokenizer a data config trains with, in one process (generation and export need it):
    the cached BPE of the run's data when there is one. None for synthetic data, whose tokens
    mean nothing."""
    if cfg.source == "synthetic":
        return None
    return _tokenizer(cfg, parts_of(cfg), is_main=True, share=lambda text: text)


def data_note(cfg: DataConfig, world_size: int) -> str | None:
    """One line on what these data settings cost or refuse at this world size, without
    opening the data (the planner prints it; it never stops a plan). None: nothing to say."""
    from dtrain.errors import UserError

    try:
        _check(cfg)
    except UserError as e:
        return f"the run would stop at start-up: {e}"
    if cfg.source == "synthetic":
        return None
    return sharing_note(cfg.num_streams, world_size)


__all__ = [
    "BatchStream",
    "DataBundle",
    "Mixture",
    "build_data",
    "data_note",
    "eval_batches",
    "tokenizer_for",
]

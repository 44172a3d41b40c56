"""Data: sources, tokenizers, packing into blocks, per-rank batches with an exact position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtrain.config import DataConfig
from dtrain.data.loader import BatchStream, SyntheticBlocks, TokenBlocks, eval_batches
from dtrain.data.tokenizer import ByteTokenizer, padded_vocab
from dtrain.errors import ConfigError, DataError

SOURCES = ("embedded", "synthetic")
TOKENIZERS = ("byte",)


@dataclass
class DataBundle:
    train: object  # TokenBlocks | SyntheticBlocks
    eval: object
    tokenizer: object | None
    vocab_size: int  # the tokenizer's vocab, padded for the model's embedding


def _tokenize_documents(docs: list[str], tokenizer) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eot_id)  # documents are joined by end-of-text: no padding
    return torch.tensor(ids, dtype=torch.int32)


def build_data(cfg: DataConfig, *, seq_len: int, seed: int, device: torch.device) -> DataBundle:
    if cfg.source not in SOURCES:
        raise ConfigError(
            f"unknown data.source '{cfg.source}'; valid choices: {', '.join(SOURCES)}"
        )
    if cfg.source == "synthetic":
        if not cfg.vocab_size or cfg.vocab_size < 2:
            raise ConfigError(
                f"data.vocab_size must be >= 2 for synthetic data, got {cfg.vocab_size}"
            )
        train = SyntheticBlocks(cfg.vocab_size, seq_len, seed, device)
        evals = SyntheticBlocks(cfg.vocab_size, seq_len, seed + 1, device)
        return DataBundle(train, evals, None, padded_vocab(cfg.vocab_size))
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(
            f"unknown data.tokenizer '{cfg.tokenizer}'; valid choices: {', '.join(TOKENIZERS)}"
        )
    from dtrain.data.embedded import load_embedded_documents

    tokenizer = ByteTokenizer()
    tokens = _tokenize_documents(load_embedded_documents(cfg.max_bytes), tokenizer)
    n_eval = max(seq_len + 1, int(tokens.numel() * cfg.eval_fraction))
    if n_eval >= tokens.numel() - seq_len:
        raise DataError(
            f"the corpus ({tokens.numel()} tokens) is too small to hold out "
            f"{n_eval} eval tokens and still train on blocks of {seq_len}"
        )
    # The tail is held out: training never sees it.
    train = TokenBlocks(tokens[:-n_eval], seq_len, "training split")
    evals = TokenBlocks(tokens[-n_eval:], seq_len, "eval split")
    return DataBundle(train, evals, tokenizer, padded_vocab(tokenizer.vocab_size))


def build_tokenizer(cfg: DataConfig):
    """The tokenizer a data config trains with, without reading any data (generation and
    export need it); None for synthetic data, whose tokens mean nothing."""
    if cfg.source == "synthetic":
        return None
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(
            f"unknown data.tokenizer '{cfg.tokenizer}'; valid choices: {', '.join(TOKENIZERS)}"
        )
    return ByteTokenizer()


__all__ = ["BatchStream", "DataBundle", "build_data", "build_tokenizer", "eval_batches"]

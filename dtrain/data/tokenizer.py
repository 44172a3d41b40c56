"""Tokenizers: built-in bytes, any Hugging Face `tokenizers` tokenizer, or BPE trained on the data.

data.tokenizer=byte       every UTF-8 byte is a token, plus end-of-text (no files, no download)
data.tokenizer=bpe        byte-level BPE of data.vocab_size (default 8192) trained on the training
                          split, cached
data.tokenizer=NAME|PATH  a tokenizer.json file, a folder holding one, or a hub name (gpt2, ...)

Every tokenizer has an end-of-text id that joins documents when packing. The model's embedding
has `padded_vocab(tokenizer.vocab_size)` rows.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError, DataError
from dtrain.reliability.safe_write import staged

log = logging.getLogger("dtrain")

VOCAB_MULTIPLE = 64  # pad the embedding to a multiple of 64 rows: tensor cores like it
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BPE_VERSION = 1  # bump when the trainer's settings change, to invalidate cached tokenizers
# data.tokenizer=bpe with no data.vocab_size: the vocab of conf/data/tinystories.yaml and of the
# data benchmark (docs/benchmarks.md), and a multiple of 64, so the embedding has no padded rows.
BPE_DEFAULT_VOCAB = 8192


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return multiple * ((n + multiple - 1) // multiple)


@dataclass(frozen=True)
class ByteTokenizer:
    name: str = "byte"
    eot_id: int = 256

    @property
    def vocab_size(self) -> int:
        return 257  # 256 byte values + end-of-text

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (picklable, so DataLoader workers get their own copy)."""

    def __init__(self, tok, name: str):
        self.tok, self.name = tok, name
        vocab = tok.get_vocab(with_added_tokens=True)
        eot = next((vocab[t] for t in EOT_CANDIDATES if t in vocab), None)
        n = tok.get_vocab_size(with_added_tokens=True)
        # No end-of-text token in the vocab: use one id past it (the model's embedding has it).
        self.eot_id = eot if eot is not None else n
        self.vocab_size = n if eot is not None else n + 1

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) != self.eot_id])


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "data.tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    return tokenizers


def load_hf_tokenizer(name: str) -> HFTokenizer:
    """A tokenizer.json file, a folder with one, or a hub name; DataError if none is found."""
    tk = _tokenizers()
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"data.tokenizer folder '{name}' holds no tokenizer.json")
    if path.is_file():
        try:
            return HFTokenizer(tk.Tokenizer.from_file(str(path)), name)
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"data.tokenizer file '{name}' is not a tokenizer: {msg}") from None
    try:
        return HFTokenizer(tk.Tokenizer.from_pretrained(name), name)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"data.tokenizer '{name}' not found: not byte or bpe, not a tokenizer.json file or "
            f"folder, and not on the hub ({msg[:200]})"
        ) from None


def default_cache_dir() -> Path:
    return Path(os.environ.get("DTRAIN_CACHE", "~/.cache/dtrain")).expanduser()


def bpe_cache_path(cache_dir: Path, data_key: str, vocab_size: int, train_bytes: int) -> Path:
    """Keyed by the data, the vocab and the training budget: same inputs, same file."""
    key = f"{BPE_VERSION}|{data_key}|{vocab_size}|{train_bytes}"
    return (
        cache_dir
        / "tokenizers"
        / f"bpe-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    )


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization) with <|endoftext|> as its only special."""
    tk = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(
    name: str,
    *,
    vocab_size: int | None,
    train_texts: Callable[[], Iterable[str]],
    data_key: str,
    train_bytes: int,
    cache_dir: Path,
    is_main: bool,
    share: Callable[[str | None], str],
):
    """The tokenizer named by data.tokenizer. For bpe: rank 0 trains it (or finds it in the
    cache) and `share` sends its JSON to every other rank, so nodes need no shared folder."""
    if name == "byte":
        return ByteTokenizer()
    if name != "bpe":
        return load_hf_tokenizer(name)
    vocab_size = BPE_DEFAULT_VOCAB if vocab_size is None else vocab_size
    if vocab_size < 260:
        raise ConfigError(
            f"data.vocab_size={vocab_size}: the bpe tokenizer needs a vocab of at least 260 "
            "(256 bytes + end-of-text + merges)"
        )
    path = bpe_cache_path(cache_dir, data_key, vocab_size, train_bytes)
    if is_main:
        if not path.is_file():
            log.info(
                "training a BPE tokenizer (vocab %d) on up to %d bytes of the training data",
                vocab_size,
                train_bytes,
            )
            tok = train_bpe(train_texts(), vocab_size)
            # Staged and renamed: a concurrent run never reads half a file, and a link
            # planted at the cache's name is refused, never written through.
            with staged(path, overwrite=True) as tmp:
                tok.save(str(tmp))
            log.info("saved the BPE tokenizer to %s", path)
        text = path.read_text()
    else:
        text = None
    text = share(text)
    out = HFTokenizer(_tokenizers().Tokenizer.from_str(text), "bpe")
    out.path = str(path)
    return out

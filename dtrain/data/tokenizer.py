"""Tokenizers. The built-in one is byte-level: every UTF-8 byte is a token, plus end-of-text.

It needs no files and no download, so the default run trains anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB_MULTIPLE = 64  # pad the embedding to a multiple of 64 rows: tensor cores like it


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

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

"""The embedded default corpus: the Python standard library's own source files.

They are present wherever Python is, need no download, and are real text with structure a small
model visibly learns (indentation, keywords, names), so the default run works offline. Each file
is cut into documents at its top-level statements and methods: enough documents to shard across
streams and to hold some out for eval.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dtrain.errors import DataError

# A blank line before a top-level statement or a method: a natural unit of code.
_UNIT = re.compile(r"\n\n+(?=\S|    def |    async def |    @)")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Top-level modules only, sorted: a fixed, version-stable order (about 4.7 MB on 3.11).
    return sorted(p for p in root.glob("*.py") if p.is_file())


def embedded_shards(max_bytes: int | None = None) -> list[str]:
    """The files of the corpus (one shard each), up to about max_bytes of text."""
    out, total = [], 0
    for path in stdlib_files():
        size = path.stat().st_size
        if size == 0:
            continue
        out.append(str(path))
        total += size
        if max_bytes is not None and total >= max_bytes:
            break
    if not out:
        raise DataError(
            f"the embedded corpus is empty: no .py files under {sysconfig.get_paths()['stdlib']}"
        )
    return out


def shard_groups(paths: list[str]) -> list[list[str]]:
    """Files dealt into 8/16/32/64 shards when there are enough of them (at least 4 per shard):
    split_dataset_by_node then hands each stream whole shards instead of every n-th record."""
    for n in (64, 32, 16, 8):
        if len(paths) >= 4 * n:
            return [paths[i::n] for i in range(n)]
    return [[p] for p in paths]


def documents_of(paths: list[str]) -> Iterator[str]:
    """Documents of the given files: one per top-level statement or method."""
    for path in paths:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        for doc in _UNIT.split(text):
            if doc.strip():
                yield doc + "\n"

"""The embedded default corpus: the Python standard library's own source files.

They are present wherever Python is, need no download, and are real text with structure a small
model visibly learns (indentation, keywords, names), so the default run works offline.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from dtrain.errors import DataError


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # Top-level modules only, sorted: a fixed, version-stable order (about 4.7 MB on 3.11).
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_embedded_documents(max_bytes: int | None = None) -> list[str]:
    docs, total = [], 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    if not docs:
        raise DataError(
            f"the embedded corpus is empty: no .py files under {sysconfig.get_paths()['stdlib']}"
        )
    return docs

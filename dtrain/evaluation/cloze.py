"""stdlib_cloze: the next name in held-out code of the embedded default corpus.

Each item is a stretch of a document of the Python standard library's source (the embedded
default data, dtrain/data/embedded.py) that ends just before a name; the choices are that name
and three names drawn from the same documents. The documents are ones every run with
data.eval_fraction >= DataConfig's default holds out (the held-out set grows with the
fraction), so a run on the default data never trains on them. The text is read from this
machine's Python installation, nothing is downloaded or shipped, and it is under the Python
Software Foundation License; items differ between Python versions, as the corpus does.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from dtrain.config import DataConfig
from dtrain.data.embedded import documents_of, embedded_shards
from dtrain.data.stream import classify, is_heldout
from dtrain.errors import DataError
from dtrain.evaluation.items import Item, shuffled_item

HOLDOUT = DataConfig().eval_fraction  # held out by every run at this fraction or above
CONTEXT_CHARS = 240  # the context: up to this much text before the name, from a line start
MIN_CONTEXT = 40  # names this close to their document's start have too little before them
N_CHOICES = 4
NAME = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")


def heldout_documents() -> list[str]:
    return [
        d for d in documents_of(embedded_shards()) if classify(d) is None and is_heldout(d, HOLDOUT)
    ]


def _context(doc: str, at: int) -> str:
    start = max(0, at - CONTEXT_CHARS)
    if start > 0:  # begin at a line start, not mid-word
        start = doc.find("\n", start, at) + 1 or start
    return doc[start:at]


def stdlib_cloze(n: int, seed: int) -> list[Item]:
    docs = heldout_documents()
    spots = [
        (d, m) for d, doc in enumerate(docs) for m in NAME.finditer(doc) if m.start() >= MIN_CONTEXT
    ]
    counts = Counter(m.group() for _, m in spots)
    vocab = sorted(w for w, c in counts.items() if c >= 3)  # names common enough to be tempting
    if len(spots) < n or len(vocab) <= N_CHOICES:
        raise DataError(
            f"downstream task stdlib_cloze: the held-out standard library documents give "
            f"{len(spots)} items, fewer than downstream.items={n}"
        )
    rng = random.Random(f"stdlib_cloze-{seed}")
    out = []
    for d, m in rng.sample(spots, n):
        word = m.group()
        wrong = []
        while len(wrong) < N_CHOICES - 1:
            w = rng.choice(vocab)
            if w != word and w not in wrong:
                wrong.append(w)
        out.append(shuffled_item(_context(docs[d], m.start()), word, wrong, rng))
    return out

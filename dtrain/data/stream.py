"""One token stream: records -> window shuffle -> tokenize -> pack into blocks, with its position.

The data is cut into `n_streams` streams by `datasets.distributed.split_dataset_by_node` (whole
shards when the shard count divides evenly, else every n-th record): each record belongs to
exactly one stream. A stream reads its records in windows of `window` records, permutes each
window with a generator seeded by (seed, stream, epoch, window), tokenizes, joins documents with
end-of-text and cuts blocks of seq_len + 1 tokens (inputs and shifted targets) with a stride of
seq_len: every token is an input exactly once, nothing is padded. At the end of a finite source
the stream starts the next epoch (a new permutation) and packing carries on across the seam, or,
with `repeat` off, ends.

The position after a block is small and exact: the source's own `state_dict()` at the start of
the current window, the window's index, (record in window, token in record) of the block's
last token, which is the next block's first, and the count of blocks the stream has made.
Resuming re-reads at most one window of records (without tokenizing them) and one document,
never the stream from its start.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

from dtrain.data.sources import SourceSpec, open_records
from dtrain.errors import DataError

SKIP_KINDS = ("empty", "not_text", "invalid_utf8")


@dataclass(frozen=True)
class StreamSpec:
    """Everything a DataLoader worker needs to rebuild its streams (picklable)."""

    source: SourceSpec
    tokenizer: object
    seq_len: int
    n_streams: int
    seed: int
    window: int  # records per shuffle window
    holdout: float  # share of documents held out for eval (0: the eval set is another split)
    repeat: bool = True  # at the end of the data: another epoch (False: the stream ends)


def is_heldout(text: str, fraction: float) -> bool:
    """A deterministic holdout by content: the same document is held out in every run, on every
    rank, whatever the sharding, and its duplicates with it (no train/eval leakage)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def start_state() -> dict:
    # j: the index in this stream of its next block (ranks that share a stream keep every n-th)
    return {"epoch": 0, "win": None, "w": 0, "i": 0, "off": 0, "j": 0}


def classify(text) -> str | None:
    """Why a record is skipped (one of SKIP_KINDS), or None when it is a usable document."""
    if not isinstance(text, str):
        return "not_text"
    if not text.strip():
        return "empty"
    if "\ufffd" in text:  # invalid UTF-8 decoded with errors="replace"
        return "invalid_utf8"
    return None


def _records(spec: StreamSpec, stream: int):
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(open_records(spec.source), rank=stream, world_size=spec.n_streams)


def stream_blocks(spec: StreamSpec, stream: int, state: dict) -> Iterator[tuple[list, dict, dict]]:
    """Yield (block of seq_len + 1 token ids, position after it, skip counts since the last
    block) forever, starting at `state`. Raises DataError when a whole epoch holds no token."""
    field, T, eot = spec.source.text_field, spec.seq_len, spec.tokenizer.eot_id
    epoch, win_state, w = state["epoch"], state["win"], state["w"]
    i0, off0, j = state["i"], state["off"], state.get("j", 0)
    buf: list[int] = []
    skips = dict.fromkeys(SKIP_KINDS, 0)
    while True:
        fresh = win_state is None and i0 == 0 and off0 == 0  # this epoch starts at its start
        ds = _records(spec, stream)
        if win_state is not None:
            ds.load_state_dict(win_state)
        epoch_tokens = 0
        for batch in ds.iter(batch_size=spec.window):
            after = ds.state_dict()  # where the next window starts
            texts = batch.get(field)
            if texts is None:
                raise DataError(
                    f"records have no field '{field}' (data.text_field); their fields: "
                    + ", ".join(batch)
                )
            order = list(range(len(texts)))
            random.Random(f"{spec.seed}/{stream}/{epoch}/{w}").shuffle(order)
            docs: list[tuple[int, str]] = []
            for i in range(i0, len(order)):
                text = texts[order[i]]
                why = classify(text)
                if why is None and is_heldout(text, spec.holdout):
                    continue
                if why is not None:
                    skips[why] += 1
                    continue
                docs.append((i, text))
            encoded = spec.tokenizer.encode_batch([t for _, t in docs]) if docs else []
            for (i, _), ids in zip(docs, encoded):
                ids.append(eot)
                off = off0 if i == i0 else 0
                epoch_tokens += len(ids) - off
                while off < len(ids):
                    take = min(T + 1 - len(buf), len(ids) - off)
                    buf.extend(ids[off : off + take])
                    off += take
                    if len(buf) == T + 1:
                        # The block's last token opens the next block: (i, off - 1).
                        j += 1
                        pos = {
                            "epoch": epoch, "win": win_state, "w": w, "i": i, "off": off - 1, "j": j
                        }  # fmt: skip
                        yield buf, pos, skips
                        skips = dict.fromkeys(SKIP_KINDS, 0)
                        buf = buf[-1:]
            win_state, w, i0, off0 = after, w + 1, 0, 0
        if fresh and epoch_tokens == 0:  # would loop over empty epochs forever
            raise DataError(
                f"data stream {stream} of {spec.n_streams} has no tokens in epoch {epoch}: "
                "fewer usable documents than data.num_streams (lower it), or all of them "
                "empty/held out"
            )
        if not spec.repeat:
            return  # what is left in `buf`, less than a block, is never trained on
        epoch, win_state, w, i0, off0 = epoch + 1, None, 0, 0, 0

"""Tokens trained on per data source, and their realised share beside the mixture's weights.

On a logged step: `data/<source>/tokens` and `data/<source>/share` (TensorBoard, and
`data_tokens` / `data_share` in metrics.jsonl); once at least CHECK_AFTER blocks are trained
on, a share further than data.share_tolerance from its weight is said once.
"""

from __future__ import annotations

import logging

from dtrain.data.mixture import CHUNK

log = logging.getLogger("dtrain")

# The order holds the weights to one block per whole chunk of CHUNK blocks; within one chunk a
# share drifts by a few blocks, which ten chunks make negligible next to a tolerance of 1%.
CHECK_AFTER = 10 * CHUNK


class SourceReport:
    def __init__(self, run):
        self.run = run
        self.warned = False

    def report(self, step: int, info: dict) -> dict:
        """The step's per-source scalars; adds data_tokens and data_share to `info`. A
        collective (every rank calls it on a logged step); nothing for one source."""
        r = self.run
        if not r.data.mixed:
            return {}
        blocks = r.stream.source_blocks()
        total = max(sum(blocks.values()), 1)
        tokens = {n: b * r.cfg.trainer.seq_len for n, b in blocks.items()}
        share = {n: b / total for n, b in blocks.items()}
        info["data_tokens"], info["data_share"] = tokens, share
        if total >= CHECK_AFTER:
            self._check(share)
        scalars = {}
        for n in blocks:
            scalars[f"data/{n}/tokens"] = tokens[n]
            scalars[f"data/{n}/share"] = share[n]
        return scalars

    def _check(self, share: dict[str, float]) -> None:
        d = self.run.cfg.data
        weights = self.run.data.weights
        off = {n: s for n, s in share.items() if abs(s - weights[n]) > d.share_tolerance}
        if not off or self.warned:
            return
        self.warned = True
        name, s = max(off.items(), key=lambda kv: abs(kv[1] - weights[kv[0]]))
        why = (
            "a source ran out and its share went to the others"
            if d.on_exhausted == "reweight"
            else "the sources' positions came from a run with other weights"
        )
        log.warning(
            "data source '%s' is %.1f%% of the blocks trained on, its weight %.1f%% "
            "(data.share_tolerance=%g): %s",
            name,
            100 * s,
            100 * weights[name],
            d.share_tolerance,
            why,
        )

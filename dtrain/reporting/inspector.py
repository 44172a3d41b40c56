"""What each eval shows of the model's inside: sampled text and attention maps, to TensorBoard.

    samples/<j>            text continued from inspect.prompts[j] (fixed seed: the same draws at
                           every eval, so the text changes only because the model did)
    attention/layer_<i>    one image per layer: a grid of heads, each the (query x key) matrix of
                           attention weights on inspect.attention_prompt, viridis from 0 to 1
    attention/prompt       the tokens along both axes

The plain model (Strategy.unwrapped) runs the forwards. Where its parameters are sharded (FSDP's
DTensors, ZeRO-3's partitions) each forward gathers them from every rank, so every rank runs the
same forwards in lockstep, for the same number of tokens; rank 0 alone writes. Otherwise rank 0
runs them alone and the other ranks skip ahead.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from dtrain.config import InspectConfig
from dtrain.generate import SamplingConfig, generate

log = logging.getLogger("dtrain")

# matplotlib's viridis at 0, 0.1, ..., 1; linear interpolation between them stays within a few
# levels of 255 of the full table, and needs no matplotlib.
VIRIDIS = np.array(
    [
        [0.267004, 0.004874, 0.329415],
        [0.282623, 0.140926, 0.457517],
        [0.253935, 0.265254, 0.529983],
        [0.206756, 0.371758, 0.553117],
        [0.163625, 0.471133, 0.558148],
        [0.127568, 0.566949, 0.550556],
        [0.134692, 0.658636, 0.517649],
        [0.266941, 0.748751, 0.440573],
        [0.477504, 0.821444, 0.318195],
        [0.741388, 0.873449, 0.149561],
        [0.993248, 0.906157, 0.143936],
    ],
    dtype=np.float32,
)


def colormap(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1], shape (H, W) -> RGB uint8 (3, H, W) through viridis."""
    v = np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0) * (len(VIRIDIS) - 1)
    lo = np.floor(v).astype(np.int64).clip(0, len(VIRIDIS) - 2)
    frac = (v - lo)[..., None]
    rgb = VIRIDIS[lo] * (1 - frac) + VIRIDIS[lo + 1] * frac  # (H, W, 3)
    return (rgb * 255 + 0.5).astype(np.uint8).transpose(2, 0, 1)


def head_grid(weights: torch.Tensor, scale: int = 4, gap: int = 2) -> np.ndarray:
    """Attention weights of one layer (nh, T, T) -> one RGB image (3, H, W): the heads on a
    near-square grid, each map upscaled by `scale`, separated by white lines `gap` wide."""
    nh, T, S = weights.shape
    cols = math.ceil(math.sqrt(nh))
    rows = math.ceil(nh / cols)
    h, w = T * scale, S * scale
    img = np.full((3, rows * (h + gap) - gap, cols * (w + gap) - gap), 255, dtype=np.uint8)
    maps = weights.detach().float().cpu().numpy()
    for head in range(nh):
        r, c = divmod(head, cols)
        tile = colormap(maps[head]).repeat(scale, axis=1).repeat(scale, axis=2)
        img[:, r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = tile
    return img


def is_sharded(module: nn.Module) -> bool:
    """Whether a forward of `module` needs every rank (its parameters are split across them)."""
    for p in module.parameters():
        if hasattr(p, "placements") or getattr(p, "ds_id", None) is not None:
            return True
    return False


class Inspector:
    """Called by the loop at every eval (on every rank); a no-op when nothing is enabled."""

    def __init__(self, cfg: InspectConfig, strategy, tokenizer, writer, env):
        self.cfg, self.strategy, self.tokenizer = cfg, strategy, tokenizer
        self.writer, self.env = writer, env
        self.enabled = (cfg.samples or cfg.attention_maps) and tokenizer is not None
        if (cfg.samples or cfg.attention_maps) and tokenizer is None and env.is_main:
            log.info("inspect: no tokenizer (synthetic data): no samples or attention maps")

    def _runs_here(self, model: nn.Module) -> bool:
        return self.env.is_main or is_sharded(model)

    def _autocast(self):
        return self.strategy.precision.autocast(self.env.device)

    @torch.no_grad()
    def on_eval(self, step: int, skip_reason: str | None = None) -> None:
        """Log samples and attention maps at `step` (every rank calls it)."""
        if not self.enabled:
            return
        skip_reason = skip_reason or self.strategy.inspect_note
        if skip_reason is not None:
            if self.env.is_main:
                log.info("inspect: no samples or attention maps at step %d (%s)", step, skip_reason)
            return
        model = self.strategy.unwrapped()
        if not self._runs_here(model):
            return
        if self.cfg.samples and self.cfg.prompts and self.cfg.max_new_tokens > 0:
            self.log_samples(model, step)
        if self.cfg.attention_maps:
            self.log_attention(model, step)

    def _encode(self, text: str, limit: int) -> list[int]:
        ids = self.tokenizer.encode(text)[:limit]
        return ids or [self.tokenizer.eot_id]

    def sample_texts(self, model: nn.Module) -> list[str]:
        """One continuation per prompt; the same number of forwards on every rank."""
        c = self.cfg
        sampling = SamplingConfig(
            max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p
        )
        limit = model.cfg.max_seq_len - c.max_new_tokens
        texts = []
        for prompt in c.prompts:
            ids = self._encode(prompt, max(limit, 1))
            x = torch.tensor([ids], dtype=torch.long, device=self.env.device)
            gen = torch.Generator(device=self.env.device)
            gen.manual_seed(c.seed)
            # No early stop at end-of-text: sharded ranks must run the same number of forwards.
            out = generate(model, x, sampling, generator=gen, autocast=self._autocast)
            new = out[0, len(ids) :].tolist()
            eot = getattr(self.tokenizer, "eot_id", None)
            if eot is not None and eot in new:
                new = new[: new.index(eot)]
            texts.append(self.tokenizer.decode(ids + new))
        return texts

    def log_samples(self, model: nn.Module, step: int) -> None:
        texts = self.sample_texts(model)
        for j, (prompt, text) in enumerate(zip(self.cfg.prompts, texts)):
            # Markdown: the sample as a code block, so indentation and newlines survive.
            body = text.replace("```", "`\u200b``")
            self.writer.text(f"samples/{j}", f"prompt `{prompt!r}`\n\n```\n{body}\n```", step)

    def attention_weights(self, model: nn.Module) -> tuple[list[int], list[torch.Tensor]]:
        """Token ids of the attention prompt and, per layer, its weights (nh, T, T)."""
        ids = self._encode(self.cfg.attention_prompt, self.cfg.attention_max_tokens)
        x = torch.tensor([ids], dtype=torch.long, device=self.env.device)
        was_training = model.training
        model.eval()
        try:
            with self._autocast():
                _, weights = model(x, need_weights=True)
        finally:
            model.train(was_training)
        return ids, [w[0] for w in weights]

    def log_attention(self, model: nn.Module, step: int) -> None:
        ids, weights = self.attention_weights(model)
        layers = self.cfg.attention_layers
        if layers is None:
            layers = list(range(len(weights)))
        for i in layers:
            img = head_grid(weights[i], self.cfg.attention_scale)
            self.writer.image(f"attention/layer_{i:02d}", img, step)
        tokens = [self.tokenizer.decode([t]) for t in ids]
        self.writer.text(
            "attention/prompt",
            "rows are queries, columns keys, in this order: "
            + " ".join(f"`{t!r}`" for t in tokens),
            step,
        )

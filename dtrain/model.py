"""A plain Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through SDPA.

Nothing here knows about distribution. Build on the meta device, then materialise:

    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.init_weights()

so that FSDP can shard a model far larger than one device before any weight exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None -> n_head (plain multi-head attention)
    d_model: int = 64
    ffn_hidden: int | None = None  # None -> 8/3 * d_model rounded up to a multiple of 64
    vocab_size: int | None = None  # None -> follows the tokenizer
    max_seq_len: int = 2048
    rope: bool = True
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    init_from: str | None = None  # e.g. "hf:DIR" (see dtrain.cli.export)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes in the input dtype; upcast so bf16 activations normalise in fp32.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos/sin of the rotary angles, shape (T, head_dim // 2, 2), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)  # (T, hs/2)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, nh, T, hs) by the angles in rope (T, hs/2, 2)."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, nh, T, hs/2, 2)
    cos, sin = rope[..., 0], rope[..., 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) of the same positions."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # Causal SDPA takes the flash/cuDNN kernels on GPUs.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    # Linears that read one tensor: fp8's delayed scaling gives them one scale, so that tensor
    # is cast to fp8 once (dtrain/lowp/fp8/delayed.py).
    same_input = ("wq", "wk", "wv")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        # Training's attention (no cache, no weights): swappable for one whose keys come from
        # other ranks too (dtrain/parallel/context.py).
        self.attend = causal_attention

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        need_weights: bool = False,
    ):
        B, T, _ = x.shape
        # Heads counted from the projections (-1): tensor parallelism leaves a share on each rank.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv_cache is None and not need_weights:
            y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
            return self.wo(y), (k, v), None
        if kv_cache is not None:  # decoding: prepend the keys/values of earlier positions
            k = torch.cat([kv_cache[0], k], dim=2)
            v = torch.cat([kv_cache[1], v], dim=2)
        new_cache = (k, v)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        weights = None
        if need_weights:  # explicit softmax so the attention map can be returned
            S = k.shape[2]
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, S)
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            weights = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = weights.type_as(v) @ v
        elif kv_cache is not None and T == 1:
            y = F.scaled_dot_product_attention(q, k, v)  # one query sees every cached key
        else:  # with a cache and T > 1 the causal mask must be offset, so spell it out
            S = k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return self.wo(y), new_cache, weights


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    same_input = ("w1", "w3")  # as Attention.same_input
    # The gate, up and down projections of w2(silu(w1 x) * w3 x), for code that runs the three
    # as one (dtrain/lowp/experimental/int8_swiglu.py) without importing this module.
    swiglu = ("w1", "w3", "w2")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, rope, kv_cache=None, need_weights=False, use_cache=False):
        a, cache, weights = self.attn(self.attn_norm(x), rope, kv_cache, need_weights)
        x = x + a
        x = x + self.ffn(self.ffn_norm(x))
        # The cache's k, v are views; returned from an FSDP block when nobody keeps them, FSDP2
        # warns that an in-place op on a view would skip its hook. Training never keeps them.
        return x, cache if use_cache else None, weights


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 whatever the compute dtype: a bf16 log-softmax
    over 50k classes is too coarse for a loss compared across strategies to 1e-5. Eager, this
    materialises an fp32 copy of the logits and its log-softmax (8 bytes per logit, 6.6 GB for
    the 1b model at micro-batch 8 x 2048); compiled, Inductor fuses the cast into the reduction
    and keeps only the logits and one logsumexp per token for the backward."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # A ModuleDict keyed "0".."L-1" keeps parameter names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        # RoPE angles are a buffer, not a parameter: recomputed by init_weights, never saved.
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)
        # The positions of this process's tokens in a training sequence, where it holds only
        # some (context parallelism: dtrain/parallel/context.py); None: 0..T-1.
        self.positions: torch.Tensor | None = None
        # Swappable: strategies that compile block by block compile the loss on its own
        # (dtrain.strategies.base.compile_blocks), so the fp32 logits never materialise.
        self.loss_fn = lm_loss

    def tie_weights(self) -> None:
        """Share the embedding with the output layer (again after `to_empty`, which unties)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, place=None) -> None:
        """Materialise every weight. Residual projections get std/sqrt(2L) (GPT-2's scaling).

        Each parameter is drawn whole from its own generator (seed + its index), so every
        strategy starts from the same weights however it shards them: `place(param, full)`
        copies the full tensor into a sharded parameter (the FSDP strategy passes one).
        """
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for i, (name, p) in enumerate(self.named_parameters()):
            device = p.device if p.device.type != "meta" else torch.device("cpu")
            if p.ndim == 1:
                full = torch.ones(p.shape, device=device)  # RMSNorm gains
            else:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed + i)
                s = resid_std if name.endswith(("wo.weight", "w2.weight")) else std
                full = torch.empty(p.shape, device=device).normal_(0.0, s, generator=gen)
            if place is not None:
                place(p, full)
            else:
                p.copy_(full)
        self.rope_cache = rope_tables(
            self.cfg.head_dim,
            self.cfg.max_seq_len,
            self.cfg.rope_theta,
            device=self.tok_embeddings.weight.device,
        )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        kv_caches: list | None = None,
        start_pos: int = 0,
        need_weights: bool = False,
    ):
        """idx (B, T) token ids. With targets: the mean cross-entropy. Otherwise: logits.

        kv_caches (a list of per-layer (k, v), filled in place) and need_weights are for
        generation and attention maps; training never uses them.
        """
        B, T = idx.shape
        rope = None
        if self.cfg.rope and self.positions is not None and kv_caches is None:
            rope = self.rope_cache[self.positions.to(idx.device)]
        elif self.cfg.rope:
            rope = self.rope_cache[start_pos : start_pos + T]
        x = self.tok_embeddings(idx)  # (B, T, d)
        all_weights = []
        for i, layer in enumerate(self.layers.values()):
            cache = kv_caches[i] if kv_caches is not None else None
            x, new_cache, weights = layer(x, rope, cache, need_weights, kv_caches is not None)
            if kv_caches is not None:
                kv_caches[i] = new_cache
            if need_weights:
                all_weights.append(weights)
        x = self.norm(x)
        logits = self.output(x)  # (B, T, vocab)
        if targets is not None:
            return self.loss_fn(logits, targets)
        if need_weights:
            return logits, all_weights
        return logits

    # --- accounting --------------------------------------------------------------------
    def num_params(self) -> int:
        """Parameters, each counted once (tied embeddings are one tensor)."""
        return sum(p.numel() for p in self.parameters())


def count_params(cfg: ModelConfig) -> int:
    """Parameter count from the config alone (no tensors), equal to GPT(cfg).num_params()."""
    d, L, hd = cfg.d_model, cfg.n_layer, cfg.head_dim
    attn = d * cfg.n_head * hd * 2 + d * cfg.n_kv_head * hd * 2
    ffn = 3 * d * cfg.ffn_hidden
    per_layer = attn + ffn + 2 * d
    emb = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return L * per_layer + emb + d


def count_param_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors from the config alone, equal to len(list(GPT(cfg).parameters())): per
    block four attention and three feed-forward weights and two norms; the embedding, the final
    norm, and the output layer unless tied to the embedding."""
    return cfg.n_layer * 9 + 2 + (0 if cfg.tie_embeddings else 1)


def embedding_params(cfg: ModelConfig) -> int:
    """The input embedding's parameters that no matmul uses: none when tied to the output
    layer, whose matmul runs on them every step."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·d·T, N without the input embedding (torchtitan's
    get_num_flop_per_token; PaLM appendix B).

    6·N counts the forward and backward matmuls of every parameter a matmul uses (the output
    layer included); the input embedding is a lookup, not a matmul. 12·L·d·T counts the
    attention score and value matmuls, which scale with the sequence length and have no
    parameters; causal masking is not halved, as in torchtitan and PaLM.
    """
    n = count_params(cfg) - embedding_params(cfg)
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * seq_len


def build_model(cfg: ModelConfig, device: torch.device | str, seed: int = 0) -> GPT:
    """Build on meta, then materialise on `device` and initialise (deterministic for a seed)."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model

"""Hugging Face Llama format, both ways: our GPT <-> `LlamaForCausalLM` (safetensors + config.json).

The architectures are the same (RMSNorm, SwiGLU, grouped-query attention, RoPE) except for the
order of the rotary channel pairs. Our apply_rope rotates interleaved pairs (2i, 2i+1) of each
head; Hugging Face's rotate_half rotates (i, i + head_dim/2). Both use frequency i for pair i, so
permuting the rows of wq and wk within each head (evens first, then odds) turns one into the
other; q·k is unchanged because q and k get the same permutation. This is the permutation of
Hugging Face's own Meta -> HF conversion script (`permute` in convert_llama_weights_to_hf.py).

safetensors is imported lazily: only export and `model.init_from=hf:DIR` need it.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from dtrain.errors import CheckpointError, ConfigError
from dtrain.model import ModelConfig
from dtrain.reliability.safe_write import make_dirs, refuse_link, staged, write_bytes, write_text

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

# our name -> Hugging Face name, per layer ({i} is the layer index)
LAYER_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
REQUIRED_HF_KEYS = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
)
TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ConfigError(
            "the Hugging Face format needs the safetensors package: pip install 'dtrain[hf]'"
        ) from None
    return st


# --- the RoPE permutation ---------------------------------------------------------------


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (n_heads*hd, d): pairs (2i, 2i+1) -> (i, i + hd/2) per head."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_halves."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, 2, hd // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


# --- config ------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype, eos_id: int | None = None) -> dict:
    """config.json for LlamaForCausalLM (read by transformers 4.x and 5.x)."""
    if not cfg.rope:
        raise ConfigError(
            "model.rope=false has no LlamaForCausalLM equivalent (Llama always applies RoPE); "
            "export a model trained with rope=true"
        )
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 4.x reads rope_theta; 5.x reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    # Explicit, or transformers assumes Llama's own ids (bos 1, eos 2), which mean other
    # tokens in our vocabularies.
    out["bos_token_id"] = None
    out["eos_token_id"] = eos_id
    out["pad_token_id"] = None
    return out


def model_config_from_hf(hf_dir: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """Our ModelConfig from a Hugging Face Llama config.json; fields Llama has no notion of
    (name, init_std) come from `base`. Refuses what our model cannot represent."""
    path = Path(hf_dir) / CONFIG
    try:
        c = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{hf_dir} has no {CONFIG}: not a Hugging Face model directory") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is unreadable: {e}") from None
    if c.get("model_type") not in ("llama", None):
        raise ConfigError(f"{path}: model_type={c.get('model_type')!r}; only llama is supported")
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if c.get(key, ok) != ok:
            raise ConfigError(f"{path}: {key}={c[key]!r} is not supported (need {ok!r})")
    missing = [k for k in REQUIRED_HF_KEYS if k not in c]
    if missing:
        raise ConfigError(f"{path} lacks {missing[0]}: not a complete Llama config")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{path}: rope_type={rope_type!r} is not supported (only default)")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    n_head, d = c["num_attention_heads"], c["hidden_size"]
    if c.get("head_dim", d // n_head) != d // n_head:
        raise ConfigError(
            f"{path}: head_dim={c['head_dim']} differs from hidden_size/num_attention_heads; "
            "not supported"
        )
    base = base or ModelConfig()
    return replace(
        base,
        n_layer=c["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=c.get("num_key_value_heads", n_head),
        d_model=d,
        ffn_hidden=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("max_position_embeddings", base.max_seq_len),
        rope=True,
        rope_theta=float(theta),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
    )


# --- weights -----------------------------------------------------------------------------


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names and RoPE layout -> Hugging Face Llama's (plain tensors)."""
    out = {}
    for name, t in state.items():
        t = t.detach()
        if name in TOP_KEYS:
            if name == "output.weight" and cfg.tie_embeddings:
                continue  # one tensor; transformers re-ties lm_head from tie_word_embeddings
            out[TOP_KEYS[name]] = t
            continue
        _, i, rest = name.split(".", 2)  # layers.{i}.<rest>
        if rest == "attn.wq.weight":
            t = interleaved_to_halves(t, cfg.n_head)
        elif rest == "attn.wk.weight":
            t = interleaved_to_halves(t, cfg.n_kv_head)
        out[f"model.layers.{i}.{LAYER_KEYS[rest]}"] = t
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names and RoPE layout -> ours. Raises CheckpointError on a gap."""
    inv_top = {v: k for k, v in TOP_KEYS.items()}
    inv_layer = {v: k for k, v in LAYER_KEYS.items()}
    out = {}
    for name, t in hf.items():
        if name in inv_top:
            out[inv_top[name]] = t
            continue
        parts = name.split(".", 3)  # model.layers.{i}.<rest>
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in inv_layer:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer older exports saved; recomputed from rope_theta
            raise CheckpointError(f"unexpected tensor {name!r} in the Hugging Face weights")
        ours = inv_layer[parts[3]]
        if ours == "attn.wq.weight":
            t = halves_to_interleaved(t, cfg.n_head)
        elif ours == "attn.wk.weight":
            t = halves_to_interleaved(t, cfg.n_kv_head)
        out[f"layers.{parts[2]}.{ours}"] = t
    if cfg.tie_embeddings:
        out.pop("output.weight", None)
        out["output.weight"] = out.get("tok_embeddings.weight")
    expected = {f"layers.{i}.{k}" for i in range(cfg.n_layer) for k in LAYER_KEYS} | set(TOP_KEYS)
    missing = sorted(k for k in expected if out.get(k) is None)
    if missing:
        raise CheckpointError(
            f"the Hugging Face weights lack {len(missing)} tensors (first: {missing[0]})"
        )
    return out


# What an export writes, plus the index of a sharded one: left beside a new model.safetensors,
# a stale index would be what loaders read.
HF_FILES = (WEIGHTS, CONFIG, INDEX)


def check_new_files(paths: list[Path]) -> None:
    """FileExistsError naming the first of `paths` that exists (an export never replaces a file
    unless asked to)."""
    for p in paths:
        refuse_link(p)
        if os.path.lexists(p):
            raise FileExistsError(errno.EEXIST, "already exists", str(p))


def save_hf(
    model_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer=None,
    overwrite: bool = False,
) -> Path:
    """Write out_dir/{model.safetensors, config.json} (+ the tokenizer if it is a Hugging Face
    one, i.e. has save_pretrained), each staged privately, then moved into place
    (dtrain/reliability/safe_write.py): a link planted at any of their names is refused, never
    followed.

    Unless `overwrite`, FileExistsError before anything is written if one of them (or a
    sharded export's index) is already there."""
    st = _safetensors()
    out_dir = Path(out_dir)
    config = hf_config(cfg, dtype=dtype, eos_id=getattr(tokenizer, "eot_id", None))
    with tempfile.TemporaryDirectory() as staging:
        names = list(HF_FILES)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(staging)  # staged: its file names are known only now
            names += sorted(os.listdir(staging))
        if not overwrite:
            check_new_files([out_dir / n for n in names])
        make_dirs(out_dir)
        refuse_link(out_dir / INDEX)
        (out_dir / INDEX).unlink(missing_ok=True)  # overwrite=true: never leave a stale index
        hf = to_hf_state_dict(model_state, cfg)
        hf = {k: v.to(dtype=dtype, device="cpu").contiguous() for k, v in hf.items()}
        with staged(out_dir / WEIGHTS, overwrite=overwrite) as tmp:
            st.save_file(hf, str(tmp), metadata={"format": "pt"})
        write_text(out_dir / CONFIG, json.dumps(config, indent=2) + "\n", overwrite=overwrite)
        for name in sorted(os.listdir(staging)):
            if Path(staging, name).is_file():
                data = Path(staging, name).read_bytes()
                write_bytes(out_dir / name, data, overwrite=overwrite)
    return out_dir


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (one file or an indexed set of shards)."""
    st = _safetensors()
    hf_dir = Path(hf_dir)
    if (hf_dir / INDEX).is_file():
        try:
            files = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{hf_dir / INDEX} is not a safetensors index ({e})") from None
    elif (hf_dir / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise ConfigError(f"{hf_dir} has no {WEIGHTS} or {INDEX}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not isinstance(f, str) or Path(f).name != f:  # shards sit beside the index
            raise CheckpointError(f"{hf_dir / INDEX} names a file outside {hf_dir}: {f!r}")
        try:  # safetensors only: a pickled pytorch_model.bin is never read
            out.update(st.load_file(str(hf_dir / f), device="cpu"))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{hf_dir / f} is not a safetensors file ({first})") from None
    return out


def parse_init_from(spec: str) -> Path:
    """'hf:DIR' -> DIR, checked to look like a Hugging Face model directory."""
    kind, sep, where = spec.partition(":")
    if not sep or kind != "hf" or not where:
        raise ConfigError(f"model.init_from={spec!r} is not valid; use hf:DIR")
    path = Path(where)
    if not (path / CONFIG).is_file():
        raise ConfigError(f"model.init_from={spec!r}: {path} has no {CONFIG}")
    return path


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Copy the weights of a Hugging Face Llama directory into `model` (plain or sharded:
    DTensor parameters take their shard of each full tensor)."""
    cfg = model.cfg
    ours = from_hf_state_dict(load_hf_state_dict(hf_dir), cfg)
    for name, p in model.named_parameters(remove_duplicate=False):
        if tuple(ours[name].shape) != tuple(p.shape):
            raise CheckpointError(
                f"{hf_dir}: {name} has shape {tuple(ours[name].shape)}, the model {tuple(p.shape)}"
            )
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        # Sharded parameters (FSDP's DTensors): each rank keeps its shard of every full tensor.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, ours, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(ours, strict=True)
    if cfg.tie_embeddings:
        model.tie_weights()

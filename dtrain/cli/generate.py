"""Sample text from a checkpoint on one device.

    python -m dtrain.cli.generate checkpoint=outputs/single-fp32-w1-tiny prompt="def " \\
        max_new_tokens=200 temperature=0.8 top_k=50 top_p=0.95 [greedy=true] [num_samples=3]

`checkpoint` is a checkpoints/step_NNNNNNN folder or a run dir (its newest checkpoint), saved by
any strategy at any world size. The run's own tokenizer encodes the prompt and decodes the
output; runs on synthetic data have none, so pass token ids with prompt_ids=[1,2,3].
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from dtrain.cli.export import check_finite
from dtrain.errors import ConfigError, UserError, fail


@dataclass
class GenerateArgs:
    checkpoint: str = ""
    prompt: str = ""
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False
    num_samples: int = 1
    seed: int = 0
    stop_at_eot: bool = True  # stop once every sample has produced end-of-text
    use_cache: bool = True
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16 (autocast for the forward)
    allow_nonfinite: bool = False  # sample from weights that hold NaN or inf anyway


DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> list[str]:
    import torch

    from dtrain.checkpoint.weights import load_checkpoint, resolve_checkpoint
    from dtrain.data import tokenizer_for
    from dtrain.dist import pick_device
    from dtrain.generate import SamplingConfig, generate

    args = parse_kv_args(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.device)
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype={args.dtype!r} is not valid; choose {', '.join(DTYPES)}")
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        greedy=args.greedy,
        use_cache=args.use_cache,
    )
    try:
        sampling.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.num_samples < 1:
        raise ConfigError(f"num_samples must be >= 1, got {args.num_samples}")

    path = resolve_checkpoint(args.checkpoint)
    loaded = load_checkpoint(path, device)
    check_finite(loaded.model.state_dict(), path, args.allow_nonfinite)
    tokenizer = tokenizer_for(loaded.data_cfg)
    if args.prompt_ids is not None:
        ids = list(args.prompt_ids)
    elif tokenizer is None:
        raise ConfigError(
            "this run trained on synthetic data and has no tokenizer; pass prompt_ids=[...]"
        )
    else:
        ids = tokenizer.encode(args.prompt)
        if not ids:  # an empty prompt starts a new document
            ids = [tokenizer.eot_id]
    vocab = loaded.model_cfg.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ConfigError(f"prompt_ids must be in [0, {vocab})")
    check_samples_fit(args.num_samples, len(ids) + args.max_new_tokens, loaded.model_cfg, device)
    prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    autocast = None
    if dtype != torch.float32:
        autocast = lambda: torch.autocast(device_type=device.type, dtype=dtype)
    stop = getattr(tokenizer, "eot_id", None) if args.stop_at_eot else None
    try:
        out = generate(
            loaded.model, prompt, sampling, generator=gen, stop_id=stop, autocast=autocast
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None

    texts = []
    for j, row in enumerate(out.tolist()):
        new = row[len(ids) :]
        if stop is not None and stop in new:
            new = new[: new.index(stop)]
        if tokenizer is None:
            text = " ".join(str(i) for i in ids + new)
        else:
            text = tokenizer.decode(ids + new)
        texts.append(text)
        if args.num_samples > 1:
            print(f"--- sample {j} ---")
        print(text, flush=True)
    return texts


def check_samples_fit(num_samples: int, length: int, model_cfg, device) -> None:
    """num_samples sequences of `length` tokens at once: their KV cache and logits must fit
    half the device's memory, or the run would swap or hang instead of failing."""
    from dtrain.memory.report import fmt_bytes
    from dtrain.memory.search import device_capacity

    m = model_cfg
    kv_dim = m.n_kv_head * m.head_dim
    per_sample = 4 * (2 * m.n_layer * kv_dim * length + 4 * m.vocab_size + 12 * m.d_model * length)
    limit = device_capacity(device) // 2
    if num_samples * per_sample > limit:
        raise ConfigError(
            f"num_samples={num_samples} needs about {fmt_bytes(num_samples * per_sample)} for "
            f"{length} tokens each, more than half of this device's memory ({fmt_bytes(limit)}); "
            f"at most num_samples={max(1, limit // per_sample)} fits"
        )


def parse_kv_args(argv: list[str]) -> GenerateArgs:
    from dtrain.cli._kv import exit_with_help_if_asked, parse_kv

    required = ("checkpoint",)
    exit_with_help_if_asked(argv, "python -m dtrain.cli.generate", __doc__, GenerateArgs, required)
    return parse_kv(GenerateArgs, argv, required=required)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        fail(e, rank0_only=False)

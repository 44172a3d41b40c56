"""Score a checkpoint or an export on the downstream tasks, on one device.

    python -m dtrain.cli.evaluate outputs/single-fp32-w1-tiny
    python -m dtrain.cli.evaluate checkpoint=EXPORT_DIR tasks=[brackets] items=100 json=true

`checkpoint` (or the first bare argument) is a checkpoints/step_NNNNNNN folder, a run dir (its
newest checkpoint), or a directory written by `dtrain.cli.export` (format=hf). A checkpoint is
scored with its run's tokenizer and in its run's batch shape, so the scores are those the
run logged at that step (exactly, for a run on one rank); an export with the tokenizer.json
beside it, or the byte tokenizer when its vocabulary is the byte tokenizer's;
tokenizer=NAME|PATH names another. Prints one line per task: items, acc (the right choice
most likely) and acc_norm (per character).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.cli.export import check_finite
from dtrain.config import DownstreamConfig
from dtrain.errors import ConfigError, UserError, fail


@dataclass
class EvaluateArgs:
    checkpoint: str = ""
    tasks: list[str] = field(default_factory=lambda: list(DownstreamConfig().tasks))
    items: int = DownstreamConfig.items  # per task
    seed: int = DownstreamConfig.seed
    batch_size: int | None = None  # None: the run's micro-batch size (16 for an export)
    tokenizer: str | None = None  # None: the checkpoint's own (see above)
    device: str = "auto"  # auto | cpu | cuda
    json: bool = False  # one JSON object instead of the table
    allow_nonfinite: bool = False  # score weights that hold NaN or inf anyway


@dataclass
class Scored:
    """What is scored: the model, its tokenizer, and the batch shape (length None: the
    longest request)."""

    model: object
    tokenizer: object
    batch_size: int
    length: int | None
    max_len: int


def parse_args(argv: list[str]) -> EvaluateArgs:
    from dtrain.cli._kv import exit_with_help_if_asked, parse_kv

    required = ("checkpoint",)
    exit_with_help_if_asked(argv, "python -m dtrain.cli.evaluate", __doc__, EvaluateArgs, required)
    bare = [a for a in argv if "=" not in a]
    kv = [a for a in argv if "=" in a]
    if len(bare) > 1:
        raise ConfigError(f"one checkpoint or export at a time, got {len(bare)}: {bare}")
    kv += [f"checkpoint={bare[0]}"] if bare else []
    args = parse_kv(EvaluateArgs, kv, required)
    if args.items < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise ConfigError(f"items and batch_size must be >= 1, got {args.items}, {args.batch_size}")
    return args


def named_tokenizer(name: str):
    """tokenizer=byte, or a tokenizer.json file, a folder with one, or a hub name."""
    from dtrain.data.tokenizer import ByteTokenizer, load_hf_tokenizer

    return ByteTokenizer() if name == "byte" else load_hf_tokenizer(name)


def export_tokenizer(path: Path, vocab_size: int, name: str | None):
    """An export's tokenizer: named, beside it, or the byte tokenizer for a byte vocabulary."""
    from dtrain.data.tokenizer import ByteTokenizer, load_hf_tokenizer, padded_vocab

    if name is not None:
        return named_tokenizer(name)
    if (path / "tokenizer.json").is_file():
        return load_hf_tokenizer(str(path))
    if vocab_size == padded_vocab(ByteTokenizer().vocab_size):
        return ByteTokenizer()
    raise ConfigError(
        f"export {path} has no tokenizer.json and a vocabulary of {vocab_size}, not the byte "
        "tokenizer's; pass tokenizer=PATH (e.g. the run dir's tokenizer.json)"
    )


def load_scored(args: EvaluateArgs, device) -> Scored:
    """The checkpoint or export named by args.checkpoint, read with the project's loaders."""
    from dtrain.checkpoint.weights import load_checkpoint, load_hf_model, resolve_checkpoint
    from dtrain.data import tokenizer_for

    path = Path(args.checkpoint)
    if not path.exists():
        raise ConfigError(f"checkpoint={path}: no such checkpoint, run dir or export")
    if (path / "config.json").is_file():
        model = load_hf_model(path, device)
        check_finite(model.state_dict(), path, args.allow_nonfinite)
        tok = export_tokenizer(path, model.cfg.vocab_size, args.tokenizer)
        return Scored(model, tok, args.batch_size or 16, None, model.cfg.max_seq_len)
    ckpt = resolve_checkpoint(path)
    loaded = load_checkpoint(ckpt, device)
    check_finite(loaded.model.state_dict(), ckpt, args.allow_nonfinite)
    if args.tokenizer is not None:
        tok = named_tokenizer(args.tokenizer)
    elif (tok := tokenizer_for(loaded.data_cfg)) is None:
        raise ConfigError(f"{ckpt} trained on synthetic data: it has no text to score")
    trainer = loaded.manifest["config"].get("trainer", {})
    seq_len = int(trainer.get("seq_len", loaded.model_cfg.max_seq_len))
    batch = args.batch_size or int(trainer.get("micro_batch_size", 16))
    return Scored(loaded.model, tok, batch, seq_len, seq_len)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    import torch

    from dtrain.dist import pick_device
    from dtrain.evaluation import accuracy, build_tasks, encode_requests, score_requests

    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.device)
    tasks = build_tasks(args.tasks, args.items, args.seed)  # bad names refused before loading
    s = load_scored(args, device)
    out = {}
    for task, items in tasks.items():
        requests = encode_requests(items, s.tokenizer, s.max_len)
        length = s.length or max(len(r.tokens) - 1 for r in requests)
        with torch.no_grad():
            logprobs = score_requests(
                requests,
                s.model,
                batch_size=s.batch_size,
                length=length,
                pad_id=s.tokenizer.eot_id,
                device=device,
            )
        out[task] = {"items": len(items), **accuracy(items, logprobs)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'task':<14} {'items':>5} {'acc':>6} {'acc_norm':>8}")
        for task, r in out.items():
            print(f"{task:<14} {r['items']:>5} {r['acc']:>6.3f} {r['acc_norm']:>8.3f}")
    return out


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        fail(e, rank0_only=False)

"""Export a checkpoint: to Hugging Face Llama, or consolidated into one torch file.

    python -m dtrain.cli.export checkpoint=PATH out=DIR                 # LlamaForCausalLM
    python -m dtrain.cli.export checkpoint=PATH out=DIR dtype=bfloat16
    python -m dtrain.cli.export checkpoint=PATH out=FILE.pt format=torch  # one file, any sharding

format=hf writes DIR/model.safetensors + DIR/config.json (+ the tokenizer files when the run
used a Hugging Face tokenizer): `LlamaForCausalLM.from_pretrained(DIR)` loads it, and
`model.init_from=hf:DIR` trains from it. format=torch writes the whole training state (model,
optimizer, manifest) of a checkpoint saved by any number of ranks into one torch.save file.
`checkpoint` is a checkpoints/step_NNNNNNN folder or a run dir (its newest checkpoint); its
files are checked against its manifest.json first. An existing output file is replaced only
with overwrite=true; a symbolic link at an output name is refused, never written through.
Weights holding NaN or inf are refused unless allow_nonfinite=true.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError, UserError, fail


@dataclass
class ExportArgs:
    checkpoint: str = ""
    out: str = ""
    format: str = "hf"  # hf | torch
    dtype: str = "float32"  # hf only: float32 | bfloat16 | float16
    overwrite: bool = False  # replace output files that already exist
    allow_nonfinite: bool = False  # export weights that hold NaN or inf anyway


FORMATS = ("hf", "torch")
DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> Path:
    import torch

    from dtrain.cli._kv import exit_with_help_if_asked, parse_kv

    argv = sys.argv[1:] if argv is None else argv
    required = ("checkpoint", "out")
    exit_with_help_if_asked(argv, "python -m dtrain.cli.export", __doc__, ExportArgs, required)
    args = parse_kv(ExportArgs, argv, required)
    if args.format not in FORMATS:
        raise ConfigError(f"format={args.format!r} is not valid; choose {', '.join(FORMATS)}")
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype={args.dtype!r} is not valid; choose {', '.join(DTYPES)}")
    from dtrain.checkpoint.weights import consolidate, load_checkpoint, resolve_checkpoint
    from dtrain.hf import HF_FILES
    from dtrain.reliability.safe_write import refuse_link, staged

    path = resolve_checkpoint(args.checkpoint)
    out = Path(args.out)
    refuse_link(out, f"out={out}")
    if args.format == "torch":
        if out.is_dir():
            out = out / f"{path.name}.pt"
        _refuse_existing([out], args.overwrite)
        with staged(out, overwrite=args.overwrite) as tmp:
            consolidate(path, tmp)
            state = torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
            check_finite(state.get("model", {}), path, args.allow_nonfinite)
        print(f"wrote {out}")
        return out

    from dtrain.data import tokenizer_for
    from dtrain.hf import save_hf

    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; format=hf writes a directory")
    # Before the checkpoint is read; save_hf checks again, with the tokenizer's files.
    _refuse_existing([out / name for name in HF_FILES], args.overwrite)
    loaded = load_checkpoint(path, "cpu")
    check_finite(loaded.model.state_dict(), path, args.allow_nonfinite)
    tokenizer = tokenizer_for(loaded.data_cfg)
    try:
        save_hf(
            loaded.model.state_dict(),
            loaded.model_cfg,
            out,
            dtype=getattr(torch, args.dtype),
            tokenizer=tokenizer,
            overwrite=args.overwrite,
        )
    except FileExistsError as e:
        raise ConfigError(_exists(e.filename)) from None
    print(f"wrote {out} (LlamaForCausalLM, {args.dtype}) from {path}")
    return out


def check_finite(model_state: dict, path, allow: bool) -> None:
    """Weights with NaN or inf load and sample silently into garbage: refused unless asked."""
    from dtrain.reliability.nonfinite import nonfinite_tensors

    count, names = nonfinite_tensors(model_state)
    if count and not allow:
        raise ConfigError(
            f"checkpoint {path} holds NaN or inf in {count} weight tensor(s) (first: "
            f"{names[0]}); resume from an earlier checkpoint, or pass allow_nonfinite=true"
        )


def _exists(path) -> str:
    from dtrain.reliability.safe_write import exists_message

    return exists_message(path)


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    from dtrain.hf import check_new_files

    if overwrite:
        return
    try:
        check_new_files(paths)
    except FileExistsError as e:
        raise ConfigError(_exists(e.filename)) from None


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        fail(e, rank0_only=False)

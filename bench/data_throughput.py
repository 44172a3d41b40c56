"""Data loader throughput: tokens/s per worker for each tokenizer, on CPU.

    python bench/data_throughput.py --out bench_out/data          # the embedded corpus
    python bench/data_throughput.py --files 'corpus/*.jsonl' --tokenizer /path/tokenizer.json
    python bench/data_throughput.py --smoke --out /tmp/x          # seconds, for CI

For each tokenizer (byte; bpe trained on the data; any --tokenizer given) it measures
  * one stream in this process (read -> shuffle -> tokenize -> pack): the cost of one worker;
  * one rank's BatchStream with 1, 2, ... DataLoader workers, end to end (what the loop sees).
A model step must take longer than micro_batch * seq_len / (tokens/s) for data to keep up.
Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _bundle(args, tokenizer: str, cache: Path):
    import torch

    from dtrain.config import DataConfig
    from dtrain.data import build_data

    cfg = DataConfig(
        source="local" if args.files else "embedded",
        files=args.files,
        text_field=args.text_field,
        tokenizer=tokenizer,
        vocab_size=args.bpe_vocab if tokenizer == "bpe" else None,
        max_bytes=args.max_bytes,
        bpe_train_bytes=args.bpe_train_bytes,
        cache_dir=str(cache),
        num_streams=args.num_streams,
    )
    return build_data(cfg, seq_len=args.seq_len, seed=0, device=torch.device("cpu"))


def one_stream(bundle, seconds: float) -> float:
    """Tokens/s of one stream read, tokenized and packed in this process (one worker's job)."""
    from dtrain.data.stream import start_state, stream_blocks

    gen = stream_blocks(bundle.train.spec, 0, start_state())
    next(gen)  # open the source and fill the first window before timing
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(gen)
        n += 1
    return n * bundle.train.spec.seq_len / (time.perf_counter() - t0)


def rank_stream(bundle, workers: int, micro: int, seconds: float) -> float:
    """Tokens/s of one rank's BatchStream with `workers` DataLoader workers, end to end."""
    import torch

    from dtrain.data import BatchStream

    bundle.train.num_workers = workers
    bs = BatchStream(
        bundle.train,
        micro_batch_size=micro,
        grad_accum_steps=1,
        rank=0,
        world_size=1,
        seed=0,
        device=torch.device("cpu"),
    )
    bs.next_step()  # start the workers before timing
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        bs.next_step()
        n += 1
    return n * micro * bundle.train.spec.seq_len / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out/data"))
    p.add_argument("--files", default=None, help="local files (glob); default: embedded corpus")
    p.add_argument("--text-field", default="text")
    p.add_argument("--tokenizer", action="append", default=[], help="extra tokenizer.json/name")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30.0, help="time per measurement")
    p.add_argument("--workers", default="1,2", help="worker counts to try, comma-separated")
    p.add_argument("--num-streams", type=int, default=8)
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--bpe-train-bytes", type=int, default=20_000_000)
    p.add_argument("--max-bytes", type=int, default=None, help="cap on the embedded corpus")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a seconds-long check")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_len, args.micro, args.seconds, args.workers = 64, 2, 0.5, "1"
        args.bpe_vocab, args.bpe_train_bytes, args.max_bytes = 300, 200_000, 200_000
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    workers = [int(w) for w in args.workers.split(",")]
    results = []
    for tok in ["byte", "bpe", *args.tokenizer]:
        bundle = _bundle(args, tok, out / "cache")
        row = {
            "tokenizer": tok,
            "vocab": bundle.tokenizer.vocab_size,
            "one_stream_tokens_per_s": one_stream(bundle, args.seconds),
        }
        for w in workers:
            total = rank_stream(bundle, w, args.micro, args.seconds)
            row[f"w{w}_tokens_per_s"] = total
            row[f"w{w}_tokens_per_s_per_worker"] = total / w
        results.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "command": "python "
        + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "data": args.files or f"embedded (max_bytes={args.max_bytes})",
        "seq_len": args.seq_len,
        "micro_batch": args.micro,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; torch {meta['torch']}; {meta['date']}  ",
        f"Data: {meta['data']}; seq_len {args.seq_len}, micro-batch {args.micro}",
        "",
        "| tokenizer | vocab | one stream, in process (tok/s) | "
        + " | ".join(f"{w} worker{'s' if w > 1 else ''} (tok/s, per worker)" for w in workers)
        + " |",
        "|---|---|---|" + "---|" * len(workers),
    ]
    for r in results:
        cells = [
            f"{r[f'w{w}_tokens_per_s']:,.0f} ({r[f'w{w}_tokens_per_s_per_worker']:,.0f})"
            for w in workers
        ]
        lines.append(
            f"| {r['tokenizer']} | {r['vocab']} | {r['one_stream_tokens_per_s']:,.0f} | "
            + " | ".join(cells)
            + " |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"meta": meta, "results": results}


if __name__ == "__main__":
    main()

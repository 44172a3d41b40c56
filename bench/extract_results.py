"""Write bench/results/<topic>/<figure>.json, one per figure of docs/benchmarks.md, from the raw
outputs of the benchmark runs (bench/dtrain_result.py's JSON summaries, the loops' JSONs,
metrics.jsonl, logs), so each published number is computed, not retyped.

The raw outputs are not kept in the tree; they are read from RAW_REV, the last commit that held
them (`--raw DIR` reads a folder of them instead):

    python bench/extract_results.py

MFU is recomputed with dtrain.model.flops_per_token (its current convention) from each run's
tokens/s per GPU, the card's dense bf16 peak and the model's shape, whatever the run logged.
The layout of the files written is in bench/results/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
from datetime import datetime
from pathlib import Path

import yaml

from dtrain.hardware import gpu_named
from dtrain.model import ModelConfig, flops_per_token

ROOT = Path(__file__).resolve().parents[1]
RAW_PREFIX = "bench/results"
RAW_REV = "92d05ef"  # the last commit with the raw outputs under bench/results

# Shapes of the runs: the preset, the vocab of the synthetic tokens or the head, the sequence.
M1B = {"preset": "1b", "vocab_size": 50304, "seq_len": 2048}
M8B = {"preset": "8b", "vocab_size": 128256, "seq_len": 8192}
M8B_SLICE = {"preset": "8b", "vocab_size": 128256, "seq_len": 8192, "n_layer": 16}
M8B_LOSS = {"preset": "8b", "vocab_size": 50304, "seq_len": 8192, "n_layer": 4}
M8B_OVERRIDES = [
    "model.vocab_size=128256",
    "trainer.seq_len=8192",
    "trainer.micro_batch_size=1",
]
M1B_OVERRIDES = ["model=1b", "model.vocab_size=50304", "trainer.seq_len=2048"]
M1B_OVERRIDES += ["trainer.micro_batch_size=8"]
DDP_TORCH = "from_output.jsonl#run_dir=/tmp/runs/dtrain_ddp_torch"  # printed, not fetched

LOWP = (
    "bash bench/lanes.sh \"0=STEPS={steps} LOG_EVERY=5 PRECS='{precs}' bash bench/lowp.sh {case}\""
)
LOSS8B = (
    'bash bench/lanes.sh "0=STEPS=400 LOG_EVERY=10 DATA=data=embedded SEED={seed} '
    'PRECS={prec} bash bench/lowp.sh lossslice8b"'
)


def call(folder: str, runs: dict, commit: str | None = None) -> dict:
    """One call's raw folder, its runs by table name, and its commit where no commit.txt has it."""
    return {"dir": folder, "runs": runs, "commit": commit}


# One entry a figure: where its raw files are (one folder an invocation of the benchmark
# command, "calls"), what each run is called in the tables, and the run the ratios divide by
# (measured in the same invocation).
FIGURES: list[dict] = [
    dict(
        out="throughput/ddp_1b_2gpu.json",
        what="model=1b, DDP on 2 GPUs, bf16: dtrain (400 MB buckets) against a plain "
        "torch.compile(DDP) loop and Lightning Fabric (torch's 25 MB buckets)",
        date="2026-11-26",
        card="H200",
        model=M1B,
        baseline="plain loop (25 MB buckets)",
        command="STEPS=30 bash bench/strategies.sh part6",
        calls=[
            call(
                "2026-11-26c/part6",
                {
                    "plain loop (25 MB buckets)": "from_output.jsonl#loop=plain,wrapper=ddp",
                    "Fabric ddp (25 MB buckets)": "from_output.jsonl#loop=fabric,wrapper=ddp",
                    "dtrain ddp (400 MB buckets)": "dtrain_ddp.json",
                },
                commit="70a899e",
            )
        ],
    ),
    dict(
        out="throughput/ddp_1b_2gpu_same_buckets.json",
        what="model=1b, DDP on 2 GPUs, bf16: every loop at torch's 25 MB buckets",
        date="2026-11-26",
        card="H100",
        model=M1B,
        baseline="plain loop (25 MB buckets)",
        command="STEPS=30 bash bench/strategies.sh part4",
        calls=[
            call(
                "2026-11-26c/part4",
                {
                    "plain loop (25 MB buckets)": "from_output.jsonl#loop=plain,wrapper=ddp",
                    "Fabric ddp (25 MB buckets)": "from_output.jsonl#loop=fabric,wrapper=ddp",
                    "dtrain ddp (25 MB buckets)": DDP_TORCH,
                    "dtrain ddp (200 MB buckets)": "dtrain_ddp_bucket200.json",
                },
                commit="70a899e",
            )
        ],
    ),
    dict(
        out="throughput/fsdp_1b_2gpu.json",
        what="model=1b, FSDP on 2 GPUs, bf16: dtrain against a plain FSDP2 loop and Fabric",
        date="2026-11-26",
        card="H200",
        model=M1B,
        baseline="plain FSDP2 loop",
        command="STEPS=30 bash bench/strategies.sh part6",
        calls=[
            call(
                "2026-11-26c/part6",
                {
                    "plain FSDP2 loop": "from_output.jsonl#loop=plain,wrapper=fsdp",
                    "Fabric fsdp (bf16 reduce)": "from_output.jsonl#loop=fabric,wrapper=fsdp",
                    "dtrain fsdp": "dtrain_fsdp.json",
                    "dtrain fsdp, bf16 reduce": "dtrain_fsdp_reduce_bf16.json",
                },
                commit="70a899e",
            )
        ],
    ),
    dict(
        out="throughput/zero3_1b_2gpu.json",
        what="model=1b, DeepSpeed ZeRO-3 on 2 GPUs, bf16: DeepCompile against the eager engine",
        date="2026-11-26",
        card="H200",
        model=M1B,
        baseline="dtrain zero3, eager",
        command="STEPS=30 bash bench/strategies.sh part3",
        calls=[
            call(
                "2026-11-26b",
                {
                    "dtrain zero3, eager": "dtrain_zero3.json",
                    "dtrain zero3, DeepCompile": "dtrain_zero3_deepcompile.json",
                    "dtrain fsdp": "dtrain_fsdp.json",
                },
                commit="3ff8268",
            )
        ],
    ),
    dict(
        out="strategies/1b_2gpu.json",
        what="model=1b on 2 GPUs: fsdp with blocks resharded or kept, ddp, bf16 and fp8",
        date="2026-11-28",
        card="H200",
        model=M1B,
        baseline="fsdp bf16, resharded",
        command="STEPS=40 dtrain_run fsdp1b_P_reshard_R 2 strategy=fsdp data.vocab_size=50304 "
        "precision=P strategy.reshard_after_forward=R (bench/common.sh); ddp fp8 likewise",
        calls=[
            call(
                "2026-11-28-gpu-s15/call3_fsdp1b_reshard_ab",
                {
                    "fsdp bf16, resharded": "fsdp1b_bf16_reshard_true.json",
                    "fsdp bf16, kept": "fsdp1b_bf16_reshard_false.json",
                    "fsdp fp8, resharded": "fsdp1b_fp8_reshard_true.json",
                    "fsdp fp8, kept": "fsdp1b_fp8_reshard_false.json",
                    "ddp fp8": "ddp1b_fp8.json",
                },
                commit="443abf3",
            )
        ],
    ),
    dict(
        out="strategies/scaling_1b.json",
        what="model=1b, bf16, micro-batch 8 per GPU: 1, 2 and 4 GPUs of one host",
        date="2026-11-26",
        card="H200",
        model=M1B,
        baseline="fsdp x1",
        command='OUT=$OUT bash bench/scaling.sh "1 2 4"',
        calls=[
            call(
                "2026-11-26/scaling",
                {
                    "fsdp x1": "fsdp_x1.json",
                    "fsdp x2": "fsdp_x2.json",
                    "fsdp x4": "fsdp_x4.json",
                    "hsdp 2x2": "hsdp_x4.json",
                },
                commit="c53afd4",
            )
        ],
        per_gpu_ratio=True,
    ),
    dict(
        out="precision/1b_single.json",
        what="model=1b on one GPU, seq 2048, micro-batch 8: fp8 at its defaults against bf16",
        date="2026-12-04",
        card="H200",
        model=M1B,
        baseline="bf16",
        command=LOWP.format(steps=30, precs="fp8 bf16", case="single1b"),
        calls=[
            call(
                "2026-12-04-gpu-s42/call3_single1b_first_step",
                {"bf16": "single1b_bf16.json", "fp8": "single1b_fp8.json"},
            ),
            call(
                "2026-12-04-gpu-s42/call4_single1b_again",
                {"bf16": "single1b_bf16_again.json", "fp8": "single1b_fp8_again.json"},
            ),
        ],
    ),
    dict(
        out="precision/1b_single_int8.json",
        what="model=1b on one GPU: int8 (grad-weight in bf16, SwitchBack) against bf16",
        date="2026-12-03",
        card="H200",
        model=M1B,
        baseline="bf16",
        command=LOWP.format(steps=30, precs="bf16 int8", case="single1b"),
        calls=[
            call(
                "2026-12-03-gpu-s36/call3_check_single1b",
                {"bf16": "single1b_bf16.json", "int8": "single1b_int8.json"},
            )
        ],
    ),
    dict(
        out="precision/8b_blocks_fp8.json",
        what="8b's blocks on one GPU (16 of 32 blocks, seq 8192, micro-batch 1): fp8 vs bf16",
        date="2026-12-04",
        card="H200",
        model=M8B_SLICE,
        baseline="bf16",
        command="FRESH_CACHE=1 " + LOWP.format(steps=20, precs="bf16 fp8", case="slice8b"),
        calls=[
            call(
                "2026-12-04-gpu-s42/call2_slice8b_first_step",
                {"bf16": "slice8b_bf16.json", "fp8": "slice8b_fp8.json"},
            )
        ],
    ),
    dict(
        out="precision/8b_blocks_int8.json",
        what="8b's blocks on one GPU: int8 (SwitchBack) and int8_grouped against bf16",
        date="2026-12-04",
        card="H200",
        model=M8B_SLICE,
        baseline="bf16",
        command=LOWP.format(steps=20, precs="bf16 int8 int8gwgg", case="slice8b"),
        calls=[
            call(
                "2026-12-04-gpu-s43/call3_slice8b_int8_grouped",
                {
                    "bf16": "slice8b_bf16.json",
                    "int8": "slice8b_int8.json",
                    "int8_grouped": "slice8b_int8gwgg.json",
                },
            ),
            call(
                "2026-12-04-gpu-s43/call4_slice8b_int8_grouped_again",
                {
                    "bf16": "slice8b_bf16_again.json",
                    "int8_grouped": "slice8b_int8gwgg_again.json",
                },
            ),
        ],
    ),
    dict(
        out="precision/8b_fsdp_2gpu.json",
        what="model=8b, fsdp on 2 GPUs (blocks kept gathered), seq 8192, micro-batch 1",
        date="2026-11-29",
        card="H200",
        model=M8B,
        baseline="bf16",
        command='LOG_EVERY=5 STEPS=30 PRECS="bf16 int8 fp8" bash bench/lowp.sh fsdp8b',
        calls=[
            call(
                "2026-11-29-gpu-s17/call3_fsdp8b_lowp_memtest",
                {
                    "bf16": "fsdp8b_bf16.json",
                    "fp8": "fsdp8b_fp8.json",
                    "int8": "fsdp8b_int8.json",
                },
            )
        ],
    ),
    dict(
        out="precision/8b_blocks_loss.json",
        what="8b's blocks cut to 4, 400 steps of the embedded text: loss, steps 360-400",
        date="2026-12-04",
        card="H200",
        model=M8B_LOSS,
        kind="loss",
        command=LOSS8B.format(seed="S", prec="P"),
        calls=[
            call(
                "2026-12-04-gpu-s41/call3_lossslice8b_fp8",
                {
                    "bf16 seed 1337": "runs/lossslice8b_bf16_s1337/metrics.jsonl",
                    "bf16 seed 7": "runs/lossslice8b_bf16_s7/metrics.jsonl",
                    "fp8 seed 1337": "runs/lossslice8b_fp8_s1337/metrics.jsonl",
                },
            ),
            call(
                "2026-12-04-gpu-s41/call4_lossslice8b_fp8_int8",
                {
                    "fp8 seed 7": "runs/lossslice8b_fp8_s7/metrics.jsonl",
                    "int8 seed 1337": "runs/lossslice8b_int8_s1337/metrics.jsonl",
                    "int8 seed 7": "runs/lossslice8b_int8_s7/metrics.jsonl",
                },
            ),
            call(
                "2026-12-04-gpu-s43/call5_lossslice8b_int8_grouped",
                {
                    "bf16 seed 7": "runs/lossslice8b_bf16_s7/metrics.jsonl",
                    "int8_grouped seed 1337": "runs/lossslice8b_int8gwgg_s1337/metrics.jsonl",
                    "int8_grouped seed 7": "runs/lossslice8b_int8gwgg_s7/metrics.jsonl",
                },
            ),
            call(
                "2026-12-04-gpu-s43/call6_lossslice8b_anchor",
                {
                    "bf16 seed 1337": "runs/lossslice8b_bf16_s1337/metrics.jsonl",
                    "int8 seed 7": "runs/lossslice8b_int8_s7/metrics.jsonl",
                },
            ),
        ],
    ),
    dict(
        out="checkpoint/1b_fsdp_2gpu.json",
        what="model=1b, fsdp on 2 GPUs: saves every 10 steps, sync against async",
        date="2026-11-27",
        card="H200",
        model=M1B,
        kind="checkpoint",
        command="OUT=$OUT STEPS=25 EVERY=10 bash bench/async_ckpt.sh",
        calls=[
            call(
                "2026-11-27-gpu-s10/call3_pool_test_speed_async",
                {"sync": "ckpt_async_false.log", "async": "ckpt_async_true.log"},
                commit="6bde565",
            )
        ],
    ),
    dict(
        out="checkpoint/8b_fsdp_2gpu.json",
        what="model=8b, fsdp on 2 GPUs: one save at step 10 of 11, sync against async",
        date="2026-11-27",
        card="H200",
        model=M8B,
        kind="checkpoint",
        command="OUT=$OUT STEPS=11 LOG_EVERY=1 MODEL=8b SEQ=8192 MICRO=1 EVERY=10 "
        "EXTRA=data.vocab_size=128256 bash bench/async_ckpt.sh",
        calls=[
            call(
                "2026-11-27-gpu-s11/call3_async8b",
                {"sync": "ckpt_async_false.log", "async": "ckpt_async_true.log"},
                commit="eab22ce",
            )
        ],
    ),
    dict(
        out="startup/first_step.json",
        what="seconds from the loop's start to step 5, compiles included, empty compile caches",
        date="2026-12-04",
        card="H200",
        model=M8B_SLICE,
        baseline="bf16",
        command="FRESH_CACHE=1 " + LOWP.format(steps=20, precs="bf16 fp8 fp8cf", case="slice8b"),
        calls=[
            call(
                "2026-12-04-gpu-s42/call2_slice8b_first_step",
                {
                    "bf16": "slice8b_bf16.json",
                    "fp8 (first step eager)": "slice8b_fp8.json",
                    "fp8 (first step compiled)": "slice8b_fp8cf.json",
                },
            )
        ],
    ),
    dict(
        out="data/data_wait.json",
        what="share of step time the loop waits for data, embedded text, byte tokenizer",
        date="2026-11-26",
        card="H200",
        model=M1B,
        kind="data_wait",
        command="python launch/train.py model=small model.vocab_size=50304 data=embedded "
        "data.num_workers=1 trainer.seq_len=1024 trainer.micro_batch_size=32 "
        "trainer.max_steps=60 trainer.log_every=10 trainer.eval_every=0 "
        "checkpoint.save_final=false",
        calls=[
            call("2026-11-26b", {"small (124M), 1 worker": "dw1_metrics.jsonl"}, commit="3ff8268")
        ],
    ),
    dict(
        out="data/data_wait_1b.json",
        what="share of step time the loop waits for data at model=1b, 2 workers",
        date="2026-11-26",
        card="H100",
        model=M1B,
        kind="data_wait",
        command="python launch/train.py model=1b model.vocab_size=50304 data=embedded "
        "data.num_workers=2 trainer.seq_len=2048 trainer.micro_batch_size=8 "
        "trainer.max_steps=50 trainer.log_every=10 trainer.eval_every=0 "
        "checkpoint.save_final=false",
        calls=[
            call("2026-11-26", {"1b, 2 workers": "data_wait_1b_metrics.jsonl"}, commit="c53afd4")
        ],
    ),
    dict(
        out="planner/heldout.json",
        what="speed plan against runs no fitted constant was set on (held out): 2x H200",
        date="2026-11-29",
        card="H200",
        kind="planner",
        command="python bench/plan_validate.py --out DIR --gpu h200-141gb --from-runs RUNS",
        calls=[
            call("2026-11-29-gpu-s17/call1_plan_grid_8b", {"grid": "plan_validate.json"}),
            call(
                "2026-11-29-gpu-s17/call3_fsdp8b_lowp_memtest",
                {
                    f"fsdp-{p}-w2-8b-30steps": {
                        "file": f"fsdp8b_{p}.json",
                        "overrides": [
                            "model=8b",
                            "strategy=fsdp",
                            f"precision={p}",
                            *M8B_OVERRIDES,
                        ],
                    }
                    for p in ("bf16", "fp8", "int8")
                },
            ),
            call(
                "2026-11-28-gpu-s15/call3_fsdp1b_reshard_ab",
                {
                    f"{s}-{p}-w2-1b": {
                        "file": f"{s}1b_{p}{suffix}.json",
                        "overrides": [*M1B_OVERRIDES, f"strategy={s}", f"precision={p}", *extra],
                    }
                    for s, p, suffix, extra in (
                        (
                            "fsdp",
                            "bf16",
                            "_reshard_false",
                            ["strategy.reshard_after_forward=false"],
                        ),
                        ("fsdp", "fp8", "_reshard_false", ["strategy.reshard_after_forward=false"]),
                        ("ddp", "fp8", "", []),
                    )
                },
                commit="443abf3",
            ),
        ],
    ),
    dict(
        out="install/cpu.json",
        what="the README's install command on a fresh CPU-only machine (2 shared cores)",
        date="2026-11-27",
        card="CPU",
        kind="install",
        command="bash scripts/install.sh dev && python launch/train.py model=tiny "
        "trainer.max_steps=300 && python -m pytest -q tests/test_install.py tests/test_model.py",
        calls=[call("2026-11-27-install", {"fresh": "summary.txt"}, commit="0e1d64e")],
    ),
]


class Raw:
    """The raw outputs, from a folder or from a commit that held bench/results."""

    def __init__(self, folder: Path | None, rev: str | None):
        self.folder, self.rev = folder, rev

    def text(self, rel: str) -> str:
        if self.rev:
            spec = f"{self.rev}:{RAW_PREFIX}/{rel}"
            return subprocess.run(
                ["git", "show", spec], cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
        return (self.folder / rel).read_text()

    def exists(self, rel: str) -> bool:
        try:
            self.text(rel)
        except (OSError, subprocess.CalledProcessError):
            return False
        return True


def model_config(m: dict) -> ModelConfig:
    d = yaml.safe_load((ROOT / "conf" / "model" / f"{m['preset']}.yaml").read_text())
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    d = {k: v for k, v in d.items() if k in names}
    d.update({k: v for k, v in m.items() if k in names})
    return ModelConfig(**d)


def mfu(tokens_per_s_per_gpu: float, m: dict, card: str) -> float:
    peak = gpu_named(card).bf16_flops
    return tokens_per_s_per_gpu * flops_per_token(model_config(m), m["seq_len"]) / peak


def run_json(raw: Raw, rel: str) -> dict:
    path, _, select = rel.partition("#")
    if not select:
        return json.loads(raw.text(path))
    want = dict(kv.split("=", 1) for kv in select.split(","))
    for line in raw.text(path).splitlines():
        row = json.loads(line)
        if all(str(row.get(k)) == v for k, v in want.items()):
            return row
    raise KeyError(f"{rel}: no line matches")


def speed_run(r: dict, m: dict, card: str) -> dict:
    ranks = r.get("memory_per_rank") or [r]
    out = {
        "tokens_per_s": round(r["tokens_per_s"]),
        "tokens_per_s_per_gpu": round(r["tokens_per_s_per_gpu"]),
        "world_size": r.get("world_size", 1),
        "mfu": round(mfu(r["tokens_per_s_per_gpu"], m, card), 4),
        "peak_allocated_gib": round(max(x["peak_allocated_gib"] for x in ranks), 2),
        "peak_reserved_gib": round(max(x["peak_reserved_gib"] for x in ranks), 2),
    }
    if r.get("intervals"):
        out["intervals_after_first"] = r["intervals"][1:]
    if r.get("first_interval"):
        out["startup_s"] = round(r["first_interval"]["elapsed_s"], 1)
    if r.get("memory_predicted_gib"):
        out["predicted_reserved_gib"] = round(r["memory_predicted_gib"], 2)
    return out


def tail_loss(raw: Raw, rel: str, points: int = 5) -> dict:
    rows = [json.loads(x) for x in raw.text(rel).splitlines() if x.strip()]
    rows = [x for x in rows if x.get("loss") is not None]
    last = rows[-points:]
    return {
        "steps": [last[0]["step"], last[-1]["step"]],
        "tail_loss": round(statistics.mean(x["loss"] for x in last), 4),
    }


def data_wait(raw: Raw, rel: str) -> dict:
    rows = [json.loads(x) for x in raw.text(rel).splitlines() if x.strip()][1:]
    rows = [x for x in rows if x.get("tokens_per_s") and x.get("data_wait_pct") is not None]
    mid = statistics.median(x["tokens_per_s"] for x in rows)
    rows = [x for x in rows if x["tokens_per_s"] > mid / 2]  # an eval or the last partial log
    waits = [x["data_wait_pct"] for x in rows]
    toks = [x["tokens_per_s"] for x in rows]
    return {
        "data_wait_pct": [round(min(waits), 2), round(max(waits), 2)],
        "tokens_per_s": [round(min(toks)), round(max(toks))],
    }


STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) dtrain\]")


def wall_s(log: str) -> float:
    """Rank 0's first to last log line: start-up, training, the saves and the wait for the
    last write at exit."""
    stamps = [m.group(1) for m in map(STAMP.match, log.splitlines()) if m]
    t = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1])]
    return round((t[1] - t[0]).total_seconds(), 1)


def checkpoint_call(raw: Raw, call: dict) -> dict:
    summary = json.loads(raw.text(f"{call['dir']}/async_ckpt.json"))
    runs = {}
    for mode, log in call["runs"].items():
        s = summary[mode]
        runs[mode] = {
            "save_steps": s["steps"],
            "stall_s": s["stall_s"],  # the loop blocked by the save, later waits included
            "at_save_s": s.get("at_save_s") or s["stall_s"],  # blocked at the save itself
            "save_s": s["save_s"],  # the save's start to its COMPLETE marker
            "wall_s": wall_s(raw.text(f"{call['dir']}/{log}")),
        }
    return runs


def install_call(raw: Raw, call: dict) -> dict:
    text = raw.text(f"{call['dir']}/summary.txt")
    grab = {k: int(v) for k, v in re.findall(r"^A (\w+) rc=0 (\d+)s", text, re.M)}
    torch_mb = re.search(r"^(\d+)M\s+/tmp/venv-x/\S+/torch$", text, re.M)
    return {
        "fresh venv": {
            "install_s": grab["install"],
            "train_300_steps_s": grab["train"],
            "tests_s": grab["tests"],
            "torch_mib": int(torch_mb.group(1)),
            "nvidia_packages": 0 if re.search(r"^0\s+\(nvidia", text, re.M) else None,
        }
    }


def planner_call(raw: Raw, call: dict) -> dict:
    out = {}
    for name, run in call["runs"].items():
        if name == "grid":  # bench/plan_validate.py's rows, 8b at seq 8192
            for r in json.loads(raw.text(f"{call['dir']}/{run}"))["rows"]:
                if r["status"] == "ok":
                    out[r["name"]] = {
                        "overrides": [
                            f"model={r['model']}",
                            f"strategy={r['strategy']}",
                            f"precision={r['precision']}",
                            *M8B_OVERRIDES,
                        ],
                        "world_size": r["nproc"],
                        "measured_tokens_per_s_per_gpu": round(r["tokens_per_s_per_gpu"]),
                    }
            continue
        r = json.loads(raw.text(f"{call['dir']}/{run['file']}"))
        out[name] = {
            "overrides": run["overrides"],
            "world_size": r["world_size"],
            "measured_tokens_per_s_per_gpu": round(r["tokens_per_s_per_gpu"]),
        }
    for p in out.values():
        planned = planned_tokens_per_s_per_gpu(p["overrides"], p["world_size"])
        p["planned_tokens_per_s_per_gpu"] = round(planned)
        p["error_pct"] = round((planned / p["measured_tokens_per_s_per_gpu"] - 1) * 100, 1)
    return out


def planned_tokens_per_s_per_gpu(overrides: list[str], world: int) -> float:
    """The speed plan of the code as it is, on the datasheet H200 (as the runs' card)."""
    from dtrain.config import compose
    from dtrain.hardware import GPUS
    from dtrain.memory import plan_speed, planned_config
    from dtrain.memory.machine import datasheet_machine

    cfg, _, setup = planned_config(compose(list(overrides)), world, "cuda")
    return plan_speed(cfg.model, setup, datasheet_machine(GPUS["h200-141gb"])).tokens_per_s_per_gpu


def commit_of(raw: Raw, call: dict) -> str:
    if raw.exists(f"{call['dir']}/commit.txt"):
        return raw.text(f"{call['dir']}/commit.txt").split()[0]
    return call["commit"]


def figure(raw: Raw, fig: dict) -> dict:
    kind = fig.get("kind", "speed")
    calls = []
    for call in fig["calls"]:
        if kind == "checkpoint":
            runs = checkpoint_call(raw, call)
        elif kind == "install":
            runs = install_call(raw, call)
        elif kind == "planner":
            runs = planner_call(raw, call)
        elif kind == "data_wait":
            runs = {k: data_wait(raw, f"{call['dir']}/{v}") for k, v in call["runs"].items()}
        elif kind == "loss":
            runs = {k: tail_loss(raw, f"{call['dir']}/{v}") for k, v in call["runs"].items()}
        else:
            runs = {
                k: speed_run(run_json(raw, f"{call['dir']}/{v}"), fig["model"], fig["card"])
                for k, v in call["runs"].items()
            }
            base = runs.get(fig["baseline"])
            key = "tokens_per_s_per_gpu" if fig.get("per_gpu_ratio") else "tokens_per_s"
            for r in runs.values():
                if base:
                    r["x_baseline"] = round(r[key] / base[key], 3)
        calls.append({"raw": call["dir"], "commit": commit_of(raw, call), "runs": runs})
    out = {k: fig[k] for k in ("what", "card", "date", "command") if k in fig}
    if "model" in fig:
        out["model"] = fig["model"]
    if kind == "speed" and fig.get("baseline"):
        out["baseline"] = fig["baseline"]
        out["peak_tflops"] = gpu_named(fig["card"]).bf16_flops / 1e12
        spread = {}
        for c in calls:
            for name, r in c["runs"].items():
                spread.setdefault(name, []).append(r["x_baseline"])
        out["x_baseline_over_calls"] = {k: [min(v), max(v)] for k, v in spread.items()}
    out["calls"] = calls
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw", type=Path, help="a folder of raw outputs, instead of --rev")
    ap.add_argument("--rev", default=RAW_REV, help="the commit to read the raw outputs from")
    ap.add_argument("--out", type=Path, default=ROOT / RAW_PREFIX)
    args = ap.parse_args()
    raw = Raw(args.raw, None if args.raw else args.rev)
    for fig in FIGURES:
        path = args.out / fig["out"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figure(raw, fig), indent=1) + "\n")
        print(path.relative_to(args.out))


if __name__ == "__main__":
    main()

"""Run a grid of training runs, one run dir per point, then compare them.

    python launch/sweep.py --out sweeps/mem --nproc 1,2 \\
        strategy=single,ddp,fsdp precision=bf16,fp32 model=350m trainer.max_steps=20

Every `key=a,b,c` argument is an axis of the grid (Hydra's multirun syntax); the others are
passed to every point. `--nproc` is an axis too: 1 runs `python launch/train.py`, N > 1 runs
`torchrun --standalone --nproc_per_node=N launch/train.py`. Points that cannot run are skipped
and said so (strategy=single with N > 1). Each point's run dir is
OUT/<strategy>-<precision>-w<N>-<model>[-<other axes>], its log OUT/<name>.log. A failed point
does not stop the sweep; the exit code is 1 if any failed. At the end `dtrain.cli.compare`
prints the table and writes OUT/compare.png.

Hydra's -m (--multirun) works too for one world size: `python launch/train.py -m
precision=fp32,bf16 ...` runs each job in multirun/<time>/<n>-<strategy>-<precision>-<model>.
It cannot vary the number of processes (every job runs in the one launching process) and does
not compare the runs at the end; this script does both.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP_KEYS = ("strategy", "precision", "model")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_grid(args: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(axes, fixed overrides): `key=a,b` is an axis, `key=a` a fixed override."""
    from dtrain.errors import ConfigError

    axes, fixed = [], []
    for a in args:
        key, eq, value = a.partition("=")
        if not eq:
            raise ConfigError(f"sweep arguments are key=value[,value...], got {a!r}")
        if key == "hydra.run.dir":
            raise ConfigError("hydra.run.dir is set per point by the sweep; use --out")
        values = value.split(",")
        if len(values) > 1:
            if any(not v for v in values):
                raise ConfigError(f"empty value in {a!r}")
            axes.append((key, values))
        else:
            fixed.append(a)
    return axes, fixed


def point_name(point: dict[str, str], nproc: int) -> str:
    """strategy-precision-wN-model as launch/train.py names run dirs, plus the other axes."""
    main = [point.get("strategy", "single"), point.get("precision", "fp32"), f"w{nproc}"]
    main.append(point.get("model", "tiny"))
    rest = [f"{k.split('.')[-1]}{v}" for k, v in point.items() if k not in GROUP_KEYS]
    return "-".join(main + rest).replace("/", "_")


def point_command(overrides: list[str], nproc: int) -> list[str]:
    from dtrain.dist import train_command

    return train_command(overrides, nproc)


def main(argv: list[str] | None = None) -> int:
    from dtrain.errors import ConfigError, UserError, fail

    ap = argparse.ArgumentParser(
        prog="python launch/sweep.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="directory for the run dirs of the sweep")
    ap.add_argument("--nproc", default="1", help="processes per point, e.g. 1,2")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per point")
    ap.add_argument("--no-compare", action="store_true", help="skip the table and chart")
    ap.add_argument("overrides", nargs="*", help="key=value or key=a,b,c (an axis)")
    args = ap.parse_args(argv)
    try:
        axes, fixed = parse_grid(args.overrides)
        try:
            nprocs = [int(n) for n in args.nproc.split(",")]
        except ValueError:
            raise ConfigError(f"--nproc must be integers like 1,2; got {args.nproc!r}") from None
        if any(n < 1 for n in nprocs):
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    except UserError as e:
        fail(e, rank0_only=False)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = [k for k, _ in axes]
    done, failed, skipped = [], [], []
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for nproc in nprocs:
        for values in itertools.product(*[v for _, v in axes]) if axes else [()]:
            point = dict(zip(keys, values))
            # Name by the groups whether they are axes or fixed; other fixed keys stay out.
            named = {k: v for k, v in (f.split("=", 1) for f in fixed) if k in GROUP_KEYS}
            name = point_name({**named, **point}, nproc)
            if {**named, **point}.get("strategy", "single") == "single" and nproc > 1:
                skipped.append(f"{name} (strategy=single runs one process)")
                continue
            run_dir = out / name
            overrides = [*fixed, *(f"{k}={v}" for k, v in point.items())]
            overrides.append(f"hydra.run.dir={run_dir}")
            cmd = point_command(overrides, nproc)
            print(f"[sweep] {name}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            with open(out / f"{name}.log", "w") as log:
                try:
                    rc = subprocess.run(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                        timeout=args.timeout,
                    ).returncode  # fmt: skip
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            dt = time.perf_counter() - t0
            if rc == 0:
                done.append(run_dir)
                print(f"[sweep] {name}: done in {dt:.0f}s", flush=True)
            else:
                failed.append(name)
                tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:] or [""]
                print(f"[sweep] {name}: FAILED ({rc}) after {dt:.0f}s: {tail[0]}", flush=True)
    for s in skipped:
        print(f"[sweep] skipped {s}")
    if done and not args.no_compare:
        from dtrain.cli import compare

        compare.main([str(d) for d in done] + [f"png={out / 'compare.png'}", "overwrite=true"])
    print(f"[sweep] {len(done)} done, {len(failed)} failed, {len(skipped)} skipped; runs in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

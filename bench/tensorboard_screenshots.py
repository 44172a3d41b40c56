"""Screenshots of TensorBoard comparing two short CPU runs, for docs/img (a one-off, not CI).

    apt-get install -y chromium          # Debian's; any Chromium or Chrome binary will do
    python bench/tensorboard_screenshots.py [--out /tmp/dtrain-tb-shots] [--steps 40]

Trains the tiny model twice on CPU (strategy=single on one process, strategy=ddp on two under
torchrun), serves the two run dirs with TensorBoard on 127.0.0.1 only, and has headless
Chromium (a fresh profile, no network services of its own) photograph the Custom Scalars,
Scalars and HParams tabs into docs/img/tensorboard_*.png, palette-compressed to stay small.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
# (file name, TensorBoard tab, window width, height, scale): what the docs show. The HParams
# table needs a wide window to show every column; it is drawn smaller.
SHOTS = [
    ("tensorboard_custom_scalars.png", "custom_scalars", 1500, 1150, 1.0),
    ("tensorboard_scalars.png", "scalars", 1400, 1000, 1.0),
    ("tensorboard_hparams.png", "hparams", 2300, 360, 0.75),
]


def train_runs(out: Path, steps: int) -> None:
    common = [
        "model=tiny",
        "data.max_bytes=300000",
        "trainer.seq_len=64",
        "trainer.micro_batch_size=4",
        f"trainer.max_steps={steps}",
        "trainer.log_every=2",
        f"trainer.eval_every={steps // 2}",
        "trainer.eval_steps=2",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "optim.warmup_steps=5",
        "checkpoint=none",
        "inspect.max_new_tokens=16",
    ]
    # This checkout's dtrain, whatever is installed; offline; one thread per rank.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    for name, launcher, args in (
        ("single", [sys.executable], ["strategy=single"]),
        ("ddp", [*torchrun, "--nproc_per_node=2"], ["strategy=ddp"]),
    ):
        if (out / name / "metrics.jsonl").exists():
            continue  # trained by an earlier call
        cmd = [*launcher, str(ROOT / "launch/train.py"), *common, *args,
               f"hydra.run.dir={out / name}"]  # fmt: skip
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and len(r.read()) > 2:  # "[]" until the runs are loaded
                    return
        time.sleep(1)
    raise SystemExit(f"TensorBoard did not answer {url} within {timeout:.0f} s")


def shrink(path: Path) -> None:
    """Palette PNG: TensorBoard's flat colours survive 256 of them, at a fraction of the size."""
    from PIL import Image

    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/dtrain-tb-shots", help="where the two runs go")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--img", default=str(ROOT / "docs/img"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    out = Path(args.out)
    train_runs(out, args.steps)

    port = free_port()
    tb = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(f"{base}/data/runs")
        for name, tab, width, height, scale in SHOTS:
            png = Path(args.img) / name
            with tempfile.TemporaryDirectory() as profile:
                subprocess.run(
                    [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                     f"--window-size={width},{height}", f"--force-device-scale-factor={scale}",
                     "--virtual-time-budget=15000",
                     f"--screenshot={png}", f"{base}/#{tab}&_smoothingWeight=0"],
                    check=True, timeout=180, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
            shrink(png)
            print(f"{png}: {png.stat().st_size // 1024} KiB")
    finally:
        tb.terminate()
        tb.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

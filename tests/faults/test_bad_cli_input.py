"""Bad input to the other commands: generate and export check a checkpoint as resume does,
export replaces no file unless told to, compare refuses a chart path it cannot write, and plan
refuses the world sizes that training refuses, in training's words. Each: one line, exit code
2, no traceback, nothing written.

Most cases call the command's main() in-process (a new interpreter costs seconds); one of each
kind also runs as a real process to pin the exit code and the single stderr line.
"""

import shutil
import subprocess
import sys

import pytest

from dtrain.errors import ConfigError, UserError
from tests.conftest import FAST, ROOT, cli_env, launch, train
from tests.faults.helpers import one_error_line, snapshot


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A real checkpoint, a copy with one byte flipped in its shard, one with the shard cut."""
    tmp = tmp_path_factory.mktemp("cli")
    train(tmp / "run", "trainer.max_steps=2", "trainer.eval_every=0")
    good = tmp / "run" / "checkpoints" / "step_0000002"
    out = {"good": good}
    for kind in ("flipped", "truncated"):
        bad = tmp / kind / "step_0000002"
        shutil.copytree(good, bad)
        data = bytearray((bad / "__0_0.distcp").read_bytes())
        if kind == "flipped":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        (bad / "__0_0.distcp").write_bytes(bytes(data))
        out[kind] = bad
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip


def _one_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr[-3000:]
    line = one_error_line(res.stderr)
    assert res.stderr.strip().splitlines() == [line], res.stderr
    return line


def _export(*args: str):
    from dtrain.cli.export import main

    return main(list(args))


def _generate(*args: str):
    from dtrain.cli.generate import main

    return main([*args, "prompt=def ", "max_new_tokens=2"])


# --- generate and export verify the checkpoint first ------------------------------------

EXPECT = {
    "flipped": "__0_0.distcp is corrupt (sha256 differs from manifest.json)",
    "truncated": "__0_0.distcp is truncated or padded",
}
COMMANDS = {
    "generate": lambda ckpt, out: _generate(f"checkpoint={ckpt}"),
    "export-hf": lambda ckpt, out: _export(f"checkpoint={ckpt}", f"out={out}"),
    "export-torch": lambda ckpt, out: _export(f"checkpoint={ckpt}", f"out={out}", "format=torch"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", EXPECT)
def test_generate_and_export_check_checksums_first(ckpts, tmp_path, kind, command):
    before = snapshot(ckpts[kind])
    with pytest.raises(UserError) as e:
        COMMANDS[command](ckpts[kind], tmp_path / "out")
    assert f"checkpoint {ckpts[kind]}: {EXPECT[kind]}" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert snapshot(ckpts[kind]) == before


@pytest.mark.parametrize(
    "kind,args",
    [
        ("truncated", ["dtrain.cli.generate", "prompt=def "]),  # was a PytorchStreamReader trace
        ("flipped", ["dtrain.cli.export", "format=torch", "out={out}"]),
    ],
    ids=["generate-truncated", "export-flipped"],
)
def test_a_damaged_checkpoint_is_one_line_from_the_commands(ckpts, tmp_path, kind, args):
    out = tmp_path / "out.pt"
    res = _cli(args[0], f"checkpoint={ckpts[kind]}", *(a.format(out=out) for a in args[1:]))
    assert EXPECT[kind] in _one_line(res)
    assert not out.exists()


# --- export replaces nothing unless overwrite=true --------------------------------------


@pytest.mark.parametrize(
    "existing", ["config.json", "model.safetensors", "model.safetensors.index.json"]
)
def test_export_hf_overwrites_no_file(ckpts, tmp_path, existing):
    out = tmp_path / "hf"
    out.mkdir()
    (out / existing).write_text("mine\n")
    (out / "README.md").write_text("mine too\n")
    before = snapshot(out)
    with pytest.raises(ConfigError) as e:
        _export(f"checkpoint={ckpts['good']}", f"out={out}")
    assert str(e.value) == (
        f"{out / existing} already exists; pass overwrite=true to replace it, or choose "
        "another out="
    )
    assert snapshot(out) == before
    _export(f"checkpoint={ckpts['good']}", f"out={out}", "overwrite=true")
    assert (out / "README.md").read_text() == "mine too\n"  # not an output: left alone
    assert (out / "config.json").read_text() != "mine\n"
    assert not (out / "model.safetensors.index.json").exists()  # a stale index would win


def test_export_torch_overwrites_no_file(ckpts, tmp_path):
    for out, written in [
        (tmp_path / "one.pt", tmp_path / "one.pt"),
        (tmp_path, tmp_path / "step_0000002.pt"),  # out=DIR writes DIR/<checkpoint>.pt
    ]:
        written.write_bytes(b"mine")
        with pytest.raises(ConfigError, match=f"{written} already exists; pass overwrite=true"):
            _export(f"checkpoint={ckpts['good']}", f"out={out}", "format=torch")
        assert written.read_bytes() == b"mine"
        assert not written.with_name(written.name + ".tmp").exists()
        _export(f"checkpoint={ckpts['good']}", f"out={out}", "format=torch", "overwrite=true")
        assert written.read_bytes() != b"mine"


def test_export_overwrite_refusal_as_a_real_process(ckpts, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine\n")
    line = _one_line(_cli("dtrain.cli.export", f"checkpoint={ckpts['good']}", f"out={out}"))
    assert "config.json already exists; pass overwrite=true" in line
    assert (out / "config.json").read_text() == "mine\n" and len(list(out.iterdir())) == 1


# --- compare png= ------------------------------------------------------------------------


def test_compare_png_that_is_a_directory(ckpts, tmp_path):
    run = ckpts["good"].parents[1]
    chart = tmp_path / "charts"
    chart.mkdir()
    before = snapshot(tmp_path)
    line = _one_line(_cli("dtrain.cli.compare", str(run), f"png={chart}"))
    assert line == (
        f"error: png={chart} is a directory; give a file name, e.g. png={chart / 'memory.png'}"
    )
    assert snapshot(tmp_path) == before
    assert not list(tmp_path.rglob("*.tmp.png"))


def test_compare_png_that_cannot_be_written_leaves_no_temp_file(ckpts, tmp_path):
    from dtrain.cli.compare import read_run, write_chart

    (tmp_path / "a_file").write_text("not a folder\n")
    chart = tmp_path / "a_file" / "memory.png"  # unwritable even for root
    with pytest.raises(ConfigError, match=f"png={chart}: cannot write the chart"):
        write_chart([read_run(ckpts["good"].parents[1])], chart)
    assert not list(tmp_path.rglob("*.png"))


# --- plan refuses what training refuses -------------------------------------------------

WORLD3 = [  # (overrides, refused at 3 ranks)
    (["strategy=ddp"], False),  # 3 ranks share the embedded data's 8 streams
    (["strategy=hsdp"], True),  # replicate_degree=2 does not divide 3
    (["strategy=single"], True),
    (["strategy=fsdp", "trainer.global_batch_size=16"], True),  # 4 x 3 ranks does not divide 16
    (["strategy=zero2", "data.num_streams=6"], False),
    (["strategy=ddp", "data=synthetic", "data.vocab_size=256"], False),  # no streams
]


def _training_refusal(overrides: list[str], world: int) -> str | None:
    """What training's own code refuses at `world` ranks before it needs a process group, in
    dtrain.train's order: the strategy, the batch, the data streams."""
    import torch

    from dtrain.config import resolve_grad_accum
    from dtrain.data import BatchStream, build_data
    from dtrain.dist import DistEnv
    from dtrain.precision import build_precision
    from dtrain.run.preflight import check_overrides
    from dtrain.strategies import build_strategy

    cpu = torch.device("cpu")
    try:
        cfg = check_overrides([*FAST, *overrides])
        precision = build_precision(cfg.precision, cpu)
        build_strategy(cfg.strategy, precision, DistEnv(0, 0, world, cpu))
        accum = resolve_grad_accum(cfg.trainer, world)
        data = build_data(cfg.data, seq_len=cfg.trainer.seq_len, seed=0, device=cpu)
        BatchStream(
            data.train, micro_batch_size=cfg.trainer.micro_batch_size, grad_accum_steps=accum,
            rank=0, world_size=world, seed=0, device=cpu,
        )  # fmt: skip
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("overrides,refused", WORLD3, ids=[" ".join(o) for o, _ in WORLD3])
def test_plan_refuses_what_training_refuses_at_world_size_3(overrides, refused, tmp_path):
    from dtrain.cli.plan import build_plan

    if "zero" in overrides[0]:
        pytest.importorskip("deepspeed")
    expected = _training_refusal([*overrides, f"hydra.run.dir={tmp_path}/run"], 3)
    assert (expected is not None) == refused, expected
    try:
        build_plan(["world_size=3", *FAST, *overrides])
        got = None
    except UserError as e:
        got = str(e)
    assert got == expected


def test_plan_world_size_3_as_a_real_process():
    res = _cli("dtrain.cli.plan", "world_size=3", "strategy=ddp", "model=tiny")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "note: data: 3 ranks read data.num_streams=8 streams, so each rank tokenizes 3x the "
        "blocks it trains on; data.num_streams=9 reads each record once"
    ) in res.stdout


@pytest.mark.slow
def test_plan_and_a_real_3_rank_run_refuse_in_the_same_words(tmp_path):
    from dtrain.cli.plan import build_plan

    with pytest.raises(UserError) as planned:
        build_plan(["world_size=3", *FAST, "strategy=hsdp"])
    res = launch(*FAST, "strategy=hsdp", f"hydra.run.dir={tmp_path}/run", nproc=3)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"error: {planned.value}" in res.stderr.splitlines(), res.stderr[-3000:]

"""Bad input on the command line: one line naming the problem and the choices, exit code 2,
no traceback, nothing overwritten."""

import pytest

from tests.conftest import FAST, launch

BAD = [
    (["strategy=nope"], "unknown strategy 'nope'; valid choices: ddp, deepspeed, fsdp"),
    (["precision=fp7"], "unknown precision 'fp7'"),
    (["model=huge"], "unknown model 'huge'"),
    (["data=nowhere"], "unknown data 'nowhere'"),
    (["trainer.bogus=1"], "unknown config key 'trainer.bogus'"),
    (["trainer.max_steps=0"], "trainer.max_steps must be > 0"),
    (["trainer.micro_batch_size=-2"], "trainer.micro_batch_size must be > 0"),
    (["trainer.max_steps=abc"], "trainer.max_steps must be an integer"),
    (["trainer.seq_len=4096"], "exceeds model.max_seq_len"),
    (["model.n_head=3"], "must be divisible by n_head"),
    (["trainer.stop_at_step=50", "trainer.max_steps=10"], "past trainer.max_steps"),
    (["resume=/no/such/ckpt"], "no such checkpoint folder"),
    (["optim.beta2=1.5"], "optim.beta2 must be in"),
    (["trainer.device=tpu"], "trainer.device='tpu' is not valid"),
    (["trainer.global_batch_size=6", "trainer.micro_batch_size=4"], "cannot be served"),
    (["data.source=web"], "unknown data.source 'web'"),
    (["model.vocab_size=100"], "smaller than the tokenizer"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_gives_one_line_and_exit_2(tmp_path, args, message):
    res = launch(*FAST, *args, f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in res.stderr + res.stdout


def test_a_bad_int8_choice_is_one_line_before_the_run_dir_is_touched(tmp_path):
    """precision.int8_* choices are checked at launch: one line, exit 2, and the run dir's
    Hydra record (another run's, here) is not rewritten."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- model=tiny\n")
    res = launch(*FAST, "precision=int8", "precision.int8_gemm=sideways", f"hydra.run.dir={run}")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert lines == [
        "error: precision.int8_gemm='sideways' is not valid; choose tma, pointer, gluon, fastest"
    ], res.stderr
    assert sorted(p.name for p in run.rglob("*")) == [".hydra", "overrides.yaml"]
    assert (run / ".hydra" / "overrides.yaml").read_text() == "- model=tiny\n"


@pytest.mark.parametrize(
    "key,choices",
    [
        ("int8_kernel", "auto, triton, torch"),
        ("int8_gemm", "tma, pointer, gluon, fastest"),
        ("int8_quantize_tiles", "tuned or sweeps"),
        ("int8_quantize", "gradients, fused, apart"),
        ("int8_swiglu", "linears or fused"),
        ("int8_grouped_gemm", "auto, gluon, triton"),
        ("fp8_first_step", "eager or compiled"),
    ],
)
def test_every_low_precision_choice_is_a_checked_config_key(key, choices):
    from dataclasses import replace

    from dtrain.config import PrecisionConfig, compose
    from dtrain.errors import ConfigError

    precision = key.split("_")[0]
    cfg = compose(["model=tiny", f"precision={precision}"]).precision
    assert getattr(cfg, key) == getattr(PrecisionConfig, key)  # the yaml's is the schema's
    with pytest.raises(
        ConfigError, match=f"^precision.{key}='sideways' is not valid; choose {choices}$"
    ):
        compose(["model=tiny", f"precision={precision}", f"precision.{key}=sideways"])
    other = {"int8": "fp8", "fp8": "int8"}[precision]
    with pytest.raises(ConfigError, match=f"unknown config key 'precision.{key}'"):
        compose(
            ["model=tiny", f"precision={other}", f"precision.{key}={choices.split()[0].strip(',')}"]
        )
    import torch

    from dtrain.precision import build_precision

    bad = replace(PrecisionConfig(name=other), **{key: choices.split(", ")[-1].split(" or ")[-1]})
    with pytest.raises(ConfigError, match=f"precision.{key} applies to precision={precision} only"):
        build_precision(bad, torch.device("meta"), check_device=False)


@pytest.mark.parametrize(
    "key,others", [("int8_grouped_gemm", "auto or triton"), ("int8_gemm", "tma or pointer")]
)
def test_a_gluon_gemm_needs_gluon_and_says_so_at_launch(monkeypatch, key, others):
    """precision.int8_grouped_gemm=gluon or int8_gemm=gluon with a Triton that has no Gluon for
    Hopper: one ConfigError naming the key, what it needs and the other choices."""
    from dtrain.config import PrecisionConfig
    from dtrain.errors import ConfigError
    from dtrain.lowp import int8
    from dtrain.precision import check_kernels

    cfg = PrecisionConfig(name="int8", **{key: "gluon"})
    monkeypatch.setattr(int8, "has_gluon_hopper", lambda: False)
    said = (
        rf"^precision.{key}=gluon needs Triton's Gluon for Hopper \(Triton 3\.6 or "
        rf"later\); (this is Triton |Triton is not).+: choose {others}$"
    )
    with pytest.raises(ConfigError, match=said):
        check_kernels(cfg)
    monkeypatch.setattr(int8, "has_gluon_hopper", lambda: True)
    check_kernels(cfg)  # with Gluon: fine


def test_resume_never_refuses_to_overwrite_checkpoints(tmp_path):
    run = tmp_path / "run"
    ok = launch(*FAST, "trainer.max_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    res = launch(*FAST, "trainer.max_steps=2", "resume=never", f"hydra.run.dir={run}")
    assert res.returncode == 2 and "would overwrite" in res.stderr
    assert before == {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    run = tmp_path / "run"
    ok = launch(*FAST, "trainer.max_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    res = launch(*FAST, "trainer.max_steps=4", "model.d_model=32", f"hydra.run.dir={run}")
    assert res.returncode == 2
    assert "was saved with model.d_model=64" in res.stderr and "Traceback" not in res.stderr


def test_resume_from_an_incomplete_checkpoint_is_refused(tmp_path):
    partial = tmp_path / "ckpt" / "step_0000004"
    partial.mkdir(parents=True)
    res = launch(*FAST, f"resume={partial}", f"hydra.run.dir={tmp_path}/run")
    assert res.returncode == 2 and "is incomplete" in res.stderr
    assert not (tmp_path / "run").exists()


CLIS = {
    "plan": ["-m", "dtrain.cli.plan"],
    "calibrate": ["-m", "dtrain.cli.calibrate"],
    "compare": ["-m", "dtrain.cli.compare"],
    "generate": ["-m", "dtrain.cli.generate"],
    "export": ["-m", "dtrain.cli.export"],
    "evaluate": ["-m", "dtrain.cli.evaluate"],
    "sweep": ["launch/sweep.py"],
}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("cli", list(CLIS))
def test_every_cli_answers_help_with_its_usage(cli, flag):
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    res = subprocess.run(
        [sys.executable, *CLIS[cli], flag, "model=tiny"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    first = res.stdout.splitlines()[0]
    assert first.startswith("usage: ") and cli in first, first
    assert res.stderr == ""


def test_hydra_multirun_gives_each_job_its_own_run_dir(tmp_path):
    # launch/sweep.py's help and docs/memory.md say Hydra's -m works for one world size.
    res = launch(
        "-m",
        *FAST,
        "trainer.max_steps=1",
        "trainer.eval_every=0",
        "precision=fp32,bf16",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    runs = sorted(p.parent.name for p in tmp_path.glob("*/metrics.jsonl"))
    assert runs == ["0-single-fp32-tiny", "1-single-bf16-tiny"], runs

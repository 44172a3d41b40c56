"""Hugging Face Llama export/import, checkpoint loading on one device, consolidation."""

import json
import math
import subprocess
import sys

import pytest
import torch

from dtrain.hf import (
    halves_to_interleaved,
    interleaved_to_halves,
    load_hf_into,
    save_hf,
    to_hf_state_dict,
)
from dtrain.model import ModelConfig, build_model
from tests.conftest import ROOT, cli_env, read_jsonl, train

transformers = pytest.importorskip("transformers")


def _random_model(**kw) -> torch.nn.Module:
    """Weights far from the init (and non-unit norm gains), so a wrong RoPE layout, a swapped
    projection or a missed norm shows in the logits."""
    cfg = ModelConfig(
        **{
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "d_model": 64,
            "ffn_hidden": 96,
            "vocab_size": 96,
            "max_seq_len": 64,
            "rope_theta": 500.0,
            "norm_eps": 1e-6,
            **kw,
        }
    )
    model = build_model(cfg, "cpu", seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
            else:
                p.uniform_(0.5, 1.5, generator=gen)
    return model


def _hf_logits(out_dir, x):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(x).logits, hf


@pytest.mark.parametrize(
    "kw",
    [{}, {"tie_embeddings": True}, {"n_kv_head": 4}, {"n_kv_head": 1, "n_head": 2}],
    ids=["gqa", "tied", "mha", "mqa"],
)
def test_transformers_logits_equal_ours(tmp_path, kw):
    model = _random_model(**kw)
    save_hf(model.state_dict(), model.cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    x = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    theirs, hf = _hf_logits(tmp_path, x)
    assert hf.config.num_key_value_heads == model.cfg.n_kv_head
    assert hf.config.tie_word_embeddings == model.cfg.tie_embeddings
    assert hf.config.rms_norm_eps == model.cfg.norm_eps
    with torch.no_grad():
        ours = model(x)
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.std() > 0.5  # the comparison is not between near-constant logits


def test_the_rope_permutation_is_needed_and_inverted():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, 4), 4), w)
    # Head 0's rows (0, 1) are one rotated pair; in the halves layout they sit 8 rows apart.
    h = interleaved_to_halves(w, 4)
    assert torch.equal(h[0], w[0]) and torch.equal(h[8], w[1]) and torch.equal(h[1], w[2])
    # Without the permutation the exported model computes something else.
    model = _random_model()
    sd = to_hf_state_dict(model.state_dict(), model.cfg)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, model.layers["0"].attn.wq.weight)


@pytest.mark.parametrize("tied", [False, True])
def test_export_import_round_trip_is_identical(tmp_path, tied):
    model = _random_model(tie_embeddings=tied)
    save_hf(model.state_dict(), model.cfg, tmp_path)
    fresh = build_model(model.cfg, "cpu", seed=7)
    load_hf_into(fresh, tmp_path)
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if tied:
        assert fresh.output.weight is fresh.tok_embeddings.weight


def test_rope_false_cannot_be_exported(tmp_path):
    from dtrain.errors import ConfigError

    model = _random_model(rope=False)
    with pytest.raises(ConfigError, match="rope=false has no LlamaForCausalLM"):
        save_hf(model.state_dict(), model.cfg, tmp_path)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("src") / "run"
    train(run, "trainer.max_steps=3", "trainer.eval_every=3", "inspect.samples=false")
    return run


def test_export_cli_generate_cli_and_init_from(trained_run, tmp_path):
    from dtrain.checkpoint.weights import load_checkpoint
    from dtrain.cli.export import main as export
    from dtrain.cli.generate import main as generate_cli

    out = export([f"checkpoint={trained_run}", f"out={tmp_path / 'hf'}"])
    loaded = load_checkpoint(trained_run / "checkpoints" / "step_0000003")
    x = torch.randint(0, 257, (1, 64), generator=torch.Generator().manual_seed(3))
    theirs, hf = _hf_logits(out, x)
    with torch.no_grad():
        assert (loaded.model(x) - theirs).abs().max().item() < 1e-4
    # the byte tokenizer's end-of-text, and no BOS (not Llama's defaults 1 and 2)
    assert hf.config.eos_token_id == 256 and hf.config.bos_token_id is None

    # The generate CLI decodes with the run's tokenizer; greedy is deterministic and equals
    # the cache-free path.
    args = [f"checkpoint={trained_run}", "prompt=def f(x):", "max_new_tokens=12", "greedy=true"]
    (a,) = generate_cli(args)
    (b,) = generate_cli([*args, "use_cache=false"])
    assert a == b and a.startswith("def f(x):")

    # init_from=hf:DIR: a new run starts from exactly those weights, with the architecture of
    # the directory (model.d_model=32 is overridden by its config.json).
    src_eval = [r for r in read_jsonl(trained_run / "metrics.jsonl") if "eval_loss" in r][-1]
    new = tmp_path / "new"
    train(
        new,
        f"model.init_from=hf:{out}",
        "model.d_model=32",
        "trainer.max_steps=1",
        "trainer.eval_every=1",
        "inspect.samples=false",
        "checkpoint.save_final=false",
    )
    first = [r for r in read_jsonl(new / "metrics.jsonl") if "eval_loss" in r][0]
    assert first["step"] == 0
    assert first["eval_loss"] == pytest.approx(src_eval["eval_loss"], abs=1e-5)


def test_consolidate_to_one_file(trained_run, tmp_path):
    from dtrain.checkpoint.weights import load_checkpoint
    from dtrain.cli.export import main as export

    out = export([f"checkpoint={trained_run}", f"out={tmp_path / 'one.pt'}", "format=torch"])
    state = torch.load(out, weights_only=False)
    assert state["manifest"]["step"] == 3
    assert {"model", "optim", "manifest"} <= state.keys()
    loaded = load_checkpoint(trained_run / "checkpoints" / "step_0000003").model.state_dict()
    for k, v in loaded.items():
        assert torch.equal(state["model"][k], v), k


def test_cli_errors_are_one_line(tmp_path, trained_run):
    from dtrain.cli.export import main as export
    from dtrain.cli.generate import main as generate_cli
    from dtrain.errors import UserError

    in_process = [
        (export, [f"checkpoint={tmp_path}/nope", f"out={tmp_path}/o"], "does not exist"),
        (export, [f"checkpoint={trained_run}"], "out= is required"),
        (export, [f"checkpoint={trained_run}", f"out={tmp_path}/o", "format=x"], "format='x'"),
        (generate_cli, [f"checkpoint={trained_run}", "bogus=1"], "unknown config key 'bogus'"),
        (generate_cli, [f"checkpoint={trained_run}", "max_new_tokens=5000"], "max_seq_len"),
    ]
    for main, args, msg in in_process:
        with pytest.raises(UserError, match=msg):
            main(args)
    # As commands: `error: <one line>`, exit code 2, no traceback.
    for args, msg in [
        (["dtrain.cli.generate", f"checkpoint={trained_run}", "top_p=2"], "top_p must be"),
        (["dtrain.cli.export", f"checkpoint={tmp_path}/nope", f"out={tmp_path}/o"], "does not"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", *args], capture_output=True, text=True, env=cli_env(), cwd=ROOT
        )
        assert res.returncode == 2, res.stderr[-2000:]
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], res.stderr

import math

import pytest
import torch

from dtrain.config import group_choices
from dtrain.model import GPT, ModelConfig, build_model, count_params, flops_per_token
from tests.conftest import compose


@pytest.mark.parametrize("preset", group_choices("model"))
def test_presets_param_count_matches_formula(preset):
    cfg = compose(f"model={preset}", "data=synthetic").model
    cfg.vocab_size = 50304
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == count_params(cfg)


def test_preset_sizes():
    def n(preset, vocab):
        cfg = compose(f"model={preset}").model
        cfg.vocab_size = vocab
        return count_params(cfg)

    assert n("tiny", 320) < 1_000_000
    assert 110e6 < n("small", 50304) < 140e6
    assert 330e6 < n("350m", 50304) < 380e6
    assert 1.25e9 < n("1b", 50304) < 1.45e9
    assert 2.9e9 < n("3b", 128256) < 3.4e9
    assert 7.9e9 < n("8b", 128256) < 8.1e9  # Llama-3-8B: 8.03B


def test_flops_per_token_convention():
    """torchtitan's: 6·N without the input embedding (a lookup), plus 12·L·d·T unhalved."""
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64)
    assert flops_per_token(cfg, 16) == 6 * (count_params(cfg) - 64 * 32) + 12 * 2 * 32 * 16
    tied = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64, tie_embeddings=True)
    # tied: the one matrix is the output layer's, whose matmul runs
    assert flops_per_token(tied, 16) == 6 * count_params(tied) + 12 * 2 * 32 * 16


def test_flops_per_token_at_8b_leaves_out_the_embedding():
    """Llama-3-8B (vocab 128256, seq 8192): 57.9 GFLOPs a token, 5.2% under the 61.1 that
    counting the embedding's 525M parameters gave."""
    cfg = ModelConfig(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, ffn_hidden=14336, vocab_size=128256
    )
    f = flops_per_token(cfg, 8192)
    assert f == pytest.approx(57.91e9, rel=1e-3)
    assert f / (f + 6 * 128256 * 4096) == pytest.approx(0.948, abs=1e-3)


def test_forward_loss_and_logits_shapes():
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, vocab_size=64)
    model = build_model(cfg, "cpu", seed=0)
    x = torch.randint(0, 64, (3, 10))
    logits = model(x)
    assert logits.shape == (3, 10, 64)
    loss = model(x, x)
    # A fresh model predicts roughly uniformly: loss near ln(vocab).
    assert abs(loss.item() - math.log(64)) < 0.5


def test_init_is_deterministic_and_seed_dependent():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64)
    a, b, c = (build_model(cfg, "cpu", seed=s) for s in (1, 1, 2))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim > 1:
            assert not torch.equal(pa, pc), n


def test_causal_future_tokens_do_not_change_the_past():
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64)
    model = build_model(cfg, "cpu", seed=0)
    x = torch.randint(0, 64, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 64
    torch.testing.assert_close(model(x)[:, :8], model(y)[:, :8])


def test_tied_embeddings_share_one_tensor():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=64, tie_embeddings=True)
    model = build_model(cfg, "cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == count_params(cfg)


def test_model_imports_without_torch_distributed():
    import subprocess
    import sys

    code = "import sys, dtrain.model; sys.exit(int('torch.distributed.fsdp' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("preset", group_choices("model"))
def test_preset_comments_state_the_parameter_counts_count_params_gives(preset):
    # "<N>M [parameters] with <tokenizer> ([vocab ]<V>)" in the header: N must be count_params
    # at vocab V, to the digits written, so the README's sizes have a checked source.
    import re
    from dataclasses import replace

    from tests.conftest import ROOT

    lines = (ROOT / "conf/model" / f"{preset}.yaml").read_text().splitlines()
    header = " ".join(x.lstrip("# ") for x in lines if x.startswith("#"))
    claims = re.findall(r"([\d.]+)M (?:parameters )?with [^()]*\((?:vocab )?(\d+)\)", header)
    assert len(claims) >= 2, header
    cfg = compose(f"model={preset}").model
    for written, vocab in claims:
        n = count_params(replace(cfg, vocab_size=int(vocab)))
        decimals = len(written.partition(".")[2])
        assert f"{n / 1e6:.{decimals}f}" == written, (preset, vocab, n)

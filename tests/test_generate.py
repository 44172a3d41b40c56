"""Sampling: the KV cache changes nothing but speed; each sampling knob does what it says."""

import math

import pytest
import torch

from dtrain.generate import SamplingConfig, filter_logits, generate, next_token_probs, sample_next
from dtrain.model import ModelConfig, build_model

N_DRAWS = 40_000


def _model(**kw) -> torch.nn.Module:
    cfg = ModelConfig(
        n_layer=3, n_head=4, n_kv_head=2, d_model=32, vocab_size=64, max_seq_len=128, **kw
    )
    model = build_model(cfg, "cpu", seed=3)
    # Larger weights than the init, so the next token depends strongly on the context: near
    # uniform logits would let a broken cache pass by luck.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
    return model


@pytest.mark.parametrize("rope", [True, False])
def test_kv_cache_gives_the_same_greedy_tokens_and_logits(rope):
    model = _model(rope=rope)
    prompt = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    cfg = SamplingConfig(max_new_tokens=40, greedy=True)
    with_cache = generate(model, prompt, cfg)
    without = generate(
        model, prompt, SamplingConfig(max_new_tokens=40, greedy=True, use_cache=False)
    )
    assert with_cache.shape == (3, 51)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0, 11:].tolist())) > 3  # not a degenerate repeat of one token

    # The cached decode's logits equal the full forward's at every position.
    caches = [None] * 3
    full = model(with_cache)
    step_logits = [model(with_cache[:, :11], kv_caches=caches, start_pos=0)]
    for pos in range(11, with_cache.shape[1]):
        step_logits.append(model(with_cache[:, pos : pos + 1], kv_caches=caches, start_pos=pos))
    torch.testing.assert_close(torch.cat(step_logits, 1), full, atol=1e-5, rtol=1e-5)


def test_attention_weights_path_matches_sdpa():
    model = _model()
    x = torch.randint(0, 64, (2, 20))
    logits, weights = model(x, need_weights=True)
    torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=1e-5)
    assert len(weights) == 3 and weights[0].shape == (2, 4, 20, 20)
    for w in weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 20))
        assert torch.all(w.triu(1) == 0)  # causal: no query sees a later key


def test_top_k_1_equals_greedy():
    model = _model()
    prompt = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(2))
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=30, greedy=True))
    gen = torch.Generator().manual_seed(5)
    top1 = generate(
        model, prompt, SamplingConfig(max_new_tokens=30, temperature=1.7, top_k=1), generator=gen
    )
    assert torch.equal(greedy, top1)
    # temperature 0 is greedy too
    t0 = generate(model, prompt, SamplingConfig(max_new_tokens=30, temperature=0.0))
    assert torch.equal(greedy, t0)


def _frequencies(logits: torch.Tensor, cfg: SamplingConfig, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    draws = sample_next(logits.expand(N_DRAWS, -1), cfg, gen)[:, 0]
    return torch.bincount(draws, minlength=logits.shape[-1]).float() / N_DRAWS


# 4 standard deviations of a frequency estimated from N_DRAWS draws (p = 0.5, the worst case).
TOL = 4 * math.sqrt(0.25 / N_DRAWS)


def test_temperature_divides_the_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    entropies = []
    for t in (0.5, 1.0, 2.0):
        expected = (logits / t).softmax(-1)[0]
        freq = _frequencies(logits, SamplingConfig(temperature=t))
        assert (freq - expected).abs().max() < TOL, (t, freq, expected)
        entropies.append(-(freq * freq.clamp_min(1e-12).log()).sum().item())
    assert entropies[0] < entropies[1] < entropies[2]  # colder is more peaked


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log()[None]
    # cumulative 0.5, 0.7, 0.85, ...: p=0.6 keeps the first two (0.5 < 0.6 <= 0.7), renormalised
    freq = _frequencies(logits, SamplingConfig(top_p=0.6))
    assert torch.all(freq[2:] == 0)
    expected = torch.tensor([0.5, 0.2]) / 0.7
    assert (freq[:2] - expected).abs().max() < TOL, freq
    # p=0.7 exactly reaches the second token: still two; p=0.71 needs the third
    assert torch.isinf(filter_logits(logits, top_p=0.7)[0, 2:]).all()
    assert torch.isfinite(filter_logits(logits, top_p=0.71)[0, :3]).all()
    # a tiny p keeps the most likely token alone; p=1 keeps everything
    assert torch.isfinite(filter_logits(logits, top_p=1e-6)).sum() == 1
    assert torch.isfinite(filter_logits(logits, top_p=1.0)).all()


def test_top_k_and_temperature_compose_in_order():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    cfg = SamplingConfig(temperature=2.0, top_k=3)
    expected = torch.zeros(6)
    expected[:3] = (logits[0, :3] / 2.0).softmax(-1)
    torch.testing.assert_close(next_token_probs(logits, cfg)[0], expected)
    freq = _frequencies(logits, cfg, seed=1)
    assert torch.all(freq[3:] == 0) and (freq - expected).abs().max() < TOL


def test_stop_id_pads_finished_rows_and_stops_early():
    model = _model()
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(4))
    free = generate(model, prompt, SamplingConfig(max_new_tokens=20, greedy=True))
    stop = int(free[0, 6])  # a token row 0 produces at its third new position
    out = generate(model, prompt, SamplingConfig(max_new_tokens=20, greedy=True), stop_id=stop)
    row = out[0, 4:].tolist()
    first = row.index(stop)
    assert all(t == stop for t in row[first:])
    assert torch.equal(out[:, : 4 + first + 1][1], free[1, : 4 + first + 1])


def test_bad_sampling_settings_are_refused():
    model = _model()
    prompt = torch.zeros(1, 100, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 128"):
        generate(model, prompt, SamplingConfig(max_new_tokens=29))
    for bad, msg in [
        (SamplingConfig(top_p=0.0), "top_p"),
        (SamplingConfig(temperature=-1.0), "temperature"),
        (SamplingConfig(top_k=-1), "top_k"),
    ]:
        with pytest.raises(ValueError, match=msg):
            bad.validate()

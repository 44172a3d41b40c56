"""Weighted data mixtures: the weights, exact resume at 1, 2 and 3 ranks, sources that run out,
per-source eval that leaves training untouched, and bad mixture configs refused in one line."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from dtrain.config import ConfigError, DataConfig, MixtureSourceConfig
from dtrain.data import build_data
from dtrain.data.mixture import CHUNK, Mixture
from dtrain.data.stream import is_heldout
from dtrain.errors import DataError
from tests.conftest import FAST, compose, launch, read_jsonl, train, train_losses
from tests.test_data import N_TOKENS, merged_state, numbered_corpus, step_all, streams

SEQ = 16


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (0.95, 0.05), (1.0, 3.0, 7.0, 9.0)])
def test_weights_hold_within_one_percent_over_10k_blocks(weights):
    mix = Mixture.of({f"s{i}": w for i, w in enumerate(weights)}, seed=3)
    n = 10_000
    counts = Counter(mix.source_of(k) for k in range(n))
    for m, w in enumerate(mix.weights):
        assert abs(counts[m] / n - w) < 0.01, (m, counts[m] / n, w)
    # Every whole chunk holds the weights to one block.
    whole = Counter(mix.source_of(k) for k in range(4 * CHUNK))
    assert all(abs(whole[m] - 4 * CHUNK * w) <= 1 for m, w in enumerate(mix.weights))


def test_the_choice_is_a_pure_function_of_seed_and_block_index():
    mix = Mixture.of({"a": 2.0, "b": 1.0}, seed=0)
    ks = [5_000_003, 17, 2048, 1023, 1024]
    fresh = Mixture.of({"a": 2.0, "b": 1.0}, seed=0)
    assert [mix.source_of(k) for k in ks] == [fresh.source_of(k) for k in reversed(ks)][::-1]
    other = Mixture.of({"a": 2.0, "b": 1.0}, seed=1)
    assert [mix.source_of(k) for k in range(200)] != [other.source_of(k) for k in range(200)]
    # A source that ended hands its blocks to the others; the others' blocks stay theirs.
    assert {mix.source_of(k, frozenset({1})) for k in range(500)} == {0}
    assert mix.source_of(7, frozenset({0, 1})) == -1


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two local sources of numbered tokens (each token in one document of one source): "big"
    holds two thirds of the documents, "small" one third."""
    root = tmp_path_factory.mktemp("mix")
    files, tok = numbered_corpus(root)
    origin = {}
    for f, path in enumerate(files):
        for line in Path(path).read_text().splitlines():
            for t in json.loads(line)["text"].split():
                origin[int(t)] = "small" if f == 2 else "big"
    return files, tok, origin


def mix_bundle(two_sources, *, weights=(0.5, 0.5), on_exhausted="repeat", num_streams=4):
    files, tok, _ = two_sources
    cfg = DataConfig(
        tokenizer=str(tok),
        shuffle_window=8,
        num_streams=num_streams,
        on_exhausted=on_exhausted,
        mixture=[
            MixtureSourceConfig(name="big", weight=weights[0], source="local", files=files[:2]),
            MixtureSourceConfig(name="small", weight=weights[1], source="local", files=files[2:]),
        ],
    )
    return build_data(cfg, seq_len=SEQ, seed=0, device=torch.device("cpu"))


def source_of_row(row: list[int], origin: dict) -> str:
    (src,) = {origin[t] for t in row if t != N_TOKENS}  # a block holds one source's tokens
    return src


def rows(step: list[torch.Tensor]) -> list[tuple]:
    return sorted(tuple(r) for x in step for r in x.tolist())


def test_blocks_come_from_their_chosen_source_and_resume_exactly_at_1_2_and_3_ranks(two_sources):
    bundle = mix_bundle(two_sources, weights=(0.7, 0.3))
    mix, origin = bundle.train.group.mix, two_sources[2]
    G, k, m = 6, 3, 12  # global batch 6; 15 steps cross the small source's epochs
    (ref,) = streams(bundle, 1, micro=G, workers=0)
    want = [step_all([ref])[0].tolist() for _ in range(k + m)]
    for step, batch in enumerate(want):  # one rank: row i of step n is block n*G + i
        for i, row in enumerate(batch):
            assert source_of_row(row, origin) == mix.names[mix.source_of(step * G + i)]
    assert ref.source_blocks() == dict(Counter(mix.names[mix.source_of(b)] for b in range(90)))
    want = [sorted(map(tuple, b)) for b in want]
    for a in (1, 2, 3):
        run = streams(bundle, a, micro=G // a, workers=2 if a == 2 else 0)
        assert [rows(step_all(run)) for _ in range(k)] == want[:k], a
        state = json.loads(json.dumps(merged_state(run)))
        assert sorted(state["streams"]) == sorted(f"{n}/{s}" for n in mix.names for s in range(4))
        for b in (1, 2, 3):
            resumed = streams(bundle, b, micro=G // b, workers=0)
            for r in resumed:
                r.load_state_dict(state)
            assert [rows(step_all(resumed)) for _ in range(m)] == want[k:], (a, b)
            for r in resumed:
                r.close()
        for r in run:
            r.close()


def test_weights_may_change_and_sources_join_at_a_resume(two_sources):
    files, tok, origin = two_sources
    only_big = build_data(
        DataConfig(
            tokenizer=str(tok),
            shuffle_window=8,
            num_streams=4,
            mixture=[MixtureSourceConfig(name="big", source="local", files=files[:2])],
        ),
        seq_len=SEQ,
        seed=0,
        device=torch.device("cpu"),
    )
    (first,) = streams(only_big, 1, micro=4, workers=0)
    before = [r for _ in range(5) for r in step_all([first])[0].tolist()]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["source_blocks"] == {"big": 20}
    for weights in ((0.5, 0.5), (0.8, 0.2)):  # "small" joins, then the weights change
        bundle = mix_bundle(two_sources, weights=weights)
        (b,) = streams(bundle, 1, micro=4, workers=0)
        b.load_state_dict(state)
        after = [r for _ in range(5) for r in step_all([b])[0].tolist()]
        mix = bundle.train.group.mix
        want = [mix.names[mix.source_of(k)] for k in range(len(before), len(before) + 20)]
        assert [source_of_row(r, origin) for r in after] == want
        seen = Counter(t for r in before + after for t in r if t != N_TOKENS)
        assert max(seen.values()) == 1  # "big" goes on where it was: nothing read twice
        counts = Counter(source_of_row(r, origin) for r in before + after)
        assert b.source_blocks() == {"big": counts["big"], "small": counts["small"]}
        state = json.loads(json.dumps(b.state_dict()))
        before += after


def trained_tokens(bs, steps: int) -> tuple[Counter, str]:
    """Tokens of up to `steps` steps of every rank, and the error that stopped them."""
    seen: Counter = Counter()
    for _ in range(steps):
        try:
            for x in step_all(bs):
                seen.update(t for t in x.flatten().tolist() if t != N_TOKENS)
        except DataError as e:
            return seen, str(e)
    return seen, ""


def training_tokens(two_sources, source: str) -> set[int]:
    files, _, origin = two_sources
    held = set()
    for path in files:
        for line in Path(path).read_text().splitlines():
            text = json.loads(line)["text"]
            if is_heldout(text, 0.02):
                held |= {int(t) for t in text.split()}
    return {t for t, s in origin.items() if s == source} - held


def test_on_exhausted_stop_stops_at_the_same_step_at_1_and_2_ranks_with_every_token_once(
    two_sources,
):
    bundle = mix_bundle(two_sources, on_exhausted="stop")
    one, error = trained_tokens(streams(bundle, 1, micro=4, workers=0), 200)
    assert "data source 'small' ran out (data.on_exhausted=stop)" in error
    assert max(one.values()) == 1  # nothing read twice
    assert set(one) & training_tokens(two_sources, "small")
    two, error = trained_tokens(streams(bundle, 2, micro=2, workers=1), 200)
    assert "data source 'small' ran out" in error
    assert two == one  # the same blocks, up to the same step


def test_on_exhausted_reweight_trains_on_past_the_end_of_a_source(two_sources, caplog):
    stopped, _ = trained_tokens(streams(mix_bundle(two_sources, on_exhausted="stop"), 1), 400)
    bundle = mix_bundle(two_sources, on_exhausted="reweight")
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        (b,) = streams(bundle, 1, micro=4, workers=0)
        seen, error = trained_tokens([b], 400)
    assert "the data ran out: stream" in error and "of every source is read to its end" in error
    said = [r.message for r in caplog.records if "ran out" in r.message]
    assert len([s for s in said if "'small' ran out" in s]) == 1, said  # said once
    assert max(seen.values()) == 1  # nothing read twice
    assert set(stopped) < set(seen)  # the same blocks up to the end of 'small', then more
    every = training_tokens(two_sources, "big") | training_tokens(two_sources, "small")
    assert len(set(seen)) > 0.75 * len(every)
    # Resumed after the small source ran out: the same blocks as without the resume.
    (straight,) = streams(bundle, 1, micro=4, workers=0)
    for _ in range(12):
        step_all([straight])
    state = json.loads(json.dumps(straight.state_dict()))
    want = [rows(step_all([straight])) for _ in range(4)]
    resumed = streams(bundle, 2, micro=2, workers=0)
    for r in resumed:
        r.load_state_dict(state)
    assert [rows(step_all(resumed)) for _ in range(4)] == want


# --- the run: per-source eval and logging, bit-identical training with and without eval -----

MIX = ["data=mixture", "data.mixture.0.max_bytes=300000", "trainer.max_steps=6"]


def test_eval_per_source_leaves_training_bit_identical(tmp_path):
    logged = ["trainer.log_every=1", "checkpoint.save_final=false"]
    train(tmp_path / "plain", *MIX, *logged, "trainer.eval_every=0")
    train(tmp_path / "evals", *MIX, *logged, "trainer.eval_every=2")
    plain, evals = train_losses(tmp_path / "plain"), train_losses(tmp_path / "evals")
    assert sorted(plain) == list(range(1, 7))
    assert plain == evals  # bit-identical: eval moves neither the data nor any generator
    records = read_jsonl(tmp_path / "evals" / "metrics.jsonl")
    ev = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in ev] == [0, 2, 4, 6]
    for r in ev:
        assert set(r["eval_sources"]) == {"python", "docs"}
        assert r["eval_seconds"] > 0
        by_weight = (
            0.8 * r["eval_sources"]["python"]["loss"] + 0.2 * r["eval_sources"]["docs"]["loss"]
        )
        assert r["eval_loss"] == pytest.approx(by_weight)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "evals" / "tensorboard" / "single-fp32-w1-tiny"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for name in ("python", "docs"):
        assert {f"eval/{name}/loss", f"eval/{name}/ppl", f"data/{name}/tokens"} <= tags
    assert [e.step for e in acc.Scalars("eval/docs/loss")] == [0, 2, 4, 6]
    assert "eval/seconds" in tags
    last = [r for r in records if "data_tokens" in r][-1]
    assert sum(last["data_tokens"].values()) == last["tokens_seen"]  # every block counted once
    assert set(last["data_share"]) == {"python", "docs"}

    from dtrain.cli.compare import read_run, render_table

    table = render_table([read_run(tmp_path / "plain"), read_run(tmp_path / "evals")])
    head = table.splitlines()[0]
    assert "eval python" in head and "eval docs" in head
    docs = ev[-1]["eval_sources"]["docs"]["loss"]
    assert f"{docs:.4f}" in table.splitlines()[-1]


def test_tensorboard_charts_every_source_eval_beside_the_training_loss():
    import re

    from dtrain.reporting.tensorboard import layout

    charts = layout(cuda=False, mfu=False, evals=True, mixture=True)
    loss = charts["training"]["loss"][1]
    tags = ["train/loss", "eval/loss", "eval/python/loss", "eval/docs/loss"]
    assert all(any(re.fullmatch(p, t) for p in loss) for t in tags)
    assert not any(re.fullmatch(p, "eval/downstream/cloze/acc") for p in loss)
    assert any(re.fullmatch(p, "data/docs/share") for p in sum(
        (c[1] for c in charts["data and eval"].values()), []))  # fmt: skip
    assert "data and eval" not in layout(cuda=False, mfu=False)  # no empty charts


def test_a_mixture_saved_by_fsdp_on_2_ranks_resumes_on_1_with_the_same_losses(tmp_path):
    args = [*MIX, "trainer.log_every=1", "trainer.eval_every=0", "trainer.micro_batch_size=4"]
    train(tmp_path / "single", *args, "trainer.micro_batch_size=8")
    res = launch(
        *FAST,
        *args,
        "strategy=fsdp",
        "trainer.stop_at_step=3",
        "trainer.eval_every=3",  # the sharded model scores every source
        f"hydra.run.dir={tmp_path}/moved",
        nproc=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ev = [r for r in read_jsonl(tmp_path / "moved" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in ev] == [0, 3]
    assert all(set(r["eval_sources"]) == {"python", "docs"} for r in ev)
    last = [r for r in read_jsonl(tmp_path / "moved" / "metrics.jsonl") if "data_tokens" in r][-1]
    assert sum(last["data_tokens"].values()) == last["tokens_seen"]  # both ranks' blocks
    train(
        tmp_path / "resumed",
        *args,
        "trainer.micro_batch_size=8",
        f"resume={tmp_path}/moved/checkpoints/step_0000003",
    )
    a, b = train_losses(tmp_path / "single"), train_losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for step in b:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


# --- bad mixtures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, match",
    [
        ("data.mixture.0.weight=-1", r"data.mixture\[0\].weight must be a finite number > 0"),
        ("data.mixture.1.weight=nan", r"data.mixture\[1\].weight must be a finite number > 0"),
        ("data.mixture.1.name=python", r"data.mixture\[1\].name='python' is used twice"),
        ("data.mixture.1.name=downstream", r"data.mixture\[1\].name='downstream' is taken"),
        ("data.mixture.0.name='a b'", r"data.mixture\[0\].name='a b' is not valid"),
        ("data.mixture.0.source=synthetic", r"data.mixture\[0\].source='synthetic' is not valid"),
        ("+data.mixture.0.tokenizer=gpt2", r"unknown config key 'data.mixture\[0\].tokenizer'"),
        ("data.on_exhausted=again", r"data.on_exhausted='again' is not valid; choose repeat"),
    ],
)
def test_bad_mixtures_are_refused_in_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        compose("data=mixture", override)
    assert "\n" not in str(e.value)


def test_cli_bad_mixture_exits_2_with_one_line(tmp_path):
    res = launch("data=mixture", "data.mixture.1.weight=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines == ["error: data.mixture[1].weight must be a finite number > 0, got 0.0"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _report_run(counts: dict, weights: dict):
    from types import SimpleNamespace as NS

    return NS(
        data=NS(mixed=True, weights=weights),
        stream=NS(source_blocks=lambda: counts),
        cfg=NS(trainer=NS(seq_len=4), data=NS(share_tolerance=0.01, on_exhausted="reweight")),
    )


def test_a_share_off_its_weight_is_said_once_and_only_over_enough_blocks(caplog):
    from dtrain.run.source_report import CHECK_AFTER, SourceReport

    weights = {"a": 0.8, "b": 0.2}
    off = {"a": 3 * CHECK_AFTER // 4, "b": CHECK_AFTER - 3 * CHECK_AFTER // 4}
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        few = SourceReport(_report_run({"a": 3, "b": 1}, weights))
        few.report(1, {})
        assert not caplog.records  # 4 blocks say nothing yet
        report, info = SourceReport(_report_run(off, weights)), {}
        scalars = report.report(10, info)
        report.report(11, {})
        near = {"a": int(CHECK_AFTER * 0.805), "b": CHECK_AFTER - int(CHECK_AFTER * 0.805)}
        SourceReport(_report_run(near, weights)).report(12, {})
    assert scalars["data/a/share"] == pytest.approx(0.75)
    assert scalars["data/b/tokens"] == 4 * off["b"]
    assert info["data_share"]["b"] == pytest.approx(0.25)
    (said,) = [r.message for r in caplog.records]
    assert "data source 'a' is 75.0% of the blocks trained on, its weight 80.0%" in said


def test_a_bpe_tokenizer_is_trained_on_every_source_and_found_again(two_sources, tmp_path):
    from dtrain.data import tokenizer_for

    files, _, _ = two_sources
    docs = tmp_path / "words.txt"
    docs.write_text("\n\n".join("zebra quokka " * 30 for _ in range(40)))
    cfg = DataConfig(
        tokenizer="bpe",
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
        num_streams=2,
        mixture=[
            MixtureSourceConfig(name="numbers", source="local", files=files),
            MixtureSourceConfig(name="words", source="local", files=str(docs), format="text"),
        ],
    )
    bundle = build_data(cfg, seq_len=SEQ, seed=0, device=torch.device("cpu"))
    vocab = bundle.tokenizer.tok.get_vocab()
    assert any("quokka" in t for t in vocab)  # learnt from the second source too
    assert list((tmp_path / "cache").rglob("*.json"))
    again = tokenizer_for(cfg)  # what generate and export load: the cached one
    assert again.tok.get_vocab() == vocab

"""Downstream evaluation: its items, the scorer on models whose answer is known, the tasks
during training (same training with and without them), the CLI, compare and TensorBoard."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from dtrain.data.tokenizer import ByteTokenizer
from dtrain.errors import CheckpointError, ConfigError
from dtrain.evaluation import Item, accuracy, build_tasks, encode_requests, score_requests
from dtrain.evaluation.scorer import choice_logprobs
from tests.conftest import FAST, ROOT, cli_env, compose, launch, read_jsonl, train, train_losses

BYTES = ByteTokenizer()
CLOSE = {"(": ")", "[": "]", "{": "}"}


def repeat_model(x: torch.Tensor, vocab: int = 320, p: float = 0.9) -> torch.Tensor:
    """Logits of a model that gives the input token probability p as the next one and shares
    the rest evenly among the other tokens: it knows that text repeats."""
    rest = math.log((1 - p) / (vocab - 1))
    logits = torch.full((*x.shape, vocab), rest)
    return logits.scatter(-1, x.unsqueeze(-1), math.log(p))


# --- the scorer ------------------------------------------------------------------------------


def test_accuracy_and_length_normalised_accuracy_on_hand_checked_numbers():
    items = [
        Item("q", ("a", "bbbb"), answer=1),  # -2 vs -4: acc picks a; per char -2 vs -1: bbbb
        Item("q", ("cc", "d", "e"), answer=0),  # -1 (per char -0.5) is best both ways
    ]
    scores = accuracy(items, [-2.0, -4.0, -1.0, -3.0, -2.0])
    assert scores == {"acc": 0.5, "acc_norm": 1.0}
    assert accuracy(items[:1], [-2.0, -2.0]) == {"acc": 0.0, "acc_norm": 1.0}  # a tie: first
    with pytest.raises(ValueError):
        accuracy(items, [-1.0, -2.0])


def test_choice_logprobs_sums_the_log_probabilities_of_the_choice_tokens_only():
    logits = torch.zeros(2, 4, 2)  # every token has probability 1/2
    logits[1, 2] = torch.tensor([0.0, math.log(3.0)])  # 1/4 and 3/4 at row 1, position 2
    y = torch.tensor([[0, 1, 0, 1], [1, 1, 1, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    got = choice_logprobs(logits, y, mask)
    assert torch.allclose(got, torch.tensor([3 * math.log(0.5), math.log(0.75)], dtype=got.dtype))


def test_requests_hold_the_context_then_the_choice_cut_from_the_left():
    item = Item("abcdef", ("gh", "x"), answer=0)
    first, second = encode_requests([item], BYTES, max_len=5)
    assert first.tokens == tuple(b"cdefgh") and first.n_choice == 2  # 6 tokens = max_len + 1
    assert encode_requests([item], BYTES, max_len=50)[0].tokens == (256, *b"abcdefgh")
    assert second.tokens[-1] == ord("x") and second.n_choice == 1


def test_bpe_requests_tokenize_context_and_choice_together():
    from dtrain.data.tokenizer import HFTokenizer, train_bpe

    text = "def forward(self, x):\n    return self.proj(x)\n" * 50
    tok = HFTokenizer(train_bpe([text], 300), "bpe")
    item = Item("    return self.", ("proj(x)", "forward"), answer=0)
    for r, choice in zip(encode_requests([item], tok, max_len=64), item.choices):
        assert r.tokens[0] == tok.eot_id and list(r.tokens[1:]) == tok.encode(item.context + choice)
        assert r.n_choice >= 1 and tok.decode(r.tokens[-r.n_choice :]).endswith(choice[-2:])


def test_the_scorer_picks_the_choice_a_model_makes_likely():
    # The repeating model prefers the choice that repeats the context's last character.
    items = [Item("x = aaaa", ("a", "b", "c"), 0), Item("y = bbb", ("a", "b"), 1)] * 3
    items += [Item("zz", ("az", "zz", "zq"), 1), Item("q", ("q", "qq"), 0)]
    requests = encode_requests(items, BYTES, max_len=32)
    length = max(len(r.tokens) - 1 for r in requests)
    lp = score_requests(requests, repeat_model, batch_size=3, length=length, pad_id=256)
    assert accuracy(items, lp)["acc"] == 1.0
    assert lp[-1] < lp[-2]  # a longer repeat: one more factor of 0.9
    # Dealt across two ranks, then summed: the same scores as one rank.
    halves = [
        score_requests(
            requests, repeat_model, batch_size=2, length=length, pad_id=256, rank=r, world_size=2
        )
        for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*halves)] == pytest.approx(lp, abs=1e-9)


# --- the items -------------------------------------------------------------------------------


def test_bracket_items_are_answered_by_the_innermost_open_bracket():
    items = build_tasks(["brackets"], 200, seed=0)["brackets"]
    assert len(items) == 200 and items == build_tasks(["brackets"], 200, seed=0)["brackets"]
    assert items != build_tasks(["brackets"], 200, seed=1)["brackets"]
    for item in items:
        stack = [c for c in item.context if c in "([{)]}"]
        opened = []
        for c in stack:
            opened = opened[:-1] if c in ")]}" else [*opened, c]
        assert item.choices[item.answer] == CLOSE[opened[-1]], item
    assert {i.answer for i in items} == {0, 1, 2}  # the right choice is not always first


def test_cloze_items_come_from_held_out_documents_of_the_default_corpus():
    from dtrain.config import DataConfig
    from dtrain.evaluation.cloze import heldout_documents

    items = build_tasks(["stdlib_cloze"], 100, seed=0)["stdlib_cloze"]
    docs = heldout_documents()
    assert docs and len(items) == 100
    from dtrain.data.stream import is_heldout

    assert all(is_heldout(d, DataConfig().eval_fraction) for d in docs)
    for item in items:
        right = item.context + item.choices[item.answer]
        assert any(right in d for d in docs), item
        assert len(item.choices) == 4 and all(re.fullmatch(r"\w+", c) for c in item.choices)


def test_more_cloze_items_than_the_held_out_text_gives_is_one_line():
    from dtrain.errors import DataError

    with pytest.raises(DataError, match=r"give \d+ items, fewer than downstream.items=100000"):
        build_tasks(["stdlib_cloze"], 100_000, seed=0)


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["downstream.tasks=[brackets,trivia]"], "downstream.tasks has 'trivia'; valid tasks"),
        (["downstream.every=150"], "must be a multiple of trainer.eval_every=100"),
        (["downstream.every=100", "data=synthetic"], "data.source=synthetic has no tokenizer"),
        (["downstream.every=100", "downstream.tasks=[]"], "downstream.tasks is empty"),
        (
            ["downstream.every=100", "strategy=fsdp", "parallel.tp=2"],
            "not available with parallel.tp=2",
        ),
        (["downstream.items=0"], "downstream.items must be in [1, 100000]"),
    ],
)
def test_bad_downstream_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(*overrides)


def test_a_bad_task_at_launch_is_one_line_and_exit_2(tmp_path):
    r = launch(*FAST, "downstream.tasks=[nope]", f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "downstream.tasks has 'nope'" in r.stderr and not (tmp_path / "run").exists()


# --- during training, the CLI, compare -------------------------------------------------------

STEPS = [
    "trainer.max_steps=6",
    "trainer.eval_every=2",
    "checkpoint.every_n_steps=0",
    "inspect.samples=false",  # evals of the loss and the tasks only: quicker
    "inspect.attention_maps=false",
]
SMALL = ["downstream.items=12"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny run without and with downstream scoring at every eval."""
    root = tmp_path_factory.mktemp("downstream")
    train(root / "plain", *STEPS)
    train(root / "scored", *STEPS, *SMALL, "downstream.every=2")
    return root


def test_downstream_scoring_leaves_training_bit_identical(runs):
    plain, scored = runs / "plain", runs / "scored"
    assert train_losses(plain) == train_losses(scored) and train_losses(plain)
    evals = [
        [r["eval_loss"] for r in read_jsonl(d / "metrics.jsonl") if "eval_loss" in r]
        for d in (plain, scored)
    ]
    assert evals[0] == evals[1] and len(evals[0]) == 4


def test_turning_downstream_scoring_on_resumes_the_same_run(runs):
    from dtrain.run.preflight import config_changes

    plain = runs / "plain"
    cfg = compose(*FAST, *STEPS, "downstream.every=2", "downstream.tasks=[brackets]")
    assert config_changes(cfg, plain) == []
    assert config_changes(compose(*FAST, *STEPS, "seed=1"), plain) == ["seed 1337 -> 1"]


def test_downstream_scores_are_logged_at_eval_steps(runs):
    records = [r for r in read_jsonl(runs / "scored" / "metrics.jsonl") if "downstream" in r]
    assert [r["step"] for r in records] == [0, 2, 4, 6]
    for r in records:
        assert set(r["downstream"]) == {
            f"{t}/{m}" for t in ("stdlib_cloze", "brackets") for m in ("acc", "acc_norm")
        }
        assert all(0 <= v <= 1 for v in r["downstream"].values()) and r["downstream_s"] > 0
    assert not any("downstream" in r for r in read_jsonl(runs / "plain" / "metrics.jsonl"))


def _last_scores(run_dir) -> dict:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "downstream" in r][-1]["downstream"]


def test_the_cli_scores_a_checkpoint_as_the_run_did(runs, capsys):
    from dtrain.cli.evaluate import main

    out = main([str(runs / "scored"), "items=12"])
    logged = _last_scores(runs / "scored")
    for task, s in out.items():
        assert s["items"] == 12
        assert (s["acc"], s["acc_norm"]) == (logged[f"{task}/acc"], logged[f"{task}/acc_norm"])
    printed = capsys.readouterr().out
    assert "stdlib_cloze" in printed and "brackets" in printed


def test_the_cli_scores_an_export(runs, tmp_path, capsys):
    from dtrain.cli import evaluate, export

    export.main([f"checkpoint={runs / 'scored'}", f"out={tmp_path / 'hf'}"])
    out = evaluate.main([f"checkpoint={tmp_path / 'hf'}", "items=12", "json=true"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == out
    logged = _last_scores(runs / "scored")
    for task, s in out.items():  # other padding than the run's: equal up to an item's flip
        assert abs(s["acc"] - logged[f"{task}/acc"]) <= 1 / 12 + 1e-9


def test_the_cli_refuses_bad_paths_and_tasks_in_one_line(runs, tmp_path):
    from dtrain.cli.evaluate import main

    with pytest.raises(ConfigError, match="no such checkpoint, run dir or export"):
        main([f"checkpoint={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        main([str(runs / "scored"), "tasks=[nope]"])
    with pytest.raises(CheckpointError):
        main([str(tmp_path)])  # a folder that is neither
    r = subprocess.run(
        [sys.executable, "-m", "dtrain.cli.evaluate", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.startswith("error: checkpoint=")
        and r.stderr.count("\n") == 1
    ), r.stderr


def test_compare_puts_downstream_scores_side_by_side(runs, tmp_path):
    import shutil

    from dtrain.cli.compare import read_run, render_table

    table = render_table([read_run(runs / "plain"), read_run(runs / "scored")])
    head, _, plain, scored = table.splitlines()
    assert "stdlib_cloze acc/norm" in head and "brackets acc/norm" in head
    logged = _last_scores(runs / "scored")
    assert f"{logged['brackets/acc']:.3f}/{logged['brackets/acc_norm']:.3f}" in scored
    assert plain.rstrip().endswith("-")
    # From TensorBoard's event files alone, the same scores.
    shutil.copytree(runs / "scored" / "tensorboard", tmp_path / "events" / "tensorboard")
    assert read_run(tmp_path / "events").downstream == pytest.approx(logged)
    # and the loggers' final summary carries them
    assert read_run(runs / "scored").final()["downstream/brackets/acc"] == logged["brackets/acc"]


def test_tensorboard_shows_every_task_in_one_chart(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from dtrain.reporting.tensorboard import event_dirs

    def charts(run_dir) -> tuple[dict, list[str]]:
        (d,) = event_dirs(run_dir)
        acc = EventAccumulator(str(d), size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        raw = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
        cats = layout_pb2.Layout.FromString(raw).category
        out = {c.title: list(c.multiline.tag) for cat in cats for c in cat.chart}
        return out, acc.Tags()["scalars"]

    scored, tags = charts(runs / "scored")
    (pattern,) = scored["downstream accuracy"]
    lines = sorted(t for t in tags if re.search(pattern, t))
    assert lines == sorted(
        f"eval/downstream/{t}/{m}"
        for t in ("stdlib_cloze", "brackets")
        for m in ("acc", "acc_norm")
    )
    assert "downstream accuracy" not in charts(runs / "plain")[0]  # no empty chart


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_models_on_two_ranks_score_as_one_rank_does(runs, tmp_path, strategy):
    """Every rank takes part in the sharded forward; the scores, summed across ranks, are
    those of one rank (at step 0, where both runs hold the same weights)."""
    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    r = launch(
        *FAST,
        *STEPS[1:],
        *SMALL,
        "trainer.max_steps=2",
        f"strategy={strategy}",
        "downstream.every=2",
        f"hydra.run.dir={tmp_path}/sharded",
        nproc=2,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    sharded = [x for x in read_jsonl(tmp_path / "sharded" / "metrics.jsonl") if "downstream" in x]
    single = [x for x in read_jsonl(runs / "scored" / "metrics.jsonl") if "downstream" in x]
    assert [x["step"] for x in sharded] == [0, 2]
    assert sharded[0]["downstream"] == single[0]["downstream"]

"""The data path: exact sharding over ranks x workers, exact resume, tokenizers, bad data."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from dtrain.config import DataConfig
from dtrain.data import BatchStream, build_data, eval_batches
from dtrain.data.loader import merge_positions
from dtrain.errors import DataError
from tests.conftest import launch, read_jsonl

N_TOKENS = 1500  # numbered tokens "0".."1499", each in exactly one document
SEQ = 16


def numbered_corpus(root: Path, n_files: int = 3, seed: int = 0) -> tuple[list[str], Path]:
    """jsonl files of documents made of unique numbered words, and a WordLevel tokenizer that
    maps word "i" to id i (end-of-text: N_TOKENS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs, i = [], 0
    while i < N_TOKENS:
        n = min(rng.randint(1, 40), N_TOKENS - i)
        docs.append(" ".join(str(t) for t in range(i, i + n)))
        i += n
    files = []
    for f in range(n_files):
        path = root / f"part{f}.jsonl"
        with open(path, "w") as fh:
            for d in docs[f::n_files]:
                fh.write(json.dumps({"id": 0, "text": d}) + "\n")
        files.append(str(path))
    vocab = {str(t): t for t in range(N_TOKENS)} | {"<|endoftext|>": N_TOKENS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return files, root / "tokenizer.json"


def local_cfg(files, tokenizer="byte", **kw) -> DataConfig:
    return DataConfig(source="local", files=files, tokenizer=tokenizer, **kw)


def streams(bundle, world, micro=2, workers=2, accum=1) -> list[BatchStream]:
    bundle.train.num_workers = workers
    return [
        BatchStream(
            bundle.train,
            micro_batch_size=micro,
            grad_accum_steps=accum,
            rank=r,
            world_size=world,
            seed=0,
            device=torch.device("cpu"),
        )
        for r in range(world)
    ]


def step_all(bs: list[BatchStream]) -> list[torch.Tensor]:
    """One step of every rank: each rank's inputs, (micro * accum, T)."""
    return [torch.cat([x for x, _ in b.next_step()]) for b in bs]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return numbered_corpus(tmp_path_factory.mktemp("numbered"))


def corpus_docs(files) -> list[list[int]]:
    return [
        [int(t) for t in json.loads(line)["text"].split()]
        for f in files
        for line in Path(f).read_text().splitlines()
    ]


def epochs_of(tokens: list[int]) -> list[list[int]]:
    """Cut one stream's token sequence where a (non end-of-text) token comes back: epochs."""
    out, seen = [[]], set()
    for t in tokens:
        if t != N_TOKENS and t in seen:
            out.append([])
            seen = set()
        seen.add(t)
        out[-1].append(t)
    return out


def test_every_token_once_per_epoch_with_2_ranks_x_2_workers(corpus):
    from dtrain.data.stream import is_heldout

    files, tok = corpus
    bundle = build_data(
        local_cfg(files, str(tok), eval_fraction=0.05, shuffle_window=8),
        seq_len=SEQ,
        seed=0,
        device=torch.device("cpu"),
    )
    world, S = 2, bundle.train.spec.n_streams
    bs = streams(bundle, world)
    rows: list[list[list[int]]] = [[] for _ in range(world)]
    while min(st["epoch"] for b in bs for st in b.states.values()) < 2:
        for r, x in enumerate(step_all(bs)):
            rows[r].extend(x.tolist())
    per_stream: dict[int, list[int]] = {s: [] for s in range(S)}
    for r in range(world):
        for j, row in enumerate(rows[r]):
            per_stream[(r + world * j) % S].extend(row)  # row j of rank r is block r + world*j

    docs = corpus_docs(files)
    held = [d for d in docs if is_heldout(" ".join(map(str, d)), 0.05)]
    assert 0 < len(held) < len(docs) // 5
    held_tokens = {t for d in held for t in d}
    train_docs = len(docs) - len(held)
    for e in (0, 1):  # two full epochs of every stream
        got = Counter()
        n_eot = 0
        for s in range(S):
            ep = epochs_of(per_stream[s])
            assert len(ep) >= 3, (s, len(ep))
            got.update(t for t in ep[e] if t != N_TOKENS)
            n_eot += ep[e].count(N_TOKENS)
        assert set(got) == set(range(N_TOKENS)) - held_tokens, e  # no gap, nothing held out
        assert max(got.values()) == 1, e  # no duplicate
        # Every training document ends with one end-of-text (the last one may sit across the
        # seam between epochs, in the next epoch's segment).
        assert train_docs - S <= n_eot <= train_docs
    # A new permutation every epoch.
    assert any(epochs_of(per_stream[s])[0] != epochs_of(per_stream[s])[1] for s in range(S))
    # Eval blocks hold held-out documents only.
    ev = bundle.eval.get(4)
    assert {t for t in ev.flatten().tolist() if t != N_TOKENS} <= held_tokens


def merged_state(bs: list[BatchStream]) -> dict:
    """What state_dict() gathers over ranks under torchrun (here: one process per test)."""
    states = [b.state_dict() for b in bs]
    state = states[0]
    state["streams"], state["skipped"] = merge_positions(
        [(st["streams"], st["skipped"]) for st in states]
    )
    return state


def test_resume_after_k_steps_gives_the_uninterrupted_batches(corpus):
    files, tok = corpus
    cfg = local_cfg(files, str(tok), shuffle_window=8)
    bundle = build_data(cfg, seq_len=SEQ, seed=0, device=torch.device("cpu"))
    straight = streams(bundle, 2, micro=2, accum=2)
    k, m = 7, 30  # m steps after resume cross epoch seams of every stream
    for _ in range(k):
        step_all(straight)
    state = json.loads(json.dumps(merged_state(straight)))  # as it goes through the manifest
    expect = [step_all(straight) for _ in range(m)]

    resumed = streams(bundle, 2, micro=2, accum=2)
    for b in resumed:
        b.load_state_dict(state)
    for i in range(m):
        for a, b in zip(expect[i], step_all(resumed)):
            assert torch.equal(a, b), i

    # Another world size: 1 rank, micro 8 (same global batch) continues with the same blocks.
    (single,) = streams(bundle, 1, micro=8, accum=1, workers=1)
    single.load_state_dict(state)
    for i in range(m):
        (got,) = step_all([single])
        want = torch.cat(expect[i])
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist())), i

    other = build_data(
        local_cfg(files, str(tok), num_streams=4), seq_len=SEQ, seed=0, device=torch.device("cpu")
    )
    (b4,) = streams(other, 1)
    with pytest.raises(DataError, match="into data.num_streams=4"):
        b4.load_state_dict(state)


def rows_of_step(bs: list[BatchStream]) -> list[tuple]:
    """The sequences every rank trains on in the next step, as one sorted list."""
    return sorted(tuple(row) for x in step_all(bs) for row in x.tolist())


WORLDS = (1, 2, 3, 4, 6)  # 8 streams: divides them, or shares them (3 and 6 read all or half)


def test_any_world_size_resumes_exactly_at_any_other(corpus):
    # Global batch 12 at every world size; 20 steps after the resume cross epoch seams.
    files, tok = corpus
    bundle = build_data(
        local_cfg(files, str(tok), shuffle_window=8),
        seq_len=SEQ,
        seed=0,
        device=torch.device("cpu"),
    )
    assert bundle.train.spec.n_streams == 8  # the default
    k, m, G = 5, 20, 12
    (ref,) = streams(bundle, 1, micro=G, workers=0)
    want = [rows_of_step([ref]) for _ in range(k + m)]
    for a in WORLDS:
        run = streams(bundle, a, micro=G // a, workers=2 if a == 3 else 0)
        assert [rows_of_step(run) for _ in range(k)] == want[:k], a
        state = json.loads(json.dumps(merged_state(run)))
        assert sorted(state["streams"], key=int) == [str(s) for s in range(8)]
        for b in WORLDS:
            if b == a:
                continue
            resumed = streams(bundle, b, micro=G // b, workers=0)
            for r in resumed:
                r.load_state_dict(state)
            got = [rows_of_step(resumed) for _ in range(m)]
            assert got == want[k:], (a, b)
            for r in resumed:
                r.close()
        for r in run:
            r.close()


def test_the_default_data_starts_at_every_world_size_and_plans_its_sharing():
    from dtrain.data import data_note

    cfg = DataConfig(max_bytes=300_000)  # the embedded default, small
    bundle = build_data(cfg, seq_len=32, seed=0, device=torch.device("cpu"))
    (ref,) = streams(bundle, 1, micro=12, workers=0)
    want = [rows_of_step([ref]) for _ in range(2)]
    for world in WORLDS:
        bs = streams(bundle, world, micro=12 // world, workers=0)
        assert [rows_of_step(bs) for _ in range(2)] == want, world
        for b in bs:
            b.close()
    assert data_note(cfg, 8) is None and data_note(cfg, 4) is None
    assert "each rank tokenizes 128x" in data_note(cfg, 1024)
    assert "data.num_streams=1024 reads each record once" in data_note(cfg, 1024)
    assert "stop at start-up: data.num_streams must be >= 1" in data_note(
        DataConfig(num_streams=0), 16
    )


def test_data_with_fewer_documents_than_streams_says_to_lower_them(tmp_path):
    (tmp_path / "tiny.txt").write_text("one small doc here\n\ntwo small doc\n\nthree\n")
    bundle = build_data(
        local_cfg(str(tmp_path / "tiny.txt"), eval_fraction=0.0),
        seq_len=8,
        seed=0,
        device=torch.device("cpu"),
    )
    (b,) = streams(bundle, 3, micro=1, workers=0)[:1]
    with pytest.raises(DataError, match=r"has no tokens in epoch 0: fewer usable documents than "
                       r"data.num_streams \(lower it\)"):  # fmt: skip
        b.next_step()
    b.close()


def test_eval_batches_are_fixed_and_split_across_ranks(corpus):
    files, tok = corpus
    bundle = build_data(local_cfg(files, str(tok)), seq_len=SEQ, seed=0, device=torch.device("cpu"))
    kw = dict(micro_batch_size=2, steps=3, world_size=2, device=torch.device("cpu"))
    a = [x for x, _ in eval_batches(bundle.eval, rank=0, **kw)]
    b = [x for x, _ in eval_batches(bundle.eval, rank=1, **kw)]
    again = [x for x, _ in eval_batches(bundle.eval, rank=0, **kw)]
    assert all(torch.equal(x, y) for x, y in zip(a, again))
    assert not any(torch.equal(x, y) for x, y in zip(a, b))


def test_formats_globs_and_directories(tmp_path):
    text = "alpha beta gamma\n\ndelta epsilon\n\n"
    (tmp_path / "t").mkdir()
    (tmp_path / "t/a.txt").write_text(text * 20)
    (tmp_path / "t/b.txt").write_text(text * 20)
    rows = [{"text": f"doc {i} " * 20, "n": i} for i in range(60)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    dev = torch.device("cpu")
    for files in (
        str(tmp_path / "t"),
        str(tmp_path / "t/*.txt"),
        str(tmp_path / "d.jsonl"),
        [str(tmp_path / "d.parquet")],
    ):
        bundle = build_data(local_cfg(files, eval_fraction=0.1), seq_len=8, seed=0, device=dev)
        (b,) = streams(bundle, 1, workers=0)
        x = torch.cat([x for x, _ in b.next_step()])
        assert x.shape == (2, 8) and x.max() <= 256
        assert bundle.tokenizer.decode(x[0].tolist()).strip(), files


def test_bad_records_are_skipped_and_counted(tmp_path):
    good = [json.dumps({"text": f"good document number {i} " * 5}) for i in range(40)]
    bad = [json.dumps({"text": ""}), json.dumps({"text": "   "}), json.dumps({"other": 1})]
    (tmp_path / "d.jsonl").write_text("\n".join(good[:20] + bad + good[20:]) + "\n")
    (tmp_path / "u.txt").write_bytes(b"fine paragraph one\n\nbroken \xff\xfe bytes\n\nfine two\n")
    dev = torch.device("cpu")
    bundle = build_data(
        local_cfg(str(tmp_path / "d.jsonl"), num_streams=1), seq_len=8, seed=0, device=dev
    )
    (b,) = streams(bundle, 1, micro=8, workers=1)
    for _ in range(40):
        b.next_step()
    assert b.skipped["empty"] == 2 and b.skipped["not_text"] == 1
    pair = streams(bundle, 2, micro=4, workers=0)  # both ranks read the one stream
    for _ in range(40):
        step_all(pair)
    _, skipped = merge_positions([(b.state_dict()["streams"], b.skipped) for b in pair])
    assert skipped["empty"] == 2 and skipped["not_text"] == 1  # counted once over the ranks
    bundle = build_data(
        local_cfg(str(tmp_path / "u.txt"), num_streams=1, eval_fraction=0.01),
        seq_len=4,
        seed=0,
        device=dev,
    )
    (b,) = streams(bundle, 1, micro=2, workers=0)
    ids = [t for _ in range(6) for x, _ in b.next_step() for t in x.flatten().tolist()]
    seen = bytes(t for t in ids if t < 256)
    assert b.skipped["invalid_utf8"] >= 1 and b"broken" not in seen


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: str(p / "nothing*.txt"), "matches no file"),
        (lambda p: str(p / "missing.jsonl"), "no such file"),
        (lambda p: (p / "e.txt").write_text("") or str(p / "e.txt"), "is empty"),
        (
            lambda p: (p / "f.jsonl").write_text('{"body": "x", "id": 1}\n') and str(p / "f.jsonl"),
            "no field 'text' .*(its|their) fields: body, id",
        ),
        (lambda p: (p / "x.csv").write_text("a,b\n") and str(p / "x.csv"), "unknown extension"),
    ],
)
def test_bad_sources_fail_at_start_up_in_one_line(tmp_path, make, match):
    with pytest.raises(DataError, match=match) as e:
        build_data(local_cfg(make(tmp_path)), seq_len=8, seed=0, device=torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_a_glob_with_one_jsonl_file_without_the_text_field_names_that_file(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(
            "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(9))
        )
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(DataError) as e:
        build_data(
            local_cfg(str(tmp_path / "*.jsonl")), seq_len=8, seed=0, device=torch.device("cpu")
        )
    assert str(e.value) == (
        f"data file '{tmp_path / 'c.jsonl'}' has no field 'text' (data.text_field); its fields: "
        "body, id"
    )


def test_truncated_parquet_and_missing_tokenizer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "hello world"}] * 100), tmp_path / "d.parquet")
    raw = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "d.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="cannot be read"):
        build_data(
            local_cfg(str(tmp_path / "d.parquet")), seq_len=8, seed=0, device=torch.device("cpu")
        )
    (tmp_path / "ok.txt").write_text("some text\n\nmore text\n")
    with pytest.raises(DataError, match="tokenizer '.*nope' not found"):
        build_data(
            local_cfg(str(tmp_path / "ok.txt"), str(tmp_path / "nope")),
            seq_len=8,
            seed=0,
            device=torch.device("cpu"),
        )


def test_vocab_follows_the_tokenizer(corpus):
    files, tok = corpus
    bundle = build_data(local_cfg(files, str(tok)), seq_len=SEQ, seed=0, device=torch.device("cpu"))
    assert bundle.tokenizer.vocab_size == N_TOKENS + 1
    assert bundle.vocab_size == 1536  # 1501 padded to a multiple of 64


def stdlib_text_corpus(root: Path, n_bytes: int) -> Path:
    from dtrain.data.embedded import documents_of, embedded_shards

    root.mkdir(parents=True, exist_ok=True)
    docs = [d.replace("\n\n", "\n") for d in documents_of(embedded_shards(n_bytes))]
    (root / "code.txt").write_text("\n\n".join(docs))
    return root / "code.txt"


def test_bpe_is_trained_once_and_cached(tmp_path):
    path = stdlib_text_corpus(tmp_path / "c", 100_000)
    cfg = local_cfg(str(path), "bpe", vocab_size=512, cache_dir=str(tmp_path / "cache"))
    a = build_data(cfg, seq_len=8, seed=0, device=torch.device("cpu"), run_dir=str(tmp_path / "r"))
    cached = list((tmp_path / "cache/tokenizers").glob("bpe-512-*.json"))
    assert len(cached) == 1 and (tmp_path / "r/tokenizer.json").is_file()
    assert a.tokenizer.vocab_size == 512 and a.vocab_size == 512
    mtime = cached[0].stat().st_mtime_ns
    b = build_data(cfg, seq_len=8, seed=0, device=torch.device("cpu"))
    assert cached[0].stat().st_mtime_ns == mtime  # reused, not retrained
    text = "def main(argv):\n    return 0\n"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert a.tokenizer.decode(a.tokenizer.encode(text)) == text
    assert len(a.tokenizer.encode(text)) < len(text.encode()) / 2  # merges learned


@pytest.mark.slow
def test_cli_trains_on_local_files_with_bpe_and_eval_loss_falls(tmp_path):
    path = stdlib_text_corpus(tmp_path / "c", 400_000)
    res = launch(
        "data=local",
        f"data.files={path}",
        "data.tokenizer=bpe",
        "data.vocab_size=1024",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=tiny",
        "trainer.seq_len=64",
        "trainer.micro_batch_size=8",
        "trainer.max_steps=60",
        "trainer.eval_every=30",
        "trainer.eval_steps=4",
        "trainer.log_every=10",
        "trainer.progress_bar=false",
        "trainer.device=cpu",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals
    assert all(0.0 <= r["data_wait_pct"] <= 100.0 for r in recs if "loss" in r)


def test_cli_bad_data_is_one_line_and_exit_2(tmp_path):
    res = launch(
        "data=local",
        f"data.files={tmp_path}/none/*.jsonl",
        "trainer.device=cpu",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: data.files glob") and "Traceback" not in res.stderr


def test_throughput_benchmark_smoke(tmp_path):
    from bench.data_throughput import main

    out = main(["--smoke", "--out", str(tmp_path)])
    assert [r["tokenizer"] for r in out["results"]] == ["byte", "bpe"]
    assert all(r["w1_tokens_per_s"] > 0 for r in out["results"])
    assert (tmp_path / "results.md").read_text().count("| byte |") == 1


def test_hub_code_path_on_a_local_folder_with_splits(tmp_path):
    # load_dataset(path, streaming=True) reads a local folder the way it streams a hub repo;
    # the eval split is another split, and nothing is held out of training.
    for split, n in (("train", 200), ("validation", 20)):
        rows = [json.dumps({"story": f"{split} story {i} " * 8}) for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    cfg = DataConfig(
        source="hub", path=str(tmp_path), split="train", eval_split="validation", text_field="story"
    )
    bundle = build_data(cfg, seq_len=16, seed=0, device=torch.device("cpu"))
    assert bundle.train.spec.holdout == 0.0
    (b,) = streams(bundle, 1, workers=1)
    x = torch.cat([x for x, _ in b.next_step()])
    assert "train story" in bundle.tokenizer.decode(x.flatten().tolist())
    ev = bundle.tokenizer.decode(bundle.eval.get(2).flatten().tolist())
    assert "validation story" in ev and "train story" not in ev
    with pytest.raises(DataError, match="no field 'text' .*their fields: story"):
        build_data(
            DataConfig(source="hub", path=str(tmp_path)),
            seq_len=16,
            seed=0,
            device=torch.device("cpu"),
        )


@pytest.mark.slow
def test_ddp_2_ranks_x_2_workers_resume_is_bit_exact(tmp_path):
    # The real loop under torchrun: stream positions gathered from both ranks into the manifest.
    from tests.conftest import FAST, train_losses

    args = [
        *FAST,
        "strategy=ddp",
        "data.num_workers=2",
        "trainer.max_steps=8",
        "trainer.log_every=1",
        "trainer.eval_every=0",
    ]
    for extra, run in (([], "straight"), (["trainer.stop_at_step=3"], "resumed"), ([], "resumed")):
        res = launch(*args, *extra, f"hydra.run.dir={tmp_path / run}", nproc=2)
        assert res.returncode == 0, res.stderr[-3000:]
    manifest = json.loads((tmp_path / "resumed/checkpoints/step_0000003/manifest.json").read_text())
    assert sorted(manifest["data"]["streams"], key=int) == [str(s) for s in range(8)]
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    for step in range(4, 9):
        assert a[step] == b[step], (step, a[step], b[step])


def test_a_truncated_jsonl_stops_with_one_line(tmp_path):
    # Caught by the start-up probe when the break is in the first chunk pyarrow reads, else by
    # the worker mid-run: either way one line, never a traceback from a worker.
    rows = [json.dumps({"text": f"record {i} " * 10}) for i in range(300)]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + '\n{"text": "cut in the mid')
    with pytest.raises(DataError, match="(cannot|could not) be read.*JSON parse error") as e:
        bundle = build_data(
            local_cfg(str(tmp_path / "d.jsonl"), num_streams=1, shuffle_window=16),
            seq_len=32,
            seed=0,
            device=torch.device("cpu"),
        )
        (b,) = streams(bundle, 1, micro=8, workers=1)
        for _ in range(200):
            b.next_step()
    assert "\n" not in str(e.value)


def test_a_file_gone_mid_run_stops_with_one_line_from_the_worker(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph here\n\nsecond one here\n\n" * 50)
    bundle = build_data(
        local_cfg(str(tmp_path / "a.txt"), num_streams=1),
        seq_len=8,
        seed=0,
        device=torch.device("cpu"),
    )
    (tmp_path / "a.txt").unlink()  # after the start-up checks, before the worker reads it
    (b,) = streams(bundle, 1, workers=1)
    with pytest.raises(DataError, match=r"data could not be read \(FileNotFoundError") as e:
        b.next_step()
    assert "\n" not in str(e.value)


def test_a_process_that_stopped_on_bad_data_exits_though_its_workers_ignore_sigterm(tmp_path):
    """The error's traceback keeps the reader (and its DataLoader iterator) alive to the end;
    multiprocessing's exit hook terminates workers with SIGTERM, which they ignore, then joins
    them: without the reader closing its workers this process never exited (seen in CI)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "a.txt").write_text("first paragraph here\n\nsecond one here\n\n" * 50)
    script = f"""
import sys, torch
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
from test_data import build_data, local_cfg, streams
from pathlib import Path
bundle = build_data(local_cfg({str(tmp_path / "a.txt")!r}, num_streams=1), seq_len=8, seed=0,
                    device=torch.device("cpu"))
Path({str(tmp_path / "a.txt")!r}).unlink()
(b,) = streams(bundle, 1, workers=1)
try:
    b.next_step()
except Exception as e:
    kept = e  # as a test runner or a crash reporter keeps it
    print("stopped:", type(e).__name__)
"""
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "stopped: DataError" in res.stdout


def test_the_prefetcher_reads_ahead_and_raises_errors_where_their_result_was_due():
    import time

    from dtrain.data.loader import Prefetcher

    calls = []

    def produce():
        calls.append(1)
        if len(calls) == 4:
            raise DataError("record 4 is broken")
        return len(calls)

    p = Prefetcher(produce, depth=2)
    deadline = time.time() + 10
    while len(calls) < 3 and time.time() < deadline:  # runs ahead of get() by `depth` (+1)
        time.sleep(0.01)
    assert len(calls) == 3
    assert [p.get(), p.get(), p.get()] == [1, 2, 3]
    with pytest.raises(DataError, match="record 4 is broken"):
        p.get()
    p.close()
    assert not p._thread.is_alive()


def test_close_stops_reading_ahead(corpus):
    files, tok = corpus
    bundle = build_data(local_cfg(files, str(tok)), seq_len=SEQ, seed=0, device=torch.device("cpu"))
    (b,) = streams(bundle, 1, workers=1)
    b.next_step()
    thread = b._prefetch._thread
    assert thread.is_alive()
    b.close()
    assert not thread.is_alive() and b._prefetch is None
    (straight,) = streams(bundle, 1, workers=1)
    expect = [step_all([straight]) for _ in range(3)]
    # Reading starts again where the loop stands, not where the reader had got to.
    assert torch.equal(step_all([b])[0], expect[1][0])
    assert torch.equal(step_all([b])[0], expect[2][0])


def test_bpe_with_no_vocab_set_trains_a_few_steps(tmp_path):
    # What conf/data/local.yaml suggests: data.tokenizer=bpe alone, no data.vocab_size.
    from tests.conftest import train

    out = train(
        tmp_path / "run",
        "data.tokenizer=bpe",
        "data.bpe_train_bytes=100000",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "checkpoint.save_final=false",
    )
    assert out["step"] == 3
    assert len(list((tmp_path / "cache/tokenizers").glob("bpe-8192-*.json"))) == 1
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run/metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

"""Python's garbage collector during training (dtrain/run/gc_schedule.py): automatic collection
off while the steps run, the young generations collected every trainer.gc_every steps, every
collection timed for perf/gc_pct; gc_every=0 leaves Python's automatic collection on, timed."""

import gc
import os

import pytest

from dtrain.run.gc_schedule import GcSchedule
from tests.conftest import read_jsonl, train


@pytest.fixture
def collections():
    """The generation of every collection that starts while the test runs."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_automatic_collection_is_off_and_the_young_are_collected_every_n_steps(collections):
    assert gc.isenabled()
    with GcSchedule(every=3, compiling={5, 8}) as s:
        assert not gc.isenabled()
        collections.clear()  # the one on entry
        s.take()
        for step in range(5, 12):  # a resumed run: its first step is 5
            before = len(collections)
            junk = [[] for _ in range(5000)]  # would trigger automatic gen-0 collections
            del junk
            s.step_done(step)
            # and after the first step, and after each compiling one
            scheduled = step % 3 == 0 or step in (5, 8)
            assert collections[before:] == ([1] if scheduled else []), step
            paused = s.take()
            assert (paused > 0) == scheduled, step  # each scheduled collection timed
    assert gc.isenabled()  # put back as it was


def test_every_zero_keeps_the_automatic_collector_and_times_it(collections):
    with GcSchedule(every=0) as s:
        assert gc.isenabled()
        for step in range(1, 5):
            s.step_done(step)
        assert collections == []  # nothing scheduled
        cycles = []
        for _ in range(20000):  # garbage with cycles: the automatic collector runs
            a = []
            a.append(a)
            cycles.append(len(a))
        assert collections and s.take() > 0
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled_after_the_loop():
    gc.disable()
    try:
        with GcSchedule(every=2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("every", [2, 0])
def test_the_loop_schedules_the_collector_and_logs_its_share(tmp_path, monkeypatch, every):
    from dtrain import train as loop

    enabled, one_step = [], loop.one_step

    def watched(*args):
        enabled.append(gc.isenabled())
        return one_step(*args)

    monkeypatch.setattr(loop, "one_step", watched)
    train(tmp_path, "trainer.max_steps=4", "trainer.log_every=2", f"trainer.gc_every={every}")
    assert enabled == [every == 0] * 4
    assert gc.isenabled()
    recs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(recs) == 2 and all(0.0 <= r["gc_pct"] <= 100.0 for r in recs)
    if every:  # step 4 collects before its report, in the second logged interval
        assert recs[1]["gc_pct"] > 0


def test_data_loader_workers_turn_the_collector_back_on(tmp_path, monkeypatch):
    """A DataLoader worker forks while the loop has the collector off and would keep it off
    for its whole life (found in review: nothing ever collected there)."""
    from dtrain.data import loader

    seen, init = tmp_path / "worker_gc.txt", loader._worker_init

    def probe(worker_id):  # runs in the worker
        forked_with = gc.isenabled()
        init(worker_id)
        seen.write_text(f"{forked_with} {gc.isenabled()}")

    monkeypatch.setattr(loader, "_worker_init", probe)
    train(tmp_path / "run", "trainer.max_steps=2", "trainer.log_every=1", "data.num_workers=1")
    assert seen.read_text() == "False True"


class _Finalized:
    """Writes the pid of the process that finalizes it."""

    def __init__(self, path):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_data_loader_workers_leave_the_parents_garbage_alone(tmp_path, monkeypatch):
    """A worker must not collect garbage it inherited from the process that forked it: its
    destructors would run there (a gloo process group's, left by an earlier run in the same
    process, deadlocked a worker so in CI, and the run waited on its data for good)."""
    from dtrain.data import loader

    finalized, init, streams = tmp_path / "finalized.txt", loader._worker_init, loader._RankStreams
    collected = tmp_path / "collected.txt"

    def probe(worker_id):  # runs in the worker: a full collection, then what it found
        init(worker_id)
        collected.write_text(str(gc.collect()))

    def old_garbage_then_streams(*args):  # in the loop, just before the workers fork
        obj = _Finalized(finalized)
        gc.collect(1)  # obj is old now: the loop's young collections leave it
        del obj  # garbage, in a cycle: only a full collection finds it
        return streams(*args)

    monkeypatch.setattr(loader, "_worker_init", probe)
    monkeypatch.setattr(loader, "_RankStreams", old_garbage_then_streams)
    try:
        train(tmp_path / "run", "trainer.max_steps=2", "trainer.log_every=1", "data.num_workers=1")
    finally:
        gc.collect()  # here, in the test's process
    assert collected.exists()  # the probe ran in a worker
    assert finalized.read_text().split() == [str(os.getpid())]

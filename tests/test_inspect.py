"""Samples and attention maps in the event files; profiler traces and the operator table."""

import io

import numpy as np
import pytest
import torch

from dtrain.reporting.inspector import VIRIDIS, colormap, head_grid
from tests.conftest import train


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtrain.reporting.tensorboard import event_dirs

    (events,) = event_dirs(run_dir)  # tensorboard/<strategy>-<precision>-w<N>-<model>/
    acc = EventAccumulator(str(events), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(acc, tag):
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def test_colormap_and_head_grid():
    rgb = colormap(np.array([[0.0, 1.0, 0.5]]))
    assert rgb.shape == (3, 1, 3) and rgb.dtype == np.uint8
    np.testing.assert_array_equal(rgb[:, 0, 0], np.round(VIRIDIS[0] * 255))
    np.testing.assert_array_equal(rgb[:, 0, 1], np.round(VIRIDIS[-1] * 255))
    np.testing.assert_array_equal(rgb[:, 0, 2], np.round(VIRIDIS[5] * 255))
    img = head_grid(torch.rand(6, 5, 5), scale=3, gap=2)  # 6 heads -> 3 columns x 2 rows
    assert img.shape == (3, 2 * 15 + 2, 3 * 15 + 2 * 2)
    assert (img[:, 15:17, :] == 255).all()  # the white line between the two rows


def test_samples_and_attention_maps_are_in_the_event_files(tmp_path):
    from PIL import Image

    train(
        tmp_path,
        "trainer.max_steps=4",
        "trainer.eval_every=2",
        "inspect.attention_max_tokens=20",
        "optim.warmup_steps=1",  # a real learning rate from step 1, so the maps visibly move
        "optim.lr=3e-3",
    )
    acc = _events(tmp_path)
    tags = acc.Tags()
    images = sorted(t for t in tags["images"] if t.startswith("attention/"))
    assert images == [f"attention/layer_{i:02d}" for i in range(4)]
    for tag in images:
        events = acc.Images(tag)
        assert [e.step for e in events] == [0, 2, 4]
        img = Image.open(io.BytesIO(events[-1].encoded_image_string))
        # tiny: 4 heads on a 2x2 grid of 20x20 maps at 4 pixels each, 2-pixel gaps
        assert img.size == (2 * 80 + 2, 2 * 80 + 2) == (events[-1].width, events[-1].height)
    # The maps change as the model trains.
    first, last = (
        np.asarray(Image.open(io.BytesIO(e.encoded_image_string)))
        for e in (acc.Images("attention/layer_00")[0], acc.Images("attention/layer_00")[-1])
    )
    assert not np.array_equal(first, last)

    prompts = ["def ", "import ", "class "]
    for j, prompt in enumerate(prompts):
        entries = _text(acc, f"samples/{j}/text_summary")
        assert [s for s, _ in entries] == [0, 2, 4]
        for _, text in entries:
            assert f"prompt `{prompt!r}`" in text and f"```\n{prompt}" in text
    (_, axes), *_ = _text(acc, "attention/prompt/text_summary")
    assert "rows are queries" in axes and "`'d'` `'e'` `'f'`" in axes


def test_inspect_can_be_switched_off_and_layers_chosen(tmp_path):
    train(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "inspect.samples=false",
        "inspect.attention_layers=[1,3]",
    )
    tags = _events(tmp_path).Tags()
    attention = sorted(t for t in tags["images"] if t.startswith("attention/"))
    assert attention == ["attention/layer_01", "attention/layer_03"]
    assert not any(t.startswith("samples/") for t in tags["tensors"])


def test_profiler_writes_a_trace_and_prints_the_table(tmp_path, capsys):
    train(
        tmp_path,
        "trainer.max_steps=5",
        "trainer.eval_every=0",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.warmup=1",
        "profile.active=2",
        "profile.row_limit=8",
    )
    traces = list((tmp_path / "tensorboard" / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    out = capsys.readouterr().out
    assert "top operators by self CPU time" in out and "aten::mm" in out
    table = (tmp_path / "profile_table.txt").read_text()
    # The step markers are in the trace; the 8 rows by self time may leave them out under load
    assert "Self CPU" in table and "aten::mm" in table
    assert "ProfilerStep#" in traces[0].read_text()


def test_profiler_that_records_nothing_says_so(tmp_path, capsys):
    train(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "profile.enabled=true",
        "profile.wait=5",
    )
    assert "profiling recorded nothing" in capsys.readouterr().err
    assert not (tmp_path / "profile_table.txt").exists()


def test_bad_inspect_settings_are_refused(tmp_path):
    from dtrain.errors import ConfigError

    for args, msg in [
        (["inspect.top_p=0"], "inspect.top_p must be in"),
        (["inspect.attention_layers=[9]"], "the model has layers 0..3"),
        (["profile.active=0"], "profile.active must be > 0"),
        (["model.init_from=/x"], "use hf:DIR"),
        ([f"model.init_from=hf:{tmp_path}"], "has no config.json"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            train(tmp_path / "run", *args)

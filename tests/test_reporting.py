"""Runs compared in TensorBoard, read back with TensorBoard's own loaders (the event
accumulator, the Custom Scalars layout, the HParams plugin's handlers), and the optional W&B and
MLflow loggers, each read back offline with the real library."""

from __future__ import annotations

import json
import re
import struct

import pytest

from dtrain.errors import ConfigError
from tests.conftest import compose, read_jsonl, train

# TensorBoard's vendored HTML sanitizer warns when the HParams plugin is imported.
pytestmark = pytest.mark.filterwarnings("ignore:html5lib's sanitizer:DeprecationWarning")
GiB = 1024**3
# Short runs: three logged steps (the prediction error from step 2 on), nothing slow at evals.
QUICK = [
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "checkpoint=none",
    "inspect.samples=false",
    "inspect.attention_maps=false",
]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A folder of two runs, as `tensorboard --logdir` would see them."""
    root = tmp_path_factory.mktemp("runs")
    train(root / "a", *QUICK)
    train(root / "b", *QUICK, "strategy=ddp")
    return root


def _acc(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dtrain.reporting.tensorboard import event_dirs

    (d,) = event_dirs(run_dir)
    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return d, acc


def test_runs_are_named_by_their_configuration(two_runs):
    assert _acc(two_runs / "a")[0].name == "single-fp32-w1-tiny"
    assert _acc(two_runs / "b")[0].name == "ddp-fp32-w1-tiny"


def test_memory_is_in_gib_and_no_chart_is_a_single_dot(two_runs):
    _, acc = _acc(two_runs / "a")
    tags = acc.Tags()["scalars"]
    assert not [t for t in tags if t.endswith("_bytes")]
    for tag in tags:  # every series has a point per logged step (the error: from step 2)
        assert len(acc.Scalars(tag)) >= 2, tag
    last = [r for r in read_jsonl(two_runs / "a/metrics.jsonl") if "loss" in r][-1]
    (mem,) = last["memory_per_rank"]  # metrics.jsonl keeps the bytes
    for key in ("params", "grads", "optim", "peak_rss"):
        got = acc.Scalars(f"memory/rank0/{key}_gib")[-1].value
        assert got == pytest.approx(mem[f"{key}_bytes"] / GiB, rel=1e-6), key
    measured = acc.Scalars("memory/rank0/model_state_gib")
    predicted = acc.Scalars("memory/predicted/model_state_gib")
    assert [e.step for e in measured] == [e.step for e in predicted] == [1, 2, 3]
    assert predicted[-1].value == pytest.approx(measured[-1].value)  # exact on CPU
    # The prediction is a table, not 26 single dots.
    assert not [t for t in tags if t.startswith("memory/predicted/") and "at_peak" in t]
    table = acc.Tensors("memory/predicted/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| parameters |" in table


def _layout(acc) -> dict[str, list[str]]:
    from tensorboard.plugins.custom_scalar import layout_pb2

    raw = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    out = {}
    for cat in layout_pb2.Layout.FromString(raw).category:
        for chart in cat.chart:
            out[chart.title] = list(chart.multiline.tag)
    return out


def test_cpu_runs_have_no_cuda_charts_and_every_chart_has_lines(two_runs):
    _, acc = _acc(two_runs / "a")
    tags = acc.Tags()["scalars"]
    assert not [t for t in tags if "reserved" in t or "allocated" in t]
    charts = _layout(acc)
    assert "peak RSS per process (GiB)" in charts and "MFU" not in charts  # no peak on CPU
    for title, regexes in charts.items():
        assert not re.search("CUDA|reserved|allocated", title), title
        lines = [rx for rx in regexes if any(re.search(rx, t) for t in tags)]
        assert lines, title  # no empty chart
        if "GiB" in title:  # measured and, where there is one, the prediction beside it
            assert lines == regexes, title
    assert charts["model state per rank (GiB)"] == [
        r"memory/rank\d+/model_state_gib",
        "memory/predicted/model_state_gib",
    ]


def test_cuda_layout_has_the_gpu_charts():
    from dtrain.reporting.tensorboard import layout

    cuda = layout(cuda=True, mfu=True)["memory"]
    assert cuda["peak reserved per GPU (GiB)"][1] == [
        r"memory/rank\d+/peak_reserved_gib",
        "memory/predicted/peak_reserved_gib",
    ]
    assert "peak RSS per process (GiB)" not in cuda
    assert "MFU" in layout(cuda=True, mfu=True)["training"]


def test_memory_scalars_worst_rank_and_prediction_in_gib():
    from types import SimpleNamespace

    from dtrain.reporting.metrics import memory_scalars

    ranks = [
        {"params_bytes": GiB, "grads_bytes": GiB, "optim_bytes": 2 * GiB, "master_bytes": 0,
         "peak_reserved_bytes": 6 * GiB, "host": "h", "local_rank": 0},
        {"params_bytes": GiB, "grads_bytes": GiB, "optim_bytes": 2 * GiB, "master_bytes": 0,
         "peak_reserved_bytes": 7 * GiB, "host": "h", "local_rank": 1},
    ]  # fmt: skip
    plan = SimpleNamespace(
        params_bytes=GiB, grads_bytes=GiB, optim_bytes=2 * GiB, model_state_bytes=4 * GiB,
        peak_bytes=int(6.5 * GiB),
    )  # fmt: skip
    s = memory_scalars(ranks, plan)
    assert s["memory/rank1/peak_reserved_gib"] == 7.0
    assert s["memory/worst_rank/peak_gib"] == 7.0
    assert s["memory/rank0/model_state_gib"] == 4.0
    assert s["memory/predicted/peak_reserved_gib"] == 6.5
    assert not any(k.endswith(("/host", "/local_rank")) for k in s)
    cpu = memory_scalars([{"params_bytes": GiB, "peak_rss_bytes": 3 * GiB}], plan)
    assert "memory/predicted/peak_reserved_gib" not in cpu  # no GPU peak beside a CPU run
    assert cpu["memory/worst_rank/peak_gib"] == 3.0  # on CPU: the peak RSS


def _hparams_plugin(logdir):
    """The HParams dashboard's two requests, answered by TensorBoard's own plugin code."""
    from google.protobuf import json_format
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import (
        api_pb2,
        get_experiment,
        hparams_plugin,
        list_session_groups,
    )

    mux = pem.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    tb = base_plugin.TBContext(
        logdir=str(logdir),
        multiplexer=mux,
        data_provider=data_provider.MultiplexerDataProvider(mux, str(logdir)),
    )
    backend = hparams_plugin.HParamsPlugin(tb)._context
    rc = context.RequestContext()
    exp = get_experiment.Handler(rc, backend, "", api_pb2.GetExperimentRequest()).run()
    req = json_format.Parse(
        json.dumps({"startIndex": 0, "sliceSize": 100, "allowedStatuses": ["STATUS_SUCCESS"]}),
        api_pb2.ListSessionGroupsRequest(),
    )
    groups = list_session_groups.Handler(rc, backend, "", req).run().session_groups
    return exp, groups


def test_hparams_dashboard_lists_every_run_with_its_figures(two_runs):
    exp, groups = _hparams_plugin(two_runs)
    names = {h.name for h in exp.hparam_infos}
    for key in ("strategy", "precision", "world_size", "model", "micro_batch_size", "seq_len",
                "global_batch_size"):  # fmt: skip
        assert key in names, key
    strategy = next(h for h in exp.hparam_infos if h.name == "strategy")
    assert "fsdp" in [v.string_value for v in strategy.domain_discrete.values]  # check boxes
    rows = {}
    for g in groups:
        (session,) = g.sessions
        assert session.status == 1  # STATUS_SUCCESS
        hp = {k: json_value(v) for k, v in g.hparams.items()}
        rows[hp["strategy"]] = (hp, {m.name.tag: m.value for m in g.metric_values})
    assert set(rows) == {"single", "ddp"}
    for strategy, (hp, metrics) in rows.items():
        assert hp["world_size"] == 1 and hp["model"] == "tiny" and hp["precision"] == "fp32"
        assert hp["micro_batch_size"] == 4 and hp["seq_len"] == 64
        run = "a" if strategy == "single" else "b"
        last = [r for r in read_jsonl(two_runs / run / "metrics.jsonl") if "loss" in r][-1]
        assert metrics["train/loss"] == pytest.approx(last["loss"], rel=1e-6)
        assert metrics["perf/tokens_per_s_per_gpu"] > 0
        (mem,) = last["memory_per_rank"]
        assert metrics["memory/worst_rank/peak_gib"] == pytest.approx(
            mem["peak_rss_bytes"] / GiB, rel=1e-6
        )
        assert metrics["memory/worst_rank/model_state_gib"] > 0
        assert "perf/mfu" not in metrics  # no real peak on a CPU


def json_value(v):
    kind = v.WhichOneof("kind")
    return {"number_value": v.number_value, "string_value": v.string_value,
            "bool_value": v.bool_value}[kind]  # fmt: skip


def test_end_of_run_summary_and_chart_in_tensorboard(two_runs):
    pytest.importorskip("matplotlib")
    _, acc = _acc(two_runs / "a")
    text = acc.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| final_loss |" in text and "| tokens_per_s_per_gpu |" in text
    (img,) = acc.Images("memory/predicted_vs_measured")
    assert img.step == 3 and img.encoded_image_string[:4] == b"\x89PNG"


def test_a_resumed_run_continues_its_tensorboard_run(tmp_path):
    from dtrain.reporting.tensorboard import event_dirs

    args = [*QUICK, "checkpoint=default"]
    train(tmp_path, *args, "trainer.stop_at_step=2")
    train(tmp_path, *args)
    (d,) = event_dirs(tmp_path)
    _, acc = _acc(tmp_path)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    _, (group,) = _hparams_plugin(tmp_path)
    assert {m.name.tag: m.value for m in group.metric_values}["train/loss"] == pytest.approx(
        acc.Scalars("train/loss")[-1].value
    )


# --- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        ("metrics.wandb.mode=cloud", "metrics.wandb.mode='cloud' is not valid; choose offline"),
        ("metrics.wandb.projekt=x", "unknown config key 'metrics.wandb.projekt'"),
        ("metrics.mlflow.enabled=maybe", "metrics.mlflow.enabled must be true/false"),
    ],
)
def test_bad_logger_config_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        compose(override)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_logger_config_exits_2_with_one_line():
    from tests.conftest import launch

    res = launch("metrics.wandb.mode=cloud", "hydra.run.dir=/nonexistent/never/made", timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: metrics.wandb.mode='cloud' is not valid; choose offline, online, disabled"
    ]


def test_a_logger_without_its_library_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[mlflow\]'"):
        compose("metrics.mlflow.enabled=true")


# --- Weights & Biases, offline ------------------------------------------------------------


def read_wandb_records(run_dir):
    """The records of a W&B offline run file (LevelDB-log framing: 32 KiB blocks, 7-byte
    record headers, FULL/FIRST/MIDDLE/LAST chunks; each record a wandb Record protobuf)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0:
            break
        chunk += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # FULL or LAST
            out.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return out


def _items(items) -> dict:
    """W&B's key/value items: the key in `key`, or (newer wandb) in `nested_key`."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_wandb_offline_logs_scalars_config_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tmp_path, *QUICK, "metrics.wandb.enabled=true", "metrics.wandb.project=t")
    # run.finish() can return before wandb-core has written its buffered records to the .wandb
    # file (CI once read only the header); teardown waits for the service to close its writers.
    import wandb

    wandb.teardown()
    records = read_wandb_records(tmp_path)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs[0].display_name == "single-fp32-w1-tiny" and runs[0].project == "t"
    config = {}
    for r in records:
        if r.WhichOneof("record_type") in ("run", "config"):
            src = r.run.config if r.WhichOneof("record_type") == "run" else r.config
            config.update(_items(src.update))
    assert config["strategy"] == "single" and config["world_size"] == 1
    assert config["config"]["trainer"]["max_steps"] == 3
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    losses = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    want = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r}
    assert losses == pytest.approx(want)
    assert any("memory/rank0/model_state_gib" in h for h in history)
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["summary/final_loss"] == pytest.approx(want[3])
    assert summary["summary/steps"] == 3


# --- MLflow, file store -------------------------------------------------------------------


def test_mlflow_file_store_logs_params_metrics_and_summary(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "mlruns").as_uri()
    args = [
        *QUICK,
        "checkpoint=default",
        "metrics.mlflow.enabled=true",
        f"metrics.mlflow.tracking_uri={store}",
        "metrics.mlflow.experiment=t",
    ]
    train(tmp_path / "run", *args, "trainer.stop_at_step=2")
    train(tmp_path / "run", *args)  # resumed: the same MLflow run goes on
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("t")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "single-fp32-w1-tiny" and run.info.status == "FINISHED"
    assert run.data.params["strategy"] == "single" and run.data.params["world_size"] == "1"
    want = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "run/metrics.jsonl") if "loss" in r}
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert got == pytest.approx(want)
    assert run.data.metrics["summary/final_loss"] == pytest.approx(want[3])
    assert "memory/worst_rank/model_state_gib" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "summary.json"} <= artifacts


def test_hparams_name_the_precisions_own_choices():
    from dtrain.reporting.summary import precision_choices

    int8 = compose("precision=int8", "precision.int8_gemm=pointer").precision
    got = precision_choices(int8)
    assert got["precision.int8_gemm"] == "pointer"
    assert got["precision.optimizer_8bit"] is False
    assert not any(k.startswith("precision.fp8_") for k in got)
    assert precision_choices(compose("precision=bf16").precision) == {
        "precision.optimizer_8bit": False
    }

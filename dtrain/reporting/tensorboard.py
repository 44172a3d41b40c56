"""TensorBoard for comparing runs: run names, the Custom Scalars layout, the HParams session.

A run's events go to <run_dir>/tensorboard/<strategy>-<precision>-w<world>-<model>/, so that
TensorBoard's run selector names each run by its configuration whatever its run dir is called
(`tensorboard --logdir outputs` lists `ddp-bf16-w2-1b/tensorboard/ddp-bf16-w2-1b`, a sweep's
points likewise). Profiler traces stay in <run_dir>/tensorboard/profile/.

HParams: each run writes the plugin's experiment and session-start summaries into that same
folder at the start. The plugin reads a session's metrics as the *last* value of scalar series in
the session's folder, so the metrics below are ordinary per-step series (loss, tokens/s per GPU,
MFU, the worst rank's memory), whose last value is the run's figure: nothing is logged once, no
chart is a single dot, and a run that stops early still has its row.
"""

from __future__ import annotations

import re
from pathlib import Path

EVENTS_DIR = "tensorboard"
PROFILE_DIR = "profile"  # dtrain.reporting.profiling's traces, a run of their own

# The HParams table's hyperparameter columns (the loggers get every key of run_hparams).
HPARAMS = (
    "strategy",
    "precision",
    "world_size",
    "model",
    "micro_batch_size",
    "global_batch_size",
    "seq_len",
    "gpu",
    "compile",
)
# The columns TensorBoard shows at first: it shows 5, those marked `differs` before the others.
HPARAMS_FIRST = ("strategy", "precision", "world_size", "model", "micro_batch_size")
# Series whose last value is the run's figure in the HParams table (see the module docstring),
# with their column titles.
# TensorBoard shows the first 5 at first.
HPARAMS_METRICS = {
    "memory/worst_rank/peak_gib": "peak GiB per GPU (CUDA: reserved; CPU: RSS)",
    "perf/tokens_per_s_per_gpu": "tokens/s per GPU",
    "perf/mfu": "MFU",
    "train/loss": "final loss",
    "memory/worst_rank/model_state_gib": "model state GiB per GPU",
    "eval/loss": "final eval loss",
    "memory/prediction_error_pct": "prediction error % (peak reserved)",
    "memory/prediction_error_pct_model_state": "prediction error % (model state)",
}


def run_name(strategy: str, precision: str, world_size: int, model: str) -> str:
    """strategy-precision-wN-model, as launch/train.py names run dirs; safe as a folder name."""
    name = f"{strategy}-{precision}-w{world_size}-{model}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def event_dirs(run_dir: str | Path) -> list[Path]:
    """The folders of a run dir that hold scalar event files: tensorboard/<run name>/ (and
    tensorboard/ itself for runs written before runs were named), never the profiler's."""
    root = Path(run_dir) / EVENTS_DIR
    if not root.is_dir():
        return []
    found = {p.parent for p in root.rglob("events.out.tfevents.*")}
    return sorted(d for d in found if PROFILE_DIR not in d.relative_to(root).parts)


def layout(
    cuda: bool, mfu: bool, downstream: bool = False, evals: bool = False, mixture: bool = False
) -> dict:
    """Custom Scalars: one chart per quantity, every rank's line beside the prediction (and,
    with --logdir above several runs, every run's). CUDA-only charts only on CUDA, CPU-only
    ones only on CPU, MFU only where there is a real peak, eval times, downstream scores and
    per-source counts only where they are taken. Memory is in GiB."""
    rank = r"memory/rank\d+/"

    def beside(q: str) -> list:
        return ["Multiline", [rf"{rank}{q}_gib", rf"memory/predicted/{q}_gib"]]

    memory = {}
    if cuda:
        memory["peak reserved per GPU (GiB)"] = beside("peak_reserved")
        memory["peak allocated per GPU (GiB)"] = ["Multiline", [rf"{rank}peak_allocated_gib"]]
        memory["prediction error % (peak reserved)"] = [
            "Multiline",
            [r"memory/prediction_error_pct$"],
        ]
    else:
        memory["peak RSS per process (GiB)"] = ["Multiline", [rf"{rank}peak_rss_gib"]]
    memory["model state per rank (GiB)"] = beside("model_state")
    memory["parameters per rank (GiB)"] = beside("params")
    memory["gradients per rank (GiB)"] = beside("grads")
    memory["optimizer states per rank (GiB)"] = beside("optim")
    if not cuda:
        memory["prediction error % (model state, CPU)"] = [
            "Multiline",
            [r"memory/prediction_error_pct_model_state"],
        ]
    throughput = {
        # eval/<source>/loss: each source of a data mixture, beside the training loss
        "loss": ["Multiline", [r"train/loss", r"eval/loss", r"eval/[^/]+/loss$"]],
        "tokens/s per GPU": [
            "Multiline",
            [r"perf/tokens_per_s_per_gpu", r"perf/predicted_tokens_per_s_per_gpu"],
        ],
    }
    if downstream:  # every task's acc and acc_norm in one chart (dtrain/evaluation/)
        throughput["downstream accuracy"] = ["Multiline", [r"eval/downstream/.*/acc(_norm)?$"]]
    if mfu:
        throughput["MFU"] = ["Multiline", [r"perf/mfu"]]
    throughput["data wait %"] = ["Multiline", [r"perf/data_wait_pct"]]
    throughput["Python GC %"] = ["Multiline", [r"perf/gc_pct"]]
    data = {}
    if evals:
        data["eval seconds"] = ["Multiline", [r"eval/seconds"]]
    if mixture:
        data["tokens per data source"] = ["Multiline", [r"data/[^/]+/tokens"]]
        data["share of the blocks per data source"] = ["Multiline", [r"data/[^/]+/share"]]
    charts = {"memory": memory, "training": throughput}
    return {**charts, "data and eval": data} if data else charts


BOOL = ("false", "true")


def _domains(hparams: dict) -> dict:
    """Discrete choices for the HParams filter's check boxes, where the registry knows them."""
    from dtrain.precision import PRECISIONS
    from dtrain.strategies import STRATEGIES

    out = {}
    for key, choices in (("strategy", STRATEGIES), ("precision", PRECISIONS), ("compile", BOOL)):
        if hparams.get(key) in choices:
            out[key] = sorted(choices)
    return out


def hparams_summaries(hparams: dict) -> tuple:
    """(experiment, session start) summaries for the HParams plugin: the HPARAMS columns of
    `hparams` (None dropped) and HPARAMS_METRICS as the metric columns."""
    from torch.utils.tensorboard.summary import hparams as hparams_pb

    values = {}
    for k in HPARAMS:
        v = hparams.get(k)
        if isinstance(v, bool):  # torch would log a bool as the number 0 or 1
            v = str(v).lower()
        if v is not None:
            values[k] = v
    exp, ssi, _ = hparams_pb(values, dict.fromkeys(HPARAMS_METRICS, 0.0), _domains(values))
    _name_columns(exp)
    return exp, ssi


def _name_columns(exp) -> None:
    """Column titles for the metrics, and HPARAMS_FIRST marked `differs`, in the experiment."""
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    (value,) = exp.value
    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
    for info in data.experiment.hparam_infos:
        info.differs = info.name in HPARAMS_FIRST
    for info in data.experiment.metric_infos:
        info.display_name = HPARAMS_METRICS[info.name.tag]
    value.metadata.plugin_data.content = data.SerializeToString()


def session_end(ok: bool):
    """The session's end status (shown in the HParams table's Status column)."""
    import time

    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import (
        PLUGIN_DATA_VERSION,
        PLUGIN_NAME,
        SESSION_END_INFO_TAG,
    )
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    info = SessionEndInfo(
        status=Status.Value("STATUS_SUCCESS" if ok else "STATUS_FAILURE"),
        end_time_secs=time.time(),
    )
    content = HParamsPluginData(session_end_info=info, version=PLUGIN_DATA_VERSION)
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=content.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=meta)])

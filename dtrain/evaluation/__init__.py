"""Downstream evaluation: multiple-choice tasks that need no download (tasks.py names them),
scored by the log-likelihood of each choice (scorer.py), during training (downstream.py) and
from the command line (dtrain/cli/evaluate.py)."""

from dtrain.evaluation.downstream import DownstreamEval, build_downstream, score_downstream
from dtrain.evaluation.items import Item
from dtrain.evaluation.scorer import accuracy, encode_requests, score_requests
from dtrain.evaluation.tasks import TASKS, build_tasks

__all__ = [
    "TASKS",
    "DownstreamEval",
    "Item",
    "accuracy",
    "build_downstream",
    "build_tasks",
    "encode_requests",
    "score_downstream",
    "score_requests",
]

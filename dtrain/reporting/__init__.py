"""What a run reports beyond metrics.jsonl, for comparing runs.

    tensorboard.py   run names, the event folder, the Custom Scalars layout, the HParams session
    summary.py       a run in a few numbers (compare's table row, the HParams/W&B/MLflow summary)
                     and compare's chart
    loggers.py       the optional Weights & Biases and MLflow loggers (imported lazily)

dtrain.metrics.MetricsWriter calls these on rank 0; dtrain.cli.compare reads runs back with them.
"""

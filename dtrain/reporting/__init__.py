"""What a run reports, and how runs are compared.

    metrics.py       throughput, MFU, memory per rank (gathered to rank 0), metrics.jsonl
    profiling.py     torch.profiler traces and the top operators (profile.*)
    inspector.py     samples and attention maps at each eval (inspect.*)
    allocator_snapshot.py  the CUDA allocator's history around the first steps and an OOM
    tensorboard.py   run names, the event folder, the Custom Scalars layout, the HParams session
    summary.py       a run in a few numbers (compare's table row, the HParams/W&B/MLflow summary)
                     and compare's chart
    loggers.py       the optional Weights & Biases and MLflow loggers (imported lazily)

dtrain.reporting.metrics.MetricsWriter calls these on rank 0; dtrain.cli.compare reads runs back
with them.
"""

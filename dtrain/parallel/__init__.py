"""Parallelism within a data-parallel replica: tensor/sequence (tensor.py) and context
(context.py) parallelism, dimensions of one device mesh (mesh.py) that the fsdp strategy
applies in torchtitan's order: TP -> activation checkpointing -> compile -> FSDP."""

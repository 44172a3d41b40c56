"""dtrain: train GPT-style language models on one device or many, and see what they do."""

__version__ = "0.1.0"

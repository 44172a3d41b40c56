"""Variants that are not a default, each in its own module; the core never imports this package
(dtrain/lowp/dispatch.py imports a variant's module when the config selects it). README.md."""

"""key=value command lines for the small CLIs, parsed into a typed dataclass.

Values are read as YAML scalars (64, 0.9, true, null), except for string fields, which keep the
text exactly as typed: a prompt like `prompt=def f(x):` must not be parsed as YAML.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from dtrain.config import build_dataclass
from dtrain.errors import ConfigError


def _is_plain_str(tp: Any) -> bool:
    """str or str | None (not list[str], whose argument is str too)."""
    if tp is str:
        return True
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and args == [str]


HELP_FLAGS = ("-h", "--help")


def exit_with_help_if_asked(
    argv: list[str],
    prog: str,
    doc: str | None,
    cls: type | None = None,
    required: tuple[str, ...] = (),
) -> None:
    """-h/--help anywhere: print the usage (and cls's keys with their defaults), exit 0."""
    if not any(a in HELP_FLAGS for a in argv):
        return
    lines = [f"usage: {prog} [key=value ...]", "", (doc or "").strip()]
    if cls is not None:
        lines += ["", "keys (default):"]
        for f in dataclasses.fields(cls):
            lines.append(f"  {f.name}=" + ("(required)" if f.name in required else _default(f)))
    print("\n".join(lines))
    raise SystemExit(0)


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else None
    if f.default_factory is not dataclasses.MISSING:  # a list's default, e.g. []
        value = f.default_factory()
    if value is None:
        return "null"
    if isinstance(value, list):  # as it is typed: key=[a, b]
        return "[" + ", ".join(_default_value(v) for v in value) + "]"
    return _default_value(value)


def _default_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_kv(cls: type, argv: list[str], required: tuple[str, ...] = ()) -> Any:
    """`key=value ...` -> cls(...); unknown keys, bad types and missing keys -> ConfigError."""
    import yaml

    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    data: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise ConfigError(
                f"argument {arg!r} is not key=value; valid keys: {', '.join(sorted(fields))}"
            )
        if key in hints and _is_plain_str(hints[key]) and raw not in ("null", "None"):
            data[key] = raw
            continue
        try:
            data[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            data[key] = raw
    missing = [k for k in required if data.get(k) in (None, "")]
    if missing:
        raise ConfigError(f"{missing[0]}= is required")
    return build_dataclass(cls, data)

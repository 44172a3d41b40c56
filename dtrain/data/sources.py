"""Document sources, all as `datasets.IterableDataset` streams of records with a text field.

hub       any Hugging Face dataset by path/name/split, streamed (never runs remote code)
local     txt, jsonl/json and parquet files: paths, globs or directories
embedded  the Python standard library's source (offline default), through the same machinery

A `SourceSpec` is a small picklable description; `open_records` builds the stream from it in
whichever process needs it (the main process for checks and eval, each DataLoader worker for
training). Everything that can be checked before training is checked in `check_source`, so a bad
file, an empty glob or a missing field is one line at start-up, not a traceback mid-run.
"""

from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import ConfigError, DataError

SOURCES = ("embedded", "hub", "local", "synthetic")
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # embedded | hub | local
    text_field: str = "text"
    path: str | None = None  # hub dataset path
    name: str | None = None  # hub config name (subset)
    split: str = "train"
    files: tuple[str, ...] = ()  # local: resolved file paths, sorted
    builder: str | None = None  # local: text | json | parquet
    max_bytes: int | None = None  # embedded: cap on the corpus size

    def key(self) -> str:
        """What identifies the data (for caches such as a trained tokenizer)."""
        if self.kind == "local":
            stats = []
            for f in self.files:
                st = os.stat(f)
                stats.append(f"{f}:{st.st_size}:{int(st.st_mtime)}")
            return "local|" + self.text_field + "|" + "|".join(stats)
        if self.kind == "embedded":
            return f"embedded|{self.max_bytes}"
        return f"hub|{self.path}|{self.name}|{self.split}|{self.text_field}"


def resolve_files(files: str | list[str] | None) -> list[str]:
    """Paths, globs and directories -> sorted list of data files; one-line errors otherwise."""
    if not files:
        raise ConfigError("data=local needs data.files=PATH (a file, a glob or a directory)")
    entries = [files] if isinstance(files, str) else list(files)
    out: list[str] = []
    for entry in entries:
        entry = os.path.expanduser(str(entry))
        if any(c in entry for c in "*?["):
            hits = sorted(globlib.glob(entry, recursive=True))
            hits = [h for h in hits if os.path.isfile(h)]
            if not hits:
                raise DataError(f"data.files glob '{entry}' matches no file")
            out.extend(hits)
        elif os.path.isdir(entry):
            hits = sorted(
                str(p) for p in Path(entry).rglob("*") if p.is_file() and p.suffix in FORMATS
            )
            if not hits:
                raise DataError(
                    f"data.files directory '{entry}' holds no {'/'.join(FORMATS)} files"
                )
            out.extend(hits)
        elif os.path.isfile(entry):
            out.append(entry)
        else:
            raise DataError(f"data.files: no such file or directory '{entry}'")
    for f in out:
        if not os.access(f, os.R_OK):
            raise DataError(f"data file '{f}' is not readable (permissions)")
    return out


def _builder_for(files: list[str], fmt: str | None) -> str:
    if fmt:
        if fmt not in set(FORMATS.values()):
            raise ConfigError(
                f"data.format={fmt!r} is not valid; choose text, json or parquet (or null: "
                "from the file extension)"
            )
        return fmt
    kinds = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in FORMATS:
            raise DataError(
                f"data file '{f}' has an unknown extension; use .txt, .jsonl, .json or "
                ".parquet, or set data.format"
            )
        kinds.add(FORMATS[suffix])
    if len(kinds) > 1:
        raise DataError(
            f"data.files mixes formats ({', '.join(sorted(kinds))}); give files of one format"
        )
    return kinds.pop()


def build_source_spec(cfg) -> SourceSpec:
    """DataConfig -> SourceSpec, resolving files. Raises ConfigError/DataError."""
    if cfg.source == "hub":
        if not cfg.path:
            raise ConfigError("data=hub needs data.path=<hub dataset>, e.g. roneneldan/TinyStories")
        return SourceSpec(
            "hub", text_field=cfg.text_field, path=cfg.path, name=cfg.subset, split=cfg.split
        )
    if cfg.source == "local":
        files = resolve_files(cfg.files)
        return SourceSpec(
            "local",
            text_field="text" if _builder_for(files, cfg.format) == "text" else cfg.text_field,
            files=tuple(files),
            builder=_builder_for(files, cfg.format),
        )
    if cfg.source == "embedded":
        return SourceSpec("embedded", max_bytes=cfg.max_bytes)
    raise ConfigError(f"unknown data.source '{cfg.source}'; valid choices: {', '.join(SOURCES)}")


def _embedded_gen(shards: list[list[str]]):
    from dtrain.data.embedded import documents_of

    for paths in shards:
        yield from ({"text": t} for t in documents_of(paths))


_OPENED: dict = {}  # SourceSpec -> IterableDataset; forked DataLoader workers inherit it


def open_records(spec: SourceSpec):
    """The source as a `datasets.IterableDataset` of records (streaming, no remote code).

    Opening resolves files and builder modules (about a second); each process does it once
    per source, and every epoch and stream starts a fresh iteration of the same object."""
    if spec not in _OPENED:
        _OPENED[spec] = _open(spec)
    return _OPENED[spec]


def _open(spec: SourceSpec):
    import datasets

    datasets.disable_progress_bars()
    # datasets logs a read error before raising it; we turn it into one DataError line instead.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if spec.kind == "hub":
        return datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=True)
    if spec.kind == "local":
        # Text files: one document per paragraph (blank-line separated); bad bytes -> U+FFFD,
        # which `classify` counts and skips.
        kwargs = (
            {"encoding_errors": "replace", "sample_by": "paragraph"}
            if spec.builder == "text"
            else {}
        )
        return datasets.load_dataset(
            spec.builder, data_files=list(spec.files), split="train", streaming=True, **kwargs
        )
    if spec.kind == "embedded":
        from dtrain.data.embedded import embedded_shards, shard_groups

        # One shard per file group: split_dataset_by_node can then give whole shards to streams.
        return datasets.IterableDataset.from_generator(
            _embedded_gen,
            gen_kwargs={"shards": shard_groups(embedded_shards(spec.max_bytes))},
        )
    raise ConfigError(f"unknown source kind {spec.kind!r}")


def check_source(spec: SourceSpec, probe: int = 64) -> None:
    """Fail at start-up, in one line, on what can be seen before training."""
    if spec.kind == "local":
        for f in spec.files:
            try:
                if os.path.getsize(f) == 0:
                    raise DataError(f"data file '{f}' is empty")
                if spec.builder == "parquet":
                    import pyarrow.parquet as pq

                    names = pq.ParquetFile(f).schema_arrow.names  # reads the footer
                    if spec.text_field not in names:
                        raise DataError(
                            f"data file '{f}' has no field '{spec.text_field}' (data.text_field);"
                            f" its fields: {', '.join(names)}"
                        )
                elif spec.builder == "json":
                    _check_json_field(f, spec.text_field)
                else:
                    with open(f, "rb") as fh:
                        fh.read(1)
            except DataError:
                raise
            except Exception as e:
                raise DataError(f"data file '{f}' cannot be read: {_one_line(e)}") from None
    try:
        ds = open_records(spec)
        rows = []
        for row in ds:
            rows.append(row)
            if len(rows) >= probe:
                break
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"data source {_describe(spec)} cannot be read: {_one_line(e)}") from None
    if not rows:
        raise DataError(f"data source {_describe(spec)} has no records")
    if spec.text_field not in rows[0]:
        raise DataError(
            f"records of {_describe(spec)} have no field '{spec.text_field}' (data.text_field); "
            f"their fields: {', '.join(rows[0])}"
        )
    if not any(isinstance(r.get(spec.text_field), str) and r[spec.text_field] for r in rows):
        raise DataError(
            f"the first {len(rows)} records of {_describe(spec)} have no text in "
            f"'{spec.text_field}' (all empty or not strings)"
        )


def _check_json_field(path: str, field: str) -> None:
    """The first record of a jsonl file has the text field: files of a glob are read as one
    table, where a file without it is a schema error deep in the read, not a named file."""
    import json

    with open(path, "rb") as fh:
        first = fh.readline(1 << 20).strip()
    try:
        rec = json.loads(first)
    except ValueError:
        return  # a .json array or a broken line: the probe below reports what it finds
    if isinstance(rec, dict) and field not in rec:
        raise DataError(
            f"data file '{path}' has no field '{field}' (data.text_field); its fields: "
            + ", ".join(rec)
        )


def _describe(spec: SourceSpec) -> str:
    if spec.kind == "hub":
        return f"'{spec.path}'" + (f" ({spec.name})" if spec.name else "")
    if spec.kind == "local":
        more = f" and {len(spec.files) - 1} more" if len(spec.files) > 1 else ""
        return f"'{spec.files[0]}'{more}"
    return "'embedded'"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]

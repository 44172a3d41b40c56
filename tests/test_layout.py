"""The house's structural rules, checked over dtrain/'s source with ast: no module imports
another's private names, the import graph (top-level and lazy imports) has no cycle, no
function is longer than 80 lines, no DTRAIN_* variable but the launcher's, fault injection's
and the cache's is read, and the default path of every precision runs without the
experimental wing (dtrain/lowp/experimental/)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, cli_env

PKG = ROOT / "dtrain"
MAX_LINES = 80
# Functions over MAX_LINES outside dtrain/lowp and dtrain/precision.py, to be split; this list
# only shrinks (a function that is split is removed from it, a new long one fails).
LONG_FUNCTIONS: set[str] = set()
# Import cycles allowed, each a sorted tuple of modules; to be broken, and the list only shrinks.
CYCLES: set[tuple[str, ...]] = set()
# The DTRAIN_* variables dtrain reads: fault injection, caches, the launcher's grace period.
# Anything that changes kernels or numerics is a typed config field instead.
ALLOWED_ENV = {"DTRAIN_FAULT", "DTRAIN_FAULT_SLEEP_S", "DTRAIN_CACHE", "DTRAIN_STOP_GRACE_S"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PKG.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _source(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The dtrain module that defines `name` (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str):
    """(target module, imported name or None, line) of every import of a dtrain module in
    `module`, at any depth (lazy imports inside functions too)."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _owner(alias.name):
                    yield _owner(alias.name), None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            src = _source(module, node)
            if not _owner(src):
                continue
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                else:
                    yield _owner(src), alias.name, node.lineno


def test_no_module_imports_another_modules_private_names():
    """`from X import _name` with X another module: a private name stays in its module. No
    exception, a package's __init__ included: what is shared gets a public name."""
    bad = [
        f"{m}:{line} imports {name} from {target}"
        for m in MODULES
        for target, name, line in _imports(m)
        if name and name.startswith("_") and not name.startswith("__") and target != m
    ]
    assert not bad, "\n".join(bad)


def _cycles() -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph = {m: {t for t, _, _ in _imports(m) if t != m} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    cycles = _cycles()
    assert cycles <= CYCLES, "import cycles:\n" + "\n".join(map(str, sorted(cycles - CYCLES)))
    assert not CYCLES - cycles, f"broken, remove from CYCLES: {sorted(CYCLES - cycles)}"


def test_no_function_is_longer_than_80_lines():
    long = {}
    for m, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long[f"{m}.{node.name}"] = lines
    new = {k: v for k, v in long.items() if k not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_LINES} lines: {new}"
    assert not LONG_FUNCTIONS - long.keys(), "split: remove from LONG_FUNCTIONS"
    lowp = [k for k in long if k.startswith(("dtrain.lowp", "dtrain.precision"))]
    assert not lowp, lowp


def test_only_the_launchers_fault_and_cache_variables_are_read():
    """Every DTRAIN_* name in dtrain/'s code (the variable read, or a constant naming it) is
    one of ALLOWED_ENV: a choice that changes kernels or numerics is a config field."""
    names = {
        (m, node.value)
        for m, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"DTRAIN_[A-Z0-9_]+", node.value)
    }
    bad = sorted((m, v) for m, v in names if v not in ALLOWED_ENV)
    assert not bad, bad
    assert {v for _, v in names} == ALLOWED_ENV  # each still read somewhere


_DEFAULT_PATHS = """
import importlib.util, sys
import torch
from dtrain.config import PrecisionConfig
from dtrain.model import ModelConfig, build_model
from dtrain.precision import PRECISIONS, apply_precision, build_precision, precision_hooks

cpu = torch.device("cpu")
torchao = importlib.util.find_spec("torchao") is not None
for name, p in PRECISIONS.items():
    if p.quantize in ("fp8", "int8-torchao") and not torchao:
        continue
    cfg = PrecisionConfig(name=name, fp8_emulate=p.quantize == "fp8")
    precision = build_precision(cfg, cpu, check_device=name != "fp16")
    model = build_model(ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=64), cpu)
    apply_precision(model, precision)
    precision_hooks(precision, model, cpu, sharded=False)
    x = torch.randint(0, 64, (1, 8))
    with precision.autocast(cpu):
        model(x, x).backward()
wing = sorted(m for m in sys.modules if m.startswith("dtrain.lowp.experimental"))
print("WING", wing)
"""


def test_the_default_paths_never_import_the_experimental_wing():
    res = subprocess.run(
        [sys.executable, "-c", _DEFAULT_PATHS],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "WING []" in res.stdout, res.stdout

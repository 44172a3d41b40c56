"""Every command in README.md and docs/*.md works as written.

The commands are the lines of the ```bash fences (continuation lines joined, comments dropped,
`a && b` split into its commands). Each is sorted by one rule, on what it runs; every kind is
checked in the default selection, and those that can run on a CPU are run in the slow one:

- train, `python launch/train.py ...`: its overrides compose (each point of a `-m` grid).
  Slow: run on CPU at tiny size (conftest's FAST overrides, a command's own max_steps kept up
  to 50) when it is one process, on offline data, at fp32, bf16 or bf16-true, logging offline;
  the others need a GPU or the network and are composed only.
- train-multi, torchrun, `dtrain-torchrun`, `launch/entrypoint.sh`, `launch/multinode.sh`,
  `sbatch launch/slurm.sbatch`, `kubectl apply` of the Kubernetes job: their overrides
  compose (tests/test_multirank.py and tests/test_multinode.py run these launchers).
- sweep, `python launch/sweep.py ...`: every point composes. Slow: run at tiny size when every
  point is one process.
- cli, `python -m dtrain.cli.NAME ...` (under torchrun: run in one process): plan's overrides
  compose, the other tools' keys parse. Slow: run as written (calibrate within 2 s), after
  tiny runs make the run dirs it reads where the page has not made them.
- install (`scripts/install.sh`, `pip install`, a virtual environment): the extras it names
  exist in pyproject.toml.
- pytest: its paths exist and its markers are declared.
- tensorboard: installed. Slow: its logdir holds event files after the page's earlier commands.
- docker build: the Dockerfile exists.
- recipe, any other command of a block that names a bench/ script or tests/gpu/ (benchmarks
  and GPU tests for a GPU host): every repository path it names exists, and its shell scripts
  parse (`bash -n`).

A command of none of these kinds fails the test, unless its fence is preceded by
`<!-- not-run: reason -->`. Running happens in a scratch folder holding links to the checkout
(and a small `corpus/` of text files for the data examples), so runs never write into the
repository. A command known to fail until its fix lands is listed in KNOWN_BROKEN: it is
expected to fail (xfail), and the test fails once it works, so the entry is removed.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import itertools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, cli_env

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

# (page, a phrase of the command): why it fails today. Expected to fail; a pass fails the test.
KNOWN_BROKEN: dict[tuple[str, str], str] = {}

RUN_PRECISIONS = {"fp32", "bf16", "bf16-true"}  # the others need a GPU's kernels
OFFLINE_SOURCES = {"embedded", "local", "synthetic"}
MAX_STEPS_RUN = 50  # a command's own max_steps up to this is kept (its step folders exist)
STEPS_CAPPED = 6


# ---------------------------------------------------------------------------------------------
# Reading the pages


@dataclass
class Command:
    page: str
    line: int  # of the fence's first line of this command
    text: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    recipe_block: bool = False
    not_run: str | None = None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"

    @property
    def known_broken(self) -> str | None:
        for (page, phrase), why in KNOWN_BROKEN.items():
            if page == self.page and phrase in self.text:
                return why
        return None


FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$")
RECIPE = re.compile(r"(?:^|[\s\"'=])(?:bench/[\w./-]+|tests/gpu\b)")
SEPARATORS = {"&&", ";", "||", "|"}


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    return list(lex)


def _expand(token: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), token)


def page_commands(page: str) -> list[Command]:
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").splitlines()
        note = NOT_RUN.search(before[-1]) if before else None
        first = text[: m.start()].count("\n") + 2
        body = m.group(1)
        recipe = bool(RECIPE.search(body))
        variables: dict[str, str] = {}
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            start, joined = i, lines[i]
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            tokens = _tokens(joined)
            parts: list[list[str]] = [[]]
            for t in tokens:
                if t in SEPARATORS:
                    parts.append([])
                else:
                    parts[-1].append(t)
            for part in parts:
                if not part:
                    continue
                env = {}
                while part and re.match(r"^[A-Z_][A-Z0-9_]*=", part[0]):
                    k, v = part.pop(0).split("=", 1)
                    env[k] = v
                if not part:  # a variable of the block (T=..., R=...)
                    variables.update(env)
                    continue
                argv = []
                for t in part:  # an unquoted $VAR holding words is split, as bash does
                    x = _expand(t, variables)
                    argv += x.split() if t.startswith("$") else [x]
                note_text = note.group(1) if note else None
                out.append(
                    Command(page, first + start, " ".join(part), argv, env, recipe, note_text)
                )
    return out


ALL = [c for p in PAGES for c in page_commands(p)]


# ---------------------------------------------------------------------------------------------
# Sorting


PYTHONS = {"python", "python3"}
TORCHRUNS = {"torchrun", "dtrain-torchrun"}
MULTI_LAUNCHERS = {"launch/entrypoint.sh", "launch/multinode.sh", "launch/slurm.sbatch"}


def kind(c: Command) -> str:
    a = c.argv
    head, rest = a[0], a[1:]
    if head in PYTHONS and rest[:1] == ["launch/train.py"]:
        return "train"
    if head in PYTHONS and rest[:1] == ["-m"] and len(rest) > 1:
        module = rest[1]
        if module.startswith("dtrain.cli."):
            return "cli"
        if module == "pytest":
            return "pytest"
        if module == "venv":
            return "install"
        if module in ("dtrain.launcher", "torch.distributed.run"):
            head = "torchrun"
    if head in TORCHRUNS or head == "torchrun":
        if any(x.endswith("launch/train.py") for x in a):
            return "train-multi"
        if "-m" in a and a[a.index("-m") + 1].startswith("dtrain.cli."):
            return "cli"
    if c.recipe_block:
        return "recipe"
    if head in PYTHONS and rest[:1] == ["launch/sweep.py"]:
        return "sweep"
    if head == "pytest":
        return "pytest"
    if head == "pip" or (head == "bash" and rest[:1] == ["scripts/install.sh"]):
        return "install"
    if head == "source" and rest and rest[0].endswith("/bin/activate"):
        return "install"
    if head == "tensorboard":
        return "tensorboard"
    if head in MULTI_LAUNCHERS or (head == "sbatch" and any(x in MULTI_LAUNCHERS for x in rest)):
        return "train-multi"
    if head == "kubectl" and rest[:1] == ["apply"]:
        return "train-multi"
    if head == "docker" and rest[:1] == ["build"]:
        return "docker"
    return "unknown"


def overrides(c: Command) -> list[str]:
    """The Hydra overrides of a training command (after launch/train.py or a launcher)."""
    a = c.argv
    if a[0] == "kubectl":
        import yaml

        path = ROOT / a[a.index("-f") + 1]
        spec = yaml.safe_load(path.read_text())
        workers = spec["spec"]["pytorchReplicaSpecs"]["Worker"]
        return list(workers["template"]["spec"]["containers"][0]["args"])
    for i, x in enumerate(a):
        if x.endswith("launch/train.py") or x in MULTI_LAUNCHERS:
            return [o for o in a[i + 1 :] if "=" in o and not o.startswith("-")]
    raise AssertionError(f"no overrides found in {c}")


def grid(ovs: list[str]) -> list[list[str]]:
    """Every point of a grid whose axes are `key=a,b,c` (Hydra's multirun and sweep.py)."""
    axes = []
    for o in ovs:
        key, _, value = o.partition("=")
        if "," in value and not value.startswith("["):
            axes.append([f"{key}={v}" for v in value.split(",")])
        else:
            axes.append([o])
    return [list(p) for p in itertools.product(*axes)]


def compose(ovs: list[str]):
    from dtrain.config import compose as _compose

    return _compose(list(ovs))


def runs_here(ovs: list[str]) -> bool:
    cfg = compose([*[o for o in ovs if not _made_by_the_page(o)], *FAST])
    uri = cfg.metrics.mlflow.tracking_uri or ""
    return (
        cfg.precision.name in RUN_PRECISIONS
        and cfg.data.source in OFFLINE_SOURCES
        and cfg.data.tokenizer in ("byte", "bpe")  # a named tokenizer comes from the Hub
        and not (cfg.metrics.wandb.enabled and cfg.metrics.wandb.mode == "online")
        and not (cfg.metrics.mlflow.enabled and uri.startswith(("http:", "https:")))
    )


# ---------------------------------------------------------------------------------------------
# Checks without running (default selection)


def _pyproject_section(name: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return text.split(f"[{name}]", 1)[1].split("\n[", 1)[0]


def _extras() -> set[str]:
    section = _pyproject_section("project.optional-dependencies")
    return set(re.findall(r"^([\w-]+) = \[", section, re.M))


def _markers() -> set[str]:
    section = _pyproject_section("tool.pytest.ini_options")
    return set(re.findall(r'^\s*"(\w+)[:(]', section, re.M))


REPO_PATH = re.compile(r"^(?:bench|tests|launch|scripts|conf|dtrain)/[\w./*-]*")


def _repo_paths(tokens: list[str]) -> list[str]:
    paths = []
    skip_next = False
    for t in tokens:
        if skip_next:
            skip_next = False
            continue
        if t in ("--out", "--png"):  # outputs, made by the command
            skip_next = True
            continue
        t = t.split("=", 1)[1] if re.match(r"^[\w.]+=", t) else t
        m = REPO_PATH.match(t)
        if m and "$" not in t:
            paths.append(m.group(0).split("::")[0].rstrip("./"))
    return paths


def _made_by_the_page(o: str) -> bool:
    """An override that reads what an earlier command of the page writes (an export, a
    checkpoint): composed without it here, run with it in the slow test."""
    if o.startswith("model.init_from=hf:"):
        return not (ROOT / o.split(":", 1)[1]).exists()
    if o.startswith("resume=") and o not in ("resume=auto", "resume=never"):
        return not (ROOT / o.split("=", 1)[1]).exists()
    return False


def static_check(c: Command) -> None:
    k = kind(c)
    a = c.argv
    if k == "train":
        ovs = [o for o in overrides(c) if not _made_by_the_page(o)]
        points = grid(ovs) if "-m" in a or "--multirun" in a else [ovs]
        for p in points:
            compose(p)
    elif k == "train-multi":
        compose(overrides(c))
    elif k == "sweep":
        for p in grid([o for o in a[2:] if "=" in o and not o.startswith("-")]):
            compose(p)
    elif k == "cli":
        module = a[a.index("-m") + 1]
        args = a[a.index("-m") + 2 :]
        assert importlib.util.find_spec(module), f"no module {module}"
        if module == "dtrain.cli.plan":
            from dtrain.cli.plan import PLAN_KEYS

            compose([o for o in args if o.split("=")[0] not in PLAN_KEYS])
        elif module != "dtrain.cli.compare":
            from dtrain.cli._kv import parse_kv

            mod = importlib.import_module(module)
            (cls,) = [v for n, v in vars(mod).items() if n.endswith("Args") and isinstance(v, type)]
            parse_kv(cls, args)
    elif k == "install":
        named = set()
        for t in a:
            m = re.search(r"\[([\w,-]+)\]", t)
            if m:
                named |= set(m.group(1).split(","))
        if a[:2] == ["bash", "scripts/install.sh"] and len(a) > 2:
            named |= set(a[2].split(","))
        assert named <= _extras(), f"unknown extras {named - _extras()}"
    elif k == "pytest":
        for p in _repo_paths(a):
            assert glob.glob(str(ROOT / p)), f"no {p}"
        after = a[a.index("pytest") + 1 :]
        if "-m" in after:
            words = set(re.findall(r"\w+", after[after.index("-m") + 1])) - {"and", "or", "not"}
            assert words <= _markers(), f"undeclared markers {words - _markers()}"
    elif k == "tensorboard":
        assert importlib.util.find_spec("tensorboard"), "pip install tensorboard"
    elif k == "docker":
        assert (ROOT / "Dockerfile").is_file()
    elif k == "recipe":
        for p in _repo_paths(a):
            found = glob.glob(str(ROOT / p))
            assert found, f"no {p} in the repository"
            for f in found:
                if f.endswith(".sh"):
                    r = subprocess.run(["bash", "-n", f], capture_output=True, text=True)
                    assert r.returncode == 0, r.stderr
    else:
        raise AssertionError(f"unknown kind {k}")


def test_every_command_is_sorted_by_the_rule():
    unknown = [str(c) for c in ALL if kind(c) == "unknown" and not c.not_run]
    assert not unknown, "neither run nor checked (annotate with <!-- not-run: reason -->):\n" + (
        "\n".join(unknown)
    )
    assert all(c.not_run.strip() for c in ALL if c.not_run is not None), "not-run needs a reason"


@pytest.mark.parametrize("page", PAGES)
def test_commands_compose_and_name_what_exists(page):
    failures = []
    for c in page_commands(page):
        if c.not_run or kind(c) == "unknown":
            continue
        try:
            static_check(c)
        except Exception as e:  # every failure of the page at once, each with its line
            failures.append(f"{c}\n    {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def test_readme_test_command_is_what_ci_runs():
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python -m pytest")
    ]
    readme = [" ".join(c.argv) for c in page_commands("README.md") if kind(c) == "pytest"]
    assert [" ".join(shlex.split(x)) for x in ci] == readme[: len(ci)]


def test_the_rule_sorts_known_shapes():
    def k(line: str, recipe=False) -> str:
        return kind(Command("x.md", 1, line, shlex.split(line), recipe_block=recipe))

    assert k("python launch/train.py model=tiny") == "train"
    assert k("dtrain-torchrun --nproc_per_node=2 launch/train.py strategy=ddp") == "train-multi"
    assert k("sbatch --nodes=4 launch/slurm.sbatch strategy=fsdp") == "train-multi"
    assert k("python -m dtrain.cli.plan model=1b") == "cli"
    assert k("torchrun --nproc_per_node=8 -m dtrain.cli.calibrate") == "cli"
    assert k("bash bench/core.sh single", recipe=True) == "recipe"
    assert k("python launch/train.py model=1b", recipe=True) == "train"
    assert k("curl https://example.com") == "unknown"
    assert grid(["a=1,2", "b=3", "c=[4,5]"]) == [
        ["a=1", "b=3", "c=[4,5]"],
        ["a=2", "b=3", "c=[4,5]"],
    ]


# ---------------------------------------------------------------------------------------------
# Running (slow)


def _sandbox(tmp: Path) -> Path:
    s = tmp / "work"
    s.mkdir()
    for name in ("launch", "conf", "bench", "tests", "scripts", "dtrain", "pyproject.toml"):
        (s / name).symlink_to(ROOT / name)
    (s / "docs" / "img").mkdir(parents=True)
    for md in (ROOT / "docs").glob("*.md"):
        (s / "docs" / md.name).symlink_to(md)
    corpus = s / "corpus"
    corpus.mkdir()
    pages = [md.read_text() for md in sorted((ROOT / "docs").glob("*.md"))]
    paragraphs = [p for text in pages for p in text.split("\n\n") if p.strip()]
    for name, part in (("a.jsonl", paragraphs[::2]), ("b.jsonl", paragraphs[1::2])):
        (corpus / name).write_text("".join(json.dumps({"text": p}) + "\n" for p in part))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": paragraphs}), corpus / "books.parquet")
    return s


def _env(s: Path) -> dict:
    env = cli_env()
    env.update(
        HF_HUB_OFFLINE="1",
        DTRAIN_CACHE=str(s / "cache"),
        MPLBACKEND="Agg",
        WANDB_SILENT="true",
        WANDB_MODE="offline",
        PWD=str(s),
        OUT=str(s / "out"),
    )
    return env


def _localise(argv: list[str], s: Path) -> list[str]:
    return [x.replace("/tmp/", f"{s}/tmp/").replace("$PWD", str(s)) for x in argv]


def _steps(ovs: list[str]) -> list[str]:
    written = [int(o.split("=")[1]) for o in ovs if o.startswith("trainer.max_steps=")]
    if written and written[-1] <= MAX_STEPS_RUN:
        return []
    return [f"trainer.max_steps={STEPS_CAPPED}"]


def _tiny_run(run_dir: Path, s: Path, env: dict) -> None:
    cmd = [
        sys.executable,
        "launch/train.py",
        *FAST,
        "trainer.max_steps=4",
        f"hydra.run.dir={run_dir}",
    ]
    r = subprocess.run(cmd, cwd=s, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _make_read_runs(module: str, args: list[str], s: Path, env: dict) -> None:
    """Run dirs a CLI reads that the page has not made: a tiny CPU run each."""
    if module == "dtrain.cli.compare":
        skip, paths = False, []
        for x in args:
            if skip:
                skip = False
            elif x == "--png":
                skip = True
            elif not x.startswith("-"):
                paths.append(x)
    elif module in ("dtrain.cli.generate", "dtrain.cli.export"):
        paths = [x.split("=", 1)[1] for x in args if x.startswith("checkpoint=")]
    else:
        return
    for p in paths:
        if not glob.glob(str(s / p)):
            _tiny_run(s / p.replace("*", "single-fp32-w1-tiny").rstrip("/"), s, env)


def _shell_glob(args: list[str], s: Path) -> list[str]:
    """Paths with * expanded as bash does (a pattern that matches nothing stays as it is)."""
    out = []
    for x in args:
        found = sorted(glob.glob(x, root_dir=s)) if "*" in x and "=" not in x else []
        out += found or [x]
    return out


def run_command(c: Command, s: Path, env: dict) -> str | None:
    """Runs c in the sandbox; returns None when it ran and passed, or why it was not run."""
    k, a = kind(c), _localise(c.argv, s)
    cmd_env = {**env, **c.env}
    if k == "train":
        ovs = overrides(c)
        if not all(runs_here(p) for p in (grid(ovs) if "-m" in a else [ovs])):
            return "needs a GPU or the network: composed only"
        cmd = [sys.executable, *a[1:], *FAST, *_steps(ovs)]
    elif k == "sweep":
        nproc = a[a.index("--nproc") + 1] if "--nproc" in a else "1"
        points = grid([o for o in a[2:] if "=" in o and not o.startswith("-")])
        if nproc != "1" or not all(runs_here(p) for p in points):
            return "several processes or a GPU: composed only"
        # sweep.py runs its points from the checkout's root: an absolute --out keeps them here
        a = [str(s / x) if i and a[i - 1] == "--out" else x for i, x in enumerate(a)]
        cmd = [sys.executable, *a[1:], *FAST, *_steps(points[0])]
    elif k == "cli":
        i = a.index("-m")
        module, args = a[i + 1], a[i + 2 :]
        if module == "dtrain.cli.calibrate":
            args = [x for x in args if not x.startswith("seconds=")] + ["seconds=2"]
        _make_read_runs(module, args, s, cmd_env)
        cmd = [sys.executable, "-m", module, *_shell_glob(args, s)]
    elif k == "tensorboard":
        logdir = s / a[a.index("--logdir") + 1]
        events = list(logdir.rglob("events.out.tfevents*"))
        assert events, f"{c}: no event files under {logdir}"
        return None
    else:
        return f"{k}: checked without running"
    r = subprocess.run(cmd, cwd=s, env=cmd_env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"{c}\n    exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
    return None


RUN_PAGES = [
    p for p in PAGES if any(kind(c) in ("train", "sweep", "cli") for c in page_commands(p))
]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_commands_run(page, tmp_path):
    s = _sandbox(tmp_path)
    env = _env(s)
    expected_failures, unexpected_passes = [], []
    for c in page_commands(page):
        if c.not_run:
            continue
        try:
            run_command(c, s, env)
        except AssertionError as e:
            if not c.known_broken:
                raise
            expected_failures.append(f"{c}: {c.known_broken}\n{e}")
        else:
            if c.known_broken:
                unexpected_passes.append(str(c))
    assert not unexpected_passes, "works now: remove from KNOWN_BROKEN:\n" + "\n".join(
        unexpected_passes
    )
    if expected_failures:
        pytest.xfail("\n".join(expected_failures))


@pytest.mark.parametrize("page", PAGES)
def test_links_between_pages_resolve(page):
    text = (ROOT / page).read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [x for x in links if not re.match(r"^[a-z]+:", x)]
    missing = [x for x in local if not ((ROOT / page).parent / x).exists()]
    assert not missing, f"{page} links to missing files: {missing}"

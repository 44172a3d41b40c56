"""Code, docs and configs speak to users; none narrates how the project was made (DESIGN.md,
rule 11): no work sessions, device calls, rounds or who measured. History is git log.

The scan covers README.md, docs/, dtrain/, tests/, launch/, conf/ and bench/'s scripts
(bench/results/ holds recorded outputs, not prose). A legitimate use of one of the words (a
TensorBoard HParams session, pytest's session scope) is allowed by its exact file and phrase in
ALLOWED below; every other hit fails the test with file:line.
"""

from __future__ import annotations

import re

from tests.conftest import ROOT

ORDINALS = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"thirtieth|fortieth|fiftieth|sixtieth"
)
NARRATION = re.compile(
    "|".join(
        [
            r"\bsessions?\b",
            rf"\b(?:twenty|thirty|forty|fifty|sixty)-(?:{ORDINALS})\b",
            r"\b\d+(?:st|nd|rd|th) session",
            r"\bcalls? \d+(?:\s*(?:-|–|,|and)\s*\d+)*\b",
            r"\bdevice calls?\b",
            r"\bwas lent\b",
            r"\b(?:we|I) measured\b",
            r"\bthis round\b",
            r"\b(?:same|that|an earlier|a later) call\b",
            r"\b(?:of|in|from|by) (?:one|its|its own|this|a single) call\b",
            r"\b(?:one|two|three|four|five|six|seven|eight|nine|ten|\d+) calls\b",
            r"\((?:\d+|one|two|three) calls?\)",
            r"\bcall\d+_",  # a device call's raw folder
            r"\bgpu-s\d+\b",  # a session's raw folder
            r"\bmachine is held\b",
        ]
    ),
    re.IGNORECASE,
)

# (file, phrase on the line): uses of the words that are not narration.
ALLOWED = {
    ("dtrain/reporting/__init__.py", "the HParams session"),
    ("dtrain/reporting/tensorboard.py", "the HParams session"),
    ("dtrain/reporting/tensorboard.py", "experiment and session-start summaries"),
    ("dtrain/reporting/tensorboard.py", "the session's folder"),
    ("dtrain/reporting/tensorboard.py", "(experiment, session start) summaries"),
    ("dtrain/reporting/tensorboard.py", "The session's end status"),
    ("dtrain/reporting/tensorboard.py", "reads a session's metrics"),
    ("dtrain/reporting/metrics.py", "the HParams session"),
    ("docs/metrics.md", "the HParams session"),
    ("docs/metrics.md", "writes its session (hyperparameters)"),
    ("docs/metrics.md", "the session's status"),
    ("tests/faults/helpers.py", "live in sessions of their own"),  # POSIX process sessions
    ("tests/faults/helpers.py", "(the same call the loop makes)"),  # a function call
    ("tests/test_bench_launch_times.py", "in a session of its own"),
    ("bench/launch_times.py", "in a session of its own"),
    ("bench/tensorboard_screenshots.py", "trained by an earlier call"),  # of this function
    ("tests/gpu/common.py", "<session dir>"),  # pytest's base temp of a session
    ("tests/gpu/conftest.py", 'scope="session"'),  # a pytest fixture scope
    ("tests/test_reporting.py", "(session,) = g.sessions"),  # TensorBoard's HParams records
    ("tests/test_reporting.py", "session.status"),
    ("tests/test_no_narration.py", ""),  # this file names the words it looks for
    ("bench/extract_results.py", '"2026-'),  # the raw folders it reads from RAW_REV
    ("dtrain/lowp/fp8/linear.py", "all in one call (cast_shards)"),  # a function call
}

SCANNED = ["README.md", "docs", "dtrain", "tests", "launch", "conf", "bench"]
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".sbatch", ".txt", ".toml"}


def scanned_files():
    for top in SCANNED:
        path = ROOT / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if rel.startswith("bench/results/") or "__pycache__" in rel:
                continue
            if f.suffix in SUFFIXES or f.name in ("Dockerfile", "entrypoint.sh"):
                yield rel, f


def allowed(rel: str, line: str) -> bool:
    return any(rel == f and phrase in line for f, phrase in ALLOWED)


def narration_hits() -> list[str]:
    hits = []
    for rel, f in scanned_files():
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if NARRATION.search(line) and not allowed(rel, line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    return hits


def test_the_pattern_finds_narration_and_the_allow_list_is_exact():
    for text in [
        "measured in the forty-third session",
        "(call 3)",
        "calls 1-2 of the tenth session",
        "the session's device time was spent",
        "the GPU was lent for an hour",
        "we measured 1.2x",
        "this round's figures",
        "in the same call",
        "the bf16 run of its call",
        "1.253 (1 call)",
        "in two calls of one machine",
        "bench/results/2026-12-04-gpu-s43/call3_slice8b",
        "while the machine is held",
    ]:
        assert NARRATION.search(text), text
    for text in ["a process group", "each call to forward", "the caller", "recalls"]:
        assert not NARRATION.search(text), text
    assert allowed("docs/metrics.md", "and the HParams session")
    assert not allowed("docs/metrics.md", "the forty-third session")
    assert not allowed("docs/benchmarks.md", "the HParams session")


def test_no_narration():
    hits = narration_hits()
    assert not hits, f"{len(hits)} narration line(s):\n" + "\n".join(hits)

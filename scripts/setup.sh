#!/usr/bin/env bash
# Set up cpkit for development and testing on this machine.
# torch comes first: a bare `torch` requirement would pull several GB of CUDA packages onto a
# CPU-only machine. A machine that already has torch (e.g. a GPU machine) keeps its own.
# Offline (a GPU machine without network, README "GPU machines"): with a .whl/ folder from
# scripts/host-wheels.sh (every wheel a host with only torch needs), everything installs from it,
# nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  echo "set-up: offline, from .whl/ (megatron-core wheel, then cpkit[test] editable)"
  "$PY" -c "import megatron.core" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps .whl/megatron_core-*.whl
  # the editable install builds without isolation, so with the host's own setuptools (a fresh
  # Python 3.12 venv has none)
  "$PY" -c "import setuptools" 2>/dev/null || "$PY" -m pip install -q --no-index --find-links .whl setuptools
  "$PY" -m pip install -q --no-index --find-links .whl --no-build-isolation -e ".[test]"
else
  if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      echo "set-up: installing torch (CUDA build, several GB: minutes)"
      "$PY" -m pip install -q "torch>=2.6"
    else
      # Resolves to the CPU wheel where a CPU wheel index/find-links is configured (as on the
      # project's machines); elsewhere add: --index-url https://download.pytorch.org/whl/cpu
      echo "set-up: installing torch 2.13.0 (CPU build, about 200 MB)"
      "$PY" -m pip install -q torch==2.13.0
    fi
  fi
  echo "set-up: installing cpkit[test] editable (megatron-core, pytest, hypothesis)"
  "$PY" -m pip install -q -e ".[test]"
fi
echo "set-up: checking that cpkit, torch and megatron-core import"
# The check imports megatron-core, which warns that Transformer Engine and Apex are not installed:
# nothing to act on here, so it is quiet about those notices as every cpkit command is. torch
# first, as on a GPU host whose pip torch brings the CUDA libraries the others load.
"$PY" -c "import torch; from cpkit.notices import quiet_known_notices; quiet_known_notices(); import cpkit, megatron.core; print('cpkit ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"

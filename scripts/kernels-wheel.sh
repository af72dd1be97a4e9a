#!/usr/bin/env bash
# Download the cuDNN frontend wheel (the `cpkit[kernels]` extra: src/cpkit/attention/cudnn_fe.py)
# that a GPU machine without network installs from .whl/ (scripts/gpu-env.sh installs it, without
# its optional CuTe-DSL dependencies, when it is not importable). Run on a machine with network;
# copy .whl/ to the GPU machine's checkout. Python 3.12, x86-64 Linux.
# Usage: bash scripts/kernels-wheel.sh [version]   (default 1.32.0)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "nvidia-cudnn-frontend==${1:-1.32.0}"
ls -l .whl

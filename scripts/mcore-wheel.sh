#!/usr/bin/env bash
# Download the megatron-core wheel that a GPU machine without network installs from .whl/
# (scripts/gpu-env.sh installs it when megatron-core is not importable). Run on a machine with
# network; copy .whl/ to the GPU machine's checkout. Python 3.12, x86-64 Linux.
# Usage: bash scripts/mcore-wheel.sh [version]   (default 0.19.2)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "megatron-core==${1:-0.19.2}"
# coverage (cpkit[test]: `cpkit validate --record-map` and the --changed selection's tests). A
# host with nothing but torch needs more: scripts/host-wheels.sh downloads every wheel.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "coverage>=7.16"
ls -l .whl

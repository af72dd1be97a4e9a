#!/usr/bin/env bash
# Every wheel that a GPU host with only CUDA torch (Python 3.12, x86-64 Linux) needs to set cpkit up
# without network, at pinned versions, into ${WHEEL_DIR:-.whl}/: megatron-core and the cuDNN
# frontend without their dependencies (torch is the host's), cpkit's own (einops, numpy, pyyaml),
# the build backend (setuptools: the editable install builds without isolation) and cpkit[test]
# (pytest, pytest-xdist, pytest-timeout, hypothesis, coverage) with theirs. Nothing else is assumed
# on the host. Run on a machine with network; carry .whl/ to the host, where `bash
# scripts/setup.sh` installs from it offline and scripts/gpu-env.sh finds MCore and the frontend.
# Usage: bash scripts/host-wheels.sh        (PY_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${WHEEL_DIR:-.whl}
get() {
  python3 -m pip download -q --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform "${PLATFORM:-manylinux_2_28_x86_64}" -d "$dir" "$@"
}
# The pins: tests/test_host_wheels.py holds them to pyproject.toml's requirements.
get --no-deps megatron-core==0.19.2 nvidia-cudnn-frontend==1.32.0
get einops==0.8.2 numpy==2.4.6 pyyaml==6.0.3 setuptools==80.9.0 \
  pytest==9.0.3 pytest-xdist==3.8.0 pytest-timeout==2.4.0 hypothesis==6.155.2 coverage==7.17.5
ls "$dir"

#!/usr/bin/env bash
# flash-linear-attention's wheels for an offline GPU host, into .fla/ (git ignores it): fla-core
# (the Triton kernels of the gated delta rule, pure Python) and flash-linear-attention, 0.6.0, with
# einops. Installed there with --no-deps: the host's torch and Triton serve them, and
# flash-linear-attention's declared transformers dependency is only for its optional model zoo.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .fla
python3 -m pip download -q --no-deps --only-binary=:all: -d .fla \
  "fla-core==${FLA_VERSION:-0.6.0}" "flash-linear-attention==${FLA_VERSION:-0.6.0}" einops
ls .fla

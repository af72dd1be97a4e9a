#!/usr/bin/env bash
# Every file an offline GPU host needs for the GPU CI (scripts/gpu-proof.sh), in one command on a
# host with network (and nvcc 13 for TE's extension; scripts/GPU_CI.md):
#   .whl/     the set-up and test wheels, MCore and the cuDNN frontend (scripts/host-wheels.sh);
#   .te/      the Transformer Engine bundle with its PyTorch extension built now and its needs
#             (scripts/te-bundle.sh --build-torch-ext; a failed build fails this command);
#   .upstream/ Megatron-LM and Megatron-Bridge at the commits of scripts/upstream-pins.txt
#             (scripts/upstream-pack.sh);
#   .fla/     flash-linear-attention's wheels, the hybrid GDN's GPU kernels (scripts/fla-wheels.sh).
# Any step that fails fails the command, naming the step. Carry the four folders to the GPU
# host's checkout (git ignores them).
# Usage: bash scripts/gpu-ci-prepare.sh [MEGATRON_LM_CHECKOUT MEGATRON_BRIDGE_CHECKOUT]
#        (TE_BUNDLE_ARGS="--arch sm_90,sm_100" passes options to te-bundle.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
step() {
  echo "gpu-ci-prepare: $*"
  "$@" || { echo "gpu-ci-prepare: FAILED: $* (exit $?); the prepared files are incomplete" >&2; exit 1; }
}
step bash scripts/host-wheels.sh
# shellcheck disable=SC2086  # TE_BUNDLE_ARGS is a list of options
step bash scripts/te-bundle.sh --build-torch-ext ${TE_BUNDLE_ARGS:-}
step bash scripts/upstream-pack.sh "$@"
step bash scripts/fla-wheels.sh
echo "gpu-ci-prepare: done; carry these to the GPU host's checkout:"
ls -l .whl .te .upstream .fla

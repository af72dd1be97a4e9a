#!/usr/bin/env bash
# Bundle Transformer Engine for a GPU machine without network (run on a machine with network).
# Downloads TE ${TE_VERSION:-2.20.2} for CUDA 13 and PyTorch, Python 3.12, x86-64 Linux, with the
# Python packages it needs that torch does not bring, and splits the large core wheel into parts of
# ${TE_PART_SIZE:-50M} so that each bundle folder stays small: .te1/, .te2/, ... in the repository
# root (git ignores them). Copy those folders to the GPU machine's checkout and run
# `bash scripts/te-install.sh` there.
# Usage: bash scripts/te-bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=${TE_VERSION:-2.20.2}
part_size=${TE_PART_SIZE:-50M}
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
wheels_for_gpu_host=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
python3 -m pip download -q "${wheels_for_gpu_host[@]}" -d "$download" \
  "transformer-engine-cu13==$version" "transformer-engine==$version" "nvidia-cudnn-frontend>=1.29.0" \
  pydantic pydantic-core annotated-types typing-inspection nvdlfw-inspect "typing_extensions>=4.16"
# The PyTorch extension exists only as a source archive; te-install.sh builds it on the GPU machine.
python3 -m pip download -q --no-deps -d "$download" "transformer-engine-torch==$version"
core=$(ls "$download"/transformer_engine_cu13-*.whl)
basename "$core" > "$download/core-wheel-name.txt"
(cd "$download" && split -b "$part_size" -d -a 2 "$core" core-part- && rm "$core")
rm -rf .te[0-9]*
n=0
for part in "$download"/core-part-*; do
  n=$((n + 1)); mkdir -p ".te$n"; mv "$part" ".te$n/"
done
n=$((n + 1)); mkdir -p ".te$n"
mv "$download"/*.whl "$download"/*.tar.gz "$download/core-wheel-name.txt" ".te$n/"
du -sh .te[0-9]*

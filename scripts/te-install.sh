#!/usr/bin/env bash
# Install the Transformer Engine bundle that scripts/te-bundle.sh made (.te1/, .te2/, ... in the
# repository root) on a GPU machine without network: reassemble the core wheel, install the wheels
# into ${TE_SITE:-/tmp/site} and build TE's PyTorch extension against the torch installed here
# (needs torch with CUDA 13, nvcc and ninja; about 100 s on 16 cores). scripts/gpu-env.sh puts
# /tmp/site on PYTHONPATH, so the GPU scripts find TE afterwards.
# Usage: bash scripts/te-install.sh [bundle folder ...]   (default: .te*/)
set -euo pipefail
cd "$(dirname "$0")/.."
site=${TE_SITE:-/tmp/site}
folders=("$@"); [ ${#folders[@]} -gt 0 ] || folders=(.te[0-9]*)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for folder in "${folders[@]}"; do cp "$folder"/* "$work"/; done
[ -f "$work/core-wheel-name.txt" ] || { echo "no TE bundle in ${folders[*]}: run scripts/te-bundle.sh" >&2; exit 1; }
cat "$work"/core-part-* > "$work/$(cat "$work/core-wheel-name.txt")"
rm "$work"/core-part-*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$work"/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
tar xzf "$work"/transformer_engine_torch-*.tar.gz -C "$work"
source_dir=$(ls -d "$work"/transformer_engine_torch-*/)
build="$work/build"
if ! (cd "$source_dir" && NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      python3 -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir --target "$build" . \
      >"$work/build.log" 2>&1); then
  tail -40 "$work/build.log"; exit 1
fi
cp -r "$build"/* "$site"/
python3 -c "import transformer_engine.pytorch" && echo "transformer_engine.pytorch imports from $site"

#!/usr/bin/env bash
# Build TE's PyTorch extension (C++ only; it fits exactly one torch, TE and Python) into the wheel
# cache's folder for its key, for scripts/te-bundle.sh --build-torch-ext. Needs nvcc 13
# ($CUDA_HOME, default /usr/local/cuda) and python3.12 ($TE_BUILD_PYTHON) for a private virtual
# environment $TE_BUILD_VENV (default /tmp/te-build-venv) with torch==$TE_TORCH_VERSION (default
# 2.11.0) and its CUDA wheels (about 3 GB); about 25 CPU-minutes. The wheel replaces the key's
# cached one only when the build succeeds; a failed build exits 1, so no stale wheel is bundled
# in its place. Prints the key on its last line.
# Usage: bash scripts/te-ext-build.sh TRANSFORMER_ENGINE_TORCH_SOURCE.tar.gz
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: bash scripts/te-ext-build.sh TRANSFORMER_ENGINE_TORCH_SOURCE.tar.gz" >&2; exit 2; }
source_archive=$1
te_version=${TE_VERSION:-2.20.2}
torch_version=${TE_TORCH_VERSION:-2.11.0}
cuda_home=${CUDA_HOME:-/usr/local/cuda}
venv=${TE_BUILD_VENV:-/tmp/te-build-venv}
cache_root=${TE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cpkit/te-wheels}
[ -x "$cuda_home/bin/nvcc" ] || { echo "te-ext-build: no nvcc in $cuda_home/bin; fix: set CUDA_HOME to a CUDA 13 toolkit" >&2; exit 2; }
[ -x "$venv/bin/python" ] || "${TE_BUILD_PYTHON:-python3.12}" -m venv "$venv"
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  "$venv/bin/python" -m pip install -q "torch==$torch_version" setuptools wheel packaging ninja pybind11
fi
key=$("$venv/bin/python" -c "import sys, torch; v = sys.version_info
print(f'torch{torch.__version__}-te$te_version-cp{v[0]}{v[1]}'.replace('+', '_'))")
nv=$("$venv/bin/python" -c "import nvidia; print(list(nvidia.__path__)[0])")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ext" "$work/wheel"
tar xzf "$source_archive" -C "$work/ext"
echo "building TE's PyTorch extension for $key (about 25 CPU-minutes: 2 minutes on 16 cores)" >&2
start=$SECONDS
# The toolkit's headers first (nvcc's crt/), then the CUDA wheels' (cuBLAS, cuDNN, NCCL), which
# torch's CUDA headers include and a bare nvcc install lacks.
if ! (cd "$work"/ext/transformer_engine_torch-*/ && CUDA_HOME=$cuda_home PATH=$cuda_home/bin:$PATH \
      CPATH=$nv/cu13/include:$nv/cudnn/include:$nv/nccl/include NVTE_PYTORCH_FORCE_BUILD=TRUE \
      MAX_JOBS=${MAX_JOBS:-$(nproc)} "$venv/bin/python" -m pip wheel --no-build-isolation --no-deps --no-index \
      -w "$work/wheel" . >"$work/build.log" 2>&1) || ! ls "$work"/wheel/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  tail -30 "$work/build.log" >&2
  echo "te-ext-build: the extension for $key did not build (log above); nothing was bundled or cached for it" >&2
  exit 1
fi
mkdir -p "$cache_root/$key" && rm -f "$cache_root/$key"/*.whl
cp "$work"/wheel/transformer_engine_torch-*.whl "$cache_root/$key/"
echo "built $key in $((SECONDS - start)) s" >&2
echo "$key"

# Sourced by scripts/gpu-suites.sh and scripts/gpu-bench.sh: the environment of a GPU machine
# without network (see README "GPU machines").
# - NVLink multicast off (the lent machines do not support it).
# - MCore from the wheel carried in .whl/ when it is not importable yet; likewise the cuDNN
#   frontend (cpkit[kernels]) when its wheel is there.
# - Transformer Engine loads cuDNN itself; left alone it found the system's cuDNN 9.14 while
#   torch had loaded its own 9.19, and failed with "libcudnn_cnn.so.9: undefined symbol"
#   (or disabled its fused attention, leaving no CP backend). CUDNN_PATH points it at torch's,
#   and LD_LIBRARY_PATH the loader (TE's core library names cuDNN's sub-libraries itself).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Each install only when its wheel is carried, so that scripts under `set -e` can source this file.
# found MODULE: whether MODULE is installed, found without importing it (importing MCore imports
# torch: seconds on a fresh host, paid again by every script that sources this file).
found() { PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "$1" 2>/dev/null; }
if ls .whl/megatron_core-*.whl >/dev/null 2>&1 && ! found megatron.core; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
fi
# The cuDNN frontend (extra cpkit[kernels]) when its wheel is carried in .whl/ (scripts/kernels-wheel.sh).
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1 && ! found cudnn; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nvidia_cudnn_frontend-*.whl
fi
# Absolute: tests start pytest and ranks in other working directories.
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${CUDNN_PATH:-}" ]; then
  cudnn=$(python3 -c "import importlib.util; print(list(importlib.util.find_spec('nvidia.cudnn').submodule_search_locations)[0])" 2>/dev/null) && export CUDNN_PATH=$cudnn
fi
if [ -n "${CUDNN_PATH:-}" ] && [ -d "$CUDNN_PATH/lib" ]; then
  export LD_LIBRARY_PATH=$CUDNN_PATH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

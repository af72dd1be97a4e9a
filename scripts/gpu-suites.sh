#!/usr/bin/env bash
# Run the gpu2 + gpu4 suites (and optionally benchmarks) on a GPU machine without network.
# Expects the MCore wheel in .whl/ (see README "GPU machines"); TE, if wanted, already installed
# into /tmp/site by ../shared/gpu/te-install.sh. Logs go to ${OUT:-gpu-results}/.
# Usage: bash scripts/gpu-suites.sh [pytest marker expression] [extra pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
source scripts/gpu-env.sh
markers=${1:-gpu2 or gpu4}; shift || true
python3 - <<'PY' | tee "$out/env.txt"
import torch, megatron.core as m
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("megatron-core", m.__version__)
try:
    import transformer_engine as te; print("transformer-engine", te.__version__)
except Exception as e:
    print("transformer-engine: not importable:", type(e).__name__)
PY
python3 -m pytest -m "$markers" -p no:cacheprovider -q -rfEs \
  --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log" | tail -60
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The README's test command on a GPU machine without network: every tier in one pytest run (unit
# and dist on CPU, gpu1/gpu2/gpu4 on the GPUs present; what cannot run skips with its reason).
# Expects the MCore wheel in .whl/ (see README "GPU machines"); Transformer Engine, if wanted,
# already installed into /tmp/site by scripts/te-install.sh. Logs go to ${OUT:-gpu-results}/: env.txt, junit.xml, pytest.log.
# Usage: bash scripts/gpu-suites.sh [pytest args...]   e.g. -m "gpu2 or gpu4" functional/test_te_backend.py
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
source scripts/gpu-env.sh
python3 - <<'PY' | tee "$out/env.txt"
import os, torch, megatron.core as m
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "cpus", os.cpu_count())
print("megatron-core", m.__version__)
try:
    import transformer_engine as te; print("transformer-engine", te.__version__)
except Exception as e:
    print("transformer-engine: not importable:", type(e).__name__)
PY
start=$(date +%s)
python3 -m pytest -p no:cacheprovider -q -rfEs --durations=25 --junitxml="$out/junit.xml" "$@" 2>&1 \
  | tee "$out/pytest.log" | tail -60
rc=${PIPESTATUS[0]}
echo "wall time: $(( $(date +%s) - start )) s" | tee -a "$out/pytest.log"
exit "$rc"

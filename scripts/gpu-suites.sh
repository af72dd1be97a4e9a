#!/usr/bin/env bash
# The README's test command on a GPU machine without network: every tier in one pytest run (unit
# and dist on CPU, gpu1/gpu2/gpu4 on the GPUs present; what cannot run skips with its reason).
# Expects the MCore wheel in .whl/ (see README "GPU machines"); Transformer Engine, if wanted,
# already installed into /tmp/site by scripts/te-install.sh. Logs go to ${OUT:-gpu-results}/: env.txt, junit.xml, pytest.log.
# Usage: bash scripts/gpu-suites.sh [pytest args...]   e.g. -m "gpu2 or gpu4" functional/test_te_backend.py
#
# The whole GPU tier in one sitting, on any host with 2, 4 or more GPUs (gpu4 cases skip below 4):
#   bash scripts/gpu-suites.sh -m "gpu2 or gpu4" --ignore=functional/test_te_backend.py   # no TE
#   bash scripts/gpu-suites.sh -m "gpu2 or gpu4" functional/test_te_backend.py            # TE suite
# How it is fast (no flags needed; plain pytest does the same): every NCCL grid runs on a
# persistent rank pool (src/cpkit/harness/grid.py, src/cpkit/harness/rank_pool.py) started once per world size and
# GPU slice; at the session's first test all NCCL grids start in the background, two 2-GPU pools
# side by side on disjoint GPU pairs (four on 8 GPUs), then the 3- and 4-GPU pools; the NCCL
# examples run side by side under torchrun meanwhile. Budgets: functional/GPU_TIER.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)  # absolute: ranks run elsewhere
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
export CPKIT_CASE_TIMES="$out/case-times.jsonl"; rm -f "$CPKIT_CASE_TIMES"  # src/cpkit/harness/launch_times.py
start=$(date +%s)
python3 -m pytest -p no:cacheprovider -q -rfEs --durations=40 --junitxml="$out/junit.xml" "$@" 2>&1 \
  | tee "$out/pytest.log" | tail -60
rc=${PIPESTATUS[0]}
echo "wall time: $(( $(date +%s) - start )) s" | tee -a "$out/pytest.log"
# Where the time went: the slowest grids (wall = start-up + cases), cases and waits for GPUs.
[ -s "$CPKIT_CASE_TIMES" ] && python3 - "$CPKIT_CASE_TIMES" <<'PY' | tee "$out/case-times.txt"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
grids = sorted((r for r in rows if "wall_s" in r), key=lambda r: -r["wall_s"])
pools = [r for r in rows if r.get("pool")]
print("rank pools (backend, ranks, GPUs): starts, cases, start-up s")
for r in pools:
    print(f"  {r['backend']}{r['world_size']} {r['gpus'] or '-'}: {r['starts']}, {r['cases']}, {r['start_s']}")
print("grid (backend, ranks): wall s, cases s, overhead s (queueing behind other grids of its pool included)")
for r in grids[:25]:
    print(f"  {r['grid']} ({r['backend']}{r['world_size']}): {r['wall_s']}, {r['cases_s']}, {r['wall_s'] - r['cases_s']:.1f}")
print("slowest cases (s):")
for r in sorted((r for r in rows if "case" in r), key=lambda r: -r["seconds"])[:25]:
    print(f"  {r['seconds']:8.2f}  {r['backend']}{r['world_size']} {r['grid'].rsplit('.', 1)[0]} {r['case']}")
waits = [r for r in rows if "claim_wait_s" in r]
print(f"GPU claims: {len(waits)}, waited {sum(r['claim_wait_s'] for r in waits):.0f} s in all")
PY
exit "$rc"

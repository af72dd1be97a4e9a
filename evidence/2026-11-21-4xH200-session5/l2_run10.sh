#!/usr/bin/env bash
# Session 5, lease 2: eval_cp TP1 PP2 16K A/B of the eval changes, then the GPU tests they touch.
set -uo pipefail
out=${OUT:?}; mkdir -p "$out"
source scripts/gpu-env.sh
base=$PYTHONPATH
ev() { PYTHONPATH=$PWD/$2:$base timeout 90 python3 -m cpkit.bench eval_cp --layouts tp1pp2 --seq 16384 --out "$out/ab_$1.json" 2>&1 | grep "seq 16384" | sed "s/^/$1 /" | tee -a "$out/ab.txt"; }
ev main ab/main/src; ev v1 ab/v1/src; ev v3 src; ev v2 ab/v2/src; ev v3b src
timeout 230 python3 -m pytest -m "gpu2 or gpu4" -p no:cacheprovider -q -rfEs functional/test_eval_cp.py functional/test_attention.py \
  -k "(test_eval_cp and (pp2 or nccl2-cp1-to-cp2)) or (test_cp_attention_matches_full_attention and p2p-bf16 and not s8k)" \
  --junitxml="$out/junit.xml" 2>&1 | tail -8 | tee "$out/pytest.log"

#!/usr/bin/env bash
# Session 6: eval_cp TP1 PP2 16K A/B (base = 93b2440's src, new = the working tree, new with the
# ring of 2 unbatched), twice each, then the full eval_cp table on the new code.
set -uo pipefail
out=${OUT:?}; mkdir -p "$out"
source scripts/gpu-env.sh
base=$PYTHONPATH
ev() { local name=$1 tree=$2; shift 2
  env "$@" PYTHONPATH=$PWD/$tree:$base timeout 150 python3 -m cpkit.bench eval_cp --layouts tp1pp2 --seq 16384 \
    --out "$out/ab_$name.json" 2>&1 | grep -E "seq 16384|rror" | sed "s/^/$name /" | tee -a "$out/ab.txt"; }
ev base ab/base/src; ev new src; ev new_unbatched src CPKIT_P2P_BATCHED=0
ev base2 ab/base/src; ev new2 src; ev new_unbatched2 src CPKIT_P2P_BATCHED=0
timeout 240 python3 -m cpkit.bench eval_cp --out "$out/eval_cp.json" 2>&1 | grep -v -E "UserWarning|warnings.warn" | tail -12 | tee "$out/eval_cp.txt"

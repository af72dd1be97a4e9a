#!/usr/bin/env bash
# Session 5 GPU benches: eval_cp A/B (main vs branch) and attention cpkit vs TE (branch, main).
set -uo pipefail
out=${OUT:?}; mkdir -p "$out"
source scripts/gpu-env.sh
quiet() { grep -v -E "UserWarning|warnings.warn|_warn_once|return func|Guessing device ID"; }
base=$PYTHONPATH
echo "== eval A/B tp1pp2 16K: main" | tee -a "$out/ab.txt"
PYTHONPATH=$PWD/ab/main/src:$base timeout 150 python3 -m cpkit.bench eval_cp --layouts tp1pp2 --seq 16384 --out "$out/ab_eval_main.json" 2>&1 | quiet | tail -6 | tee -a "$out/ab.txt"
echo "== eval A/B tp1pp2 16K: branch" | tee -a "$out/ab.txt"
timeout 150 python3 -m cpkit.bench eval_cp --layouts tp1pp2 --seq 16384 --out "$out/ab_eval_branch.json" 2>&1 | quiet | tail -6 | tee -a "$out/ab.txt"
echo "== attention cp4 branch (cpkit, te)" | tee -a "$out/ab.txt"
timeout 240 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm p2p,a2a+p2p --backends cpkit,te --out "$out/att_branch.json" 2>&1 | quiet | tail -14 | tee -a "$out/ab.txt"
echo "== attention cp4 main (cpkit)" | tee -a "$out/ab.txt"
PYTHONPATH=$PWD/ab/main/src:$base timeout 150 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm p2p,a2a+p2p --backends cpkit --out "$out/att_main.json" 2>&1 | quiet | tail -10 | tee -a "$out/ab.txt"
echo "== eval full table + profile (branch)" | tee -a "$out/ab.txt"
OUT=$out/evalfull timeout 240 bash scripts/gpu-bench.sh eval_cp 2>&1 | tail -20 | tee -a "$out/ab.txt"

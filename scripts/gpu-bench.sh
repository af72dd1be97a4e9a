#!/usr/bin/env bash
# The benchmarks of the cards and README on a GPU machine without network (see README "GPU
# machines"): attention (every comm type at cp=4, p2p kv8 at cp=2, with TE where it imports, and
# p2p / a2a+p2p with CPKIT_P2P_BATCHED=0 and with NCCL_MIN_P2P_NCHANNELS=32) or
# eval_cp, with tables, JSON and profiles under ${OUT:-gpu-results}/.
# Usage: bash scripts/gpu-bench.sh attention|eval_cp
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
source scripts/gpu-env.sh
quiet() { grep -v -E "UserWarning|warnings.warn|_warn_once|return func|Guessing device ID"; }
rc=0
case "${1:-}" in
  attention)
    python3 -m cpkit.bench attention --cp 4 --seq 32K,64K,128K --kv-heads 8,32 --backends cpkit,te,torch,sdpa \
      --out "$out/attention_cp4.json" 2>&1 | quiet | tee "$out/attention_cp4.txt" || rc=1
    python3 -m cpkit.bench attention --cp 2 --seq 32K,64K,128K --kv-heads 8 --comm p2p --backends cpkit,te \
      --out "$out/attention_cp2.json" 2>&1 | quiet | tee "$out/attention_cp2.txt" || rc=1
    # A/B of the ring's P2P calls: separate isend/irecv (TE's choice at cp > 2) vs the batched default.
    CPKIT_P2P_BATCHED=0 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm p2p,a2a+p2p \
      --backends cpkit --out "$out/attention_unbatched.json" 2>&1 | quiet | tee "$out/attention_unbatched.txt" || rc=1
    # A/B of NCCL's P2P channels per peer pair (NVIDIA's CP training configs raise the minimum to 32).
    NCCL_MIN_P2P_NCHANNELS=32 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm p2p,a2a+p2p \
      --backends cpkit --out "$out/attention_p2p_channels.json" 2>&1 | quiet | tee "$out/attention_p2p_channels.txt" || rc=1
    python3 -m cpkit.bench attention --cp 4 --seq 32K --kv-heads 32 --comm p2p,all_gather --backends cpkit,te \
      --warmup 2 --iters 3 --out /tmp/attention_profiled.json --profile "$out/attention_profile.txt" 2>&1 | quiet | tail -4
    python3 -m cpkit.bench attention --cp 4 --seq 32K --kv-heads 8 --comm p2p,a2a,a2a+p2p --backends cpkit,te \
      --warmup 2 --iters 3 --out /tmp/attention_profiled_kv8.json --profile "$out/attention_profile_kv8.txt" 2>&1 | quiet | tail -4
    ;;
  eval_cp)
    python3 -m cpkit.bench eval_cp --out "$out/eval_cp.json" 2>&1 | quiet | tee "$out/eval_cp.txt" || rc=1
    python3 -m cpkit.bench eval_cp --layouts tp2pp1 --seq 8192 --warmup 2 --iters 3 --out /tmp/eval_profiled.json \
      --profile "$out/eval_cp_profile.txt" 2>&1 | quiet | tail -4
    ;;
  *) echo "usage: bash scripts/gpu-bench.sh attention|eval_cp" >&2; exit 2 ;;
esac
exit $rc

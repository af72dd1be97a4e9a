#!/usr/bin/env bash
# The benchmarks of the cards and README on a GPU machine without network (see README "GPU
# machines"), with tables, JSON, profiles, traces and their timelines under ${OUT:-gpu-results}/:
# - attention: cpkit against Transformer Engine at cp = the host's GPUs (2, or 4 from 4 up; every comm type, 32K and 128K, 8 KV
#   heads, with torch's CP and single-GPU SDPA), the table with its cpkit/TE and /sdpa ratios, in
#   at most ${ATTENTION_BUDGET_S:-300} s (the launch's timeout). TE comes from .te/te-bundle.tar.xz
#   through scripts/te-install.sh (quick when installed already); without TE it stops, since the
#   comparison is the point. Then the model features (sliding window causal and two-sided,
#   learnable sinks, MLA 192/128) for cpkit and TE at cp=4, 32K and 128K.
# - attention-full: the longer sweep (32K, 64K, 128K at 8 and 32 KV heads), A/Bs of the ring's
#   batching and of the a2a head chunks, p2p kv8 at cp=2, a profile of p2p / a2a / a2a+p2p at kv32.
# - attention-profile: cpkit and TE side by side at cp = the host's GPUs (2 or 4; ATTENTION_CP
#   overrides), kv8, 32K and 128K, every comm type,
#   profiled: kernel tables, traces and their timelines (compute / exposed comm / idle per cell).
# - eval_cp: the default model, a 4096-wide one at TP1 PP2, a profile of TP1 PP2 16K.
# - window: one rank's sliding-window compute (one GPU).
# - dynamic_step: on the host's GPUs (up to 4), real dynamic-CP training steps of every plan family (cpkit, static CP, MCore's,
#   Megatron-LM dev's from .upstream/) against the step model, on two model sizes: the default
#   (4 layers, hidden 4096, an 8B-class width: GPU-bound) and 8 layers at hidden 2048 (more
#   host-bound), ${DYNAMIC_STEP_ITERS:-10} timed steps per plan, each size within ${DYNAMIC_STEP_BUDGET_S:-300} s; tables, JSON and per-micro-batch
#   timelines under $OUT.
# - hybrid: a gated delta net layer at cp 2 against one GPU (fla's kernels where fla trains), the transition.
# - replay: the cost model against the replay of every implementation's plans on one GPU (its timing
#   targets, --strict: exit 1 on a miss; alone on the GPU, as timing wants).
# Usage: bash scripts/gpu-bench.sh attention|attention-full|attention-profile|eval_cp|window|dynamic_step|hybrid|replay
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
source scripts/gpu-env.sh
quiet() { grep -v -E "UserWarning|warnings.warn|_warn_once|return func|Guessing device ID"; }
# profiled NAME ARGS...: profile tables to $out/NAME_profile.txt, every rank's Chrome traces in one
# $out/NAME_traces.tgz (a device machine returns few files), their timeline to $out/NAME_timeline.txt.
profiled() {
  local name=$1; shift
  local dir; dir=$(mktemp -d)
  python3 -m cpkit.bench "$name" "$@" --out "$dir/$name.json" --profile "$dir/${name}_profile.txt" 2>&1 | quiet | tail -4
  cp "$dir/${name}_profile.txt" "$out/" 2>/dev/null
  python3 -m cpkit.bench.timeline --kernels "$dir"/*.trace.json > "$out/${name}_timeline.txt" 2>&1
  tar czf "$out/${name}_traces.tgz" -C "$dir" . 2>/dev/null
}
rc=0
case "${1:-}" in
  attention)
    if [ -f .te/te-bundle.tar.xz ]; then bash scripts/te-install.sh .te/te-bundle.tar.xz || exit 1; fi
    if ! python3 -c "import torch, transformer_engine.pytorch" 2>"$out/te_import.txt"; then
      tail -3 "$out/te_import.txt" >&2
      echo "Transformer Engine does not import: carry .te/te-bundle.tar.xz (scripts/te-bundle.sh) and rerun" >&2; exit 1
    fi
    # cp = the host's GPUs (2 on a 2-GPU host, 4 from 4 up; ATTENTION_CP overrides); ATTENTION_REPEATS
    # runs of both tables in this one call, then each cell's median cpkit/TE and its spread.
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    cp=${ATTENTION_CP:-$([ "$gpus" -ge 4 ] && echo 4 || echo 2)}
    for run in $(seq 1 "${ATTENTION_REPEATS:-1}"); do
      python3 -m cpkit.bench attention --cp "$cp" --seq 32K,128K --kv-heads 8 --backends cpkit,te,torch,sdpa \
        --timeout "${ATTENTION_BUDGET_S:-300}" --out "$out/attention_cp${cp}_run$run.json" 2>&1 | quiet \
        | tee "$out/attention_cp${cp}_run$run.txt" || rc=1
      # The model features against TE (a cell TE refuses shows TE's error).
      python3 -m cpkit.bench attention --cp "$cp" --seq 32K,128K --kv-heads 8 --backends cpkit,te \
        --features window,window2,sink,mla --timeout "${ATTENTION_BUDGET_S:-300}" \
        --out "$out/attention_features_cp${cp}_run$run.json" 2>&1 | quiet | tee "$out/attention_features_cp${cp}_run$run.txt" || rc=1
    done
    python3 -m cpkit.bench.attention.repeats "$out"/attention_cp"${cp}"_run*.json "$out"/attention_features_cp"${cp}"_run*.json \
      --out "$out/attention_cp${cp}_medians.json" 2>&1 | tee "$out/attention_cp${cp}_medians.txt" || rc=1
    ;;
  attention-full)
    python3 -m cpkit.bench attention --cp 4 --seq 32K,64K,128K --kv-heads 8,32 --backends cpkit,te,torch,sdpa \
      --out "$out/attention_cp4.json" 2>&1 | quiet | tee "$out/attention_cp4.txt" || rc=1
    # A/Bs of the defaults: the ring's one batched call per step at cp=4 (the default is separate
    # isend/irecv for rings of more than 2 ranks), and the all-to-alls without head chunks.
    CPKIT_P2P_BATCHED=1 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm p2p \
      --backends cpkit --out "$out/attention_batched.json" 2>&1 | quiet | tee "$out/attention_batched.txt" || rc=1
    CPKIT_A2A_CHUNKS=1 python3 -m cpkit.bench attention --cp 4 --seq 32K,128K --kv-heads 8,32 --comm a2a,a2a+p2p \
      --backends cpkit --out "$out/attention_a2a_unchunked.json" 2>&1 | quiet | tee "$out/attention_a2a_unchunked.txt" || rc=1
    python3 -m cpkit.bench attention --cp 2 --seq 32K,64K,128K --kv-heads 8 --comm p2p --backends cpkit,te \
      --out "$out/attention_cp2.json" 2>&1 | quiet | tee "$out/attention_cp2.txt" || rc=1
    profiled attention --cp 4 --seq 32K --kv-heads 32 --comm p2p,a2a,a2a+p2p --backends cpkit,te --warmup 2 --iters 3
    ;;
  attention-profile)
    if [ -f .te/te-bundle.tar.xz ]; then bash scripts/te-install.sh .te/te-bundle.tar.xz || exit 1; fi
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    profiled attention --cp "${ATTENTION_CP:-$([ "$gpus" -ge 4 ] && echo 4 || echo 2)}" --seq 32K,128K --kv-heads 8 \
      --backends cpkit,te --warmup 2 --iters 3 \
      --timeout "${ATTENTION_BUDGET_S:-300}"
    ;;
  eval_cp)
    python3 -m cpkit.bench eval_cp --out "$out/eval_cp.json" 2>&1 | quiet | tee "$out/eval_cp.txt" || rc=1
    # The default model (hidden 2048) is host-bound in the eval layout; a 4096-wide one (an 8B-class
    # width, 32/8 heads) shows the speedup where the GPU, not the host, sets the pace.
    python3 -m cpkit.bench eval_cp --layouts tp1pp2 --seq 8192,16384 --hidden 4096 --heads 32 --kv-heads 8 \
      --out "$out/eval_cp_h4096.json" 2>&1 | quiet | tee "$out/eval_cp_h4096.txt" || rc=1
    profiled eval_cp --layouts tp1pp2 --seq 16384 --warmup 2 --iters 3
    ;;
  hybrid)  # a gated delta net layer at cp 2 against one GPU, and the layout transition (2 GPUs)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .fla/*.whl 2>/dev/null || true
    python3 -m cpkit.bench hybrid --cp 2 --seq 32K,128K --out "$out/hybrid_cp2.json" 2>&1 | quiet | tee "$out/hybrid_cp2.txt" || rc=1
    ;;
  window)  # one GPU is enough: one rank's sliding-window compute (no communication)
    python3 -m cpkit.bench window --out "$out/window.json" 2>&1 | quiet | tee "$out/window.txt" || rc=1
    ;;
  dynamic_step)
    source scripts/upstream-unpack.sh
    budget=${DYNAMIC_STEP_BUDGET_S:-300}
    # 10 timed steps per plan (the bench's default is 6): a host-bound step moves by up to 15%
    # from one step to the next on 2x H200, and the median of 10 is the steadier
    iters=${DYNAMIC_STEP_ITERS:-10}
    # ranks: the host's GPUs up to 4 (DYNAMIC_STEP_RANKS overrides)
    ranks=${DYNAMIC_STEP_RANKS:-$(python3 -c "import torch; print(min(4, torch.cuda.device_count()))")}
    python3 -m cpkit.bench dynamic_step --ranks "$ranks" --budget-s "$budget" --iters "$iters" --out "$out/dynamic_step.json" 2>&1 | quiet \
      | tee "$out/dynamic_step.txt" || rc=1
    python3 -m cpkit.bench dynamic_step --ranks "$ranks" --budget-s "$budget" --iters "$iters" --hidden 2048 --ffn 7168 --heads 16 --kv-heads 4 \
      --layers 8 --out "$out/dynamic_step_h2048.json" 2>&1 | quiet | tee "$out/dynamic_step_h2048.txt" || rc=1
    ;;
  replay)
    python3 -m cpkit.bench replay --quick --sets mix,long --strict --out "$out/replay.json" 2>&1 | quiet \
      | tee "$out/replay.txt" || rc=1
    ;;
  *) echo "usage: bash scripts/gpu-bench.sh attention|attention-full|attention-profile|eval_cp|window|dynamic_step|hybrid|replay" >&2; exit 2 ;;
esac
exit $rc

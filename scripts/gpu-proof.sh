#!/usr/bin/env bash
# The GPU proof of a commit, and the GPU CI's one command, on a GPU host without network:
#   CPKIT_COMMIT=<commit> bash scripts/gpu-proof.sh [--optional PARTS] [--record] [--fail-over-budget] [pytest args]
# 1. set-up from the prepared files (scripts/gpu-ci-prepare.sh, scripts/GPU_CI.md), torch loaded
#    first: .whl/ through scripts/setup.sh's offline path (pip --no-index: cpkit[test], MCore) and
#    scripts/gpu-env.sh (MCore, the cuDNN frontend), Transformer Engine from .te/te-bundle.tar.xz
#    (scripts/te-install.sh, beside cpkit's set-up), flash-linear-attention from .fla/, the upstream code from .upstream/
#    (scripts/upstream-unpack.sh) as
#    CPKIT_MLM_SRC / CPKIT_BRIDGE_SRC;
# 2. two pytest processes side by side: the gpu1 tier (`-m gpu1`, functional/ and tests/) on
#    CPKIT_GPU1_WORKERS_PER_GPU (default 2) xdist workers per GPU, each worker pinned to one GPU
#    (cpkit.testing.gpu_per_worker), and
#    the multi-GPU tier, every gpu2 and gpu4 test of functional/ (`-m "gpu2 or gpu4"` on 4 or more
#    GPUs, `-m gpu2` on 2 or 3, none on 1), TE and the examples included; pytest args go to both.
#    Its tests that start their own ranks run in a third pytest, 3 side by side; on 2-3 GPUs each
#    2-rank launch needs the whole host, so they share the GPUs (CPKIT_GPU_SLOTS, default 3 there,
#    as the rank pools beside them do; src/cpkit/harness/gpu_claim.py);
#    GPU utilization sampled every second; one compile cache for all of them and for the next proof
#    on this machine (CPKIT_COMPILE_CACHE, default ~/.cache/cpkit/compile). The deadline CPKIT_PROOF_TIMEOUT_S (default 540) sends
#    each pytest SIGINT (it still writes its summary and junit), and SIGKILL CPKIT_PROOF_GRACE_S
#    (default 30) later;
# 3. the evidence folder $OUT/evidence/<date>-<n>x<GPU>-<commit>/ (env.txt, junit-gpu1.xml and
#    pytest-gpu1.log of the gpu1 tier, junit.xml and pytest.log of the multi-GPU tier,
#    case-times.jsonl, gpu-util.csv, README.md with counts per tier, stage walls, budgets and the
#    exit verdict), packed as $OUT/proof.tar.gz; with --record also copied into the checkout's
#    evidence/ and recorded into the cards (`cpkit cards record --evidence`); without it the
#    checkout is not written;
# 4. the exit (src/cpkit/validation/proof_report.py::verdict): 0 only when both tiers are green, no
#    pytest was cut by the deadline (its junit holds what ran before the cut: each pytest's exit
#    status goes to the report), and every required part ran: TE, the Megatron-LM and
#    Megatron-Bridge code, MCore, the cuDNN frontend, and no test skipped for a missing dependency
#    (a part the set-up lacks stops the proof before the tests, exit 1). `--optional te,upstream`
#    (or CPKIT_OPTIONAL) names parts that may be missing. Budgets are reported; an overrun fails the
#    exit only with --fail-over-budget (a loaded host runs slower without testing less).
# CPKIT_COMMIT names the commit where the tree is not a git checkout (a copy sent to a GPU host);
# the README also records the tree's fingerprint (`python -m cpkit.validation.proof_report --fingerprint .`),
# which names the same tree with or without git.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/gpu-proof.sh [--optional te,upstream,...] [--record] [--fail-over-budget] [pytest args]"
optional=${CPKIT_OPTIONAL:-} record=0 over_flag=()
while [ $# -gt 0 ]; do
  case "$1" in
    --optional) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; optional=$2; shift 2 ;;
    --optional=*) optional=${1#--optional=}; shift ;;
    --record) record=1; shift ;;
    --fail-over-budget) over_flag=(--fail-over-budget); shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) break ;;
  esac
done
per_gpu=${CPKIT_GPU1_WORKERS_PER_GPU:-2}
if ! [[ "$per_gpu" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu-proof: CPKIT_GPU1_WORKERS_PER_GPU=$per_gpu: must be a whole number of 1 or more (the gpu1 tier's" \
       "xdist workers per GPU); fix: CPKIT_GPU1_WORKERS_PER_GPU=2, or unset it" >&2
  exit 2
fi
# A misspelt part fails now, not after the run.
PYTHONPATH=$PWD/src python3 -c "import sys; from cpkit.validation.required_parts import parse_optional, RequiredPartsError
try: parse_optional(sys.argv[1], field='--optional')
except RequiredPartsError as e: sys.exit(f'gpu-proof: {e}')" "$optional" || exit 2
begin=$(date +%s.%N)
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }

# -- 1. set-up ----------------------------------------------------------------------------------
absent=()  # PART=WHY for each part the set-up lacks: the verdict fails on it unless it is optional
python3 -c "import torch" || { echo "gpu-proof: torch does not import; install the host's CUDA torch first"; exit 2; }
source scripts/gpu-env.sh
# TE installs into its own folder (/tmp/site) and needs only torch: beside cpkit's set-up, not after it.
te_pid=""
if [ -f .te/te-bundle.tar.xz ]; then
  ( TE_WHEEL_EXPORT=$out/te-export bash scripts/te-install.sh >"$out/te-install.log" 2>&1 ) &
  te_pid=$!
fi
if [ -d .whl ]; then
  PYTHON=python3 bash scripts/setup.sh >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; echo "gpu-proof: set-up from .whl/ failed"; exit 2; }
  tail -1 "$out/setup.log"
else
  echo "gpu-proof: no .whl/ (scripts/host-wheels.sh): the installed packages are used as they are"
fi
found megatron.core || absent+=("mcore=megatron-core is not installed (no .whl/ from scripts/host-wheels.sh?)")
found cudnn || absent+=("kernels=the cuDNN frontend is not installed (no .whl/nvidia_cudnn_frontend-*.whl?)")
if [ -n "$te_pid" ]; then
  wait "$te_pid" \
    || { absent+=("te=scripts/te-install.sh failed: $(grep -v '^ ' "$out/te-install.log" | tail -1)")
         echo "TE install failed:"; tail -20 "$out/te-install.log"; }
  grep "^te-install:" "$out/te-install.log"; tail -1 "$out/te-install.log"
  for wheel in "$out"/te-export/*/*.whl; do [ -f "$wheel" ] && mv "$wheel" "$out/"; done  # comes back: 1 level down
  rm -rf "$out/te-export"
else
  absent+=("te=no .te/te-bundle.tar.xz (scripts/te-bundle.sh)")
fi
# flash-linear-attention (the hybrid GDN's GPU kernels; pure Python over Triton) from .fla/
if ls .fla/*.whl >/dev/null 2>&1 && ! found fla; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .fla/*.whl
fi
found fla || absent+=("fla=no .fla/ wheels (fla-core, flash-linear-attention: scripts/GPU_CI.md)")
source scripts/upstream-unpack.sh
[ -n "${CPKIT_MLM_SRC:-}" ] || absent+=("mlm=no .upstream/mlm.tar.xz (scripts/upstream-pack.sh)")
[ -n "${CPKIT_BRIDGE_SRC:-}" ] || absent+=("bridge=no .upstream/bridge.tar.xz (scripts/upstream-pack.sh)")
setup_s=$(secs "$begin")
# A required part the set-up lacks fails the proof now, before minutes of GPU time on a tier that
# cannot pass; --optional PART runs without it.
absent_args=(); for item in "${absent[@]}"; do absent_args+=(--absent "$item"); done
if ! missing=$(PYTHONPATH=$PWD/src python3 -m cpkit.validation.required_parts --optional "$optional" "${absent_args[@]}"); then
  echo "gpu-proof: FAIL before the tests: the set-up lacks required parts (${setup_s} s):"; echo "$missing"
  exit 1
fi

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(0); m = re.search(r'[A-Z]\d{2,3}', n); print(m[0] if m else n.split()[-1])" 2>/dev/null || echo GPU)
# The multi-GPU tier beside gpu1: gpu2 + gpu4 on 4 or more GPUs, gpu2 on 2-3, none on 1.
if [ "$gpus" -ge 4 ]; then marker="gpu2 or gpu4"; elif [ "$gpus" -ge 2 ]; then marker=gpu2; elif [ "$gpus" -ge 1 ]; then marker=""; else
  echo "gpu-proof: this host has $gpus GPU(s); the proof needs 1 or more"; exit 2; fi
commit=${CPKIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
name=$(date -u +%Y-%m-%d)-${gpus}x${gpu}-${commit}
dir=$out/evidence/$name; mkdir -p "$dir"
python3 - <<'PY' | tee "$dir/env.txt"
import os, torch, megatron.core as m
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0), "cpus", os.cpu_count())
print("megatron-core", m.__version__)
try:
    import transformer_engine as te; print("transformer-engine", te.__version__)
except Exception as e:
    print("transformer-engine: not importable:", type(e).__name__)
try:
    import cudnn; print("cudnn-frontend", cudnn.__version__)
except Exception as e:
    print("cudnn-frontend: not importable:", type(e).__name__)
from cpkit.upstream.checkouts import checkout_identity  # a commit, or "content-<hash>" for a copy without .git
for name, var in (("Megatron-LM", "CPKIT_MLM_SRC"), ("Megatron-Bridge", "CPKIT_BRIDGE_SRC")):
    src = os.environ.get(var)
    print(name, src or "-", checkout_identity(src) if src else "")
PY
echo "set-up: ${setup_s} s" | tee -a "$dir/env.txt"

# -- 2. the tests: the gpu1 tier in the background, the multi-GPU tier beside it -----------------
export CPKIT_CASE_TIMES="$dir/case-times.jsonl"; rm -f "$CPKIT_CASE_TIMES"
# One compile cache for every process of the proof and every proof on this machine (a CI runner):
# inductor's FX graph and autograd caches and Triton's kernels, kept where /tmp cleaning does not
# reach them. The report counts, per case, the graphs whose kernels came from it.
cache=${CPKIT_COMPILE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cpkit/compile}
export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
echo "compile cache: $cache ($(du -sh "$cache" 2>/dev/null | cut -f1) before the tests)" | tee -a "$dir/env.txt"
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 >"$dir/gpu-util.csv" 2>/dev/null &
sampler=$!
deadline=(timeout -s INT -k "${CPKIT_PROOF_GRACE_S:-30}" "${CPKIT_PROOF_TIMEOUT_S:-540}")
# The slowest gpu1 test's file first (about 100 s on one H200): pytest collects in the order of
# its arguments, and worksteal hands the rest of that worker's queue to the others, so the test
# runs from the start instead of trailing the tier.
gpu1_paths=(functional/test_replay_gpu.py functional/test_*.py tests)
gpu1_wall=$(mktemp) gpu1_exit=$(mktemp)
# Two workers per GPU: the gpu1 tests are host-bound (compiles, small kernels; GPUs 15-20% busy
# at c0b3916), so one worker per GPU left the GPUs idle and made gpu1 the proof's longest stage.
gpu1_workers=$((gpus * per_gpu))
gpu1_visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus - 1)))}  # workers wrap round these ids
tests_begin=$(date +%s.%N)
( CUDA_VISIBLE_DEVICES=$gpu1_visible "${deadline[@]}" python3 -m pytest -n "$gpu1_workers" --dist worksteal -p cpkit.testing.gpu_per_worker -p no:cacheprovider \
    -q -rfEsx --durations=25 -m gpu1 --junitxml="$dir/junit-gpu1.xml" "${gpu1_paths[@]}" "$@" >"$dir/pytest-gpu1.log" 2>&1
  echo $? >"$gpu1_exit"; secs "$tests_begin" >"$gpu1_wall" ) &
gpu1_pid=$!
multi_s=0 exits=()  # each pytest's exit status: 124 is the deadline's cut (proof_report)
if [ -n "$marker" ]; then
  # The multi-GPU tests that start their own ranks (no pool: neither a grid nor a prefetched
  # example) in a pytest of their own, 3 side by side (proof_report.LAUNCHES says why).
  # One after another these held the tier's wall on 2 GPUs (claims waited 320 s in all at
  # c0b3916), each 2-rank launch claiming the whole host: there they share it, 3 at a time.
  slots=${CPKIT_GPU_SLOTS:-$([ "$gpus" -lt 4 ] && echo 3 || echo 1)}
  ( CPKIT_GPU_SLOTS=$slots "${deadline[@]}" python3 -m pytest -n 3 -p no:cacheprovider -q -rfEsx --durations=25 \
      -m "($marker) and not cpkit_grid and not cpkit_prefetch" --junitxml="$dir/junit-launch.xml" functional "$@" \
      >"$dir/pytest-launch.log" 2>&1 ) &
  launch_pid=$!
  "${deadline[@]}" python3 -m pytest -n 0 -p no:cacheprovider -q -rfEsx --durations=25 \
    -m "($marker) and (cpkit_grid or cpkit_prefetch)" --junitxml="$dir/junit.xml" functional "$@" 2>&1 \
    | tee "$dir/pytest.log" | tail -40
  exits+=(--pools-exit "${PIPESTATUS[0]}")
  wait "$launch_pid"; exits+=(--launches-exit $?)
  echo "-- the $marker tests that start their own ranks ($dir/pytest-launch.log):"; tail -15 "$dir/pytest-launch.log"
  multi_s=$(secs "$tests_begin")
fi
wait "$gpu1_pid"
echo "-- the gpu1 tier ($dir/pytest-gpu1.log):"; tail -25 "$dir/pytest-gpu1.log"
gpu1_s=$(cat "$gpu1_wall"); exits+=(--gpu1-exit "$(cat "$gpu1_exit")"); rm -f "$gpu1_wall" "$gpu1_exit"
pytest_s=$(secs "$tests_begin")
kill "$sampler" 2>/dev/null

# -- 3. evidence, budgets, the verdict; the cards only with --record -----------------------------
total_s=$(secs "$begin")
python3 -m cpkit.validation.proof_report "$dir" --gpus "$gpus" --gpu1-workers "$gpu1_workers" --setup-s "$setup_s" --pytest-s "$pytest_s" \
  --gpu1-s "${gpu1_s:-0}" --multi-gpu-s "$multi_s" --total-s "$total_s" --marker "$marker" \
  --machine "${gpus}x $gpu" --commit "$commit" \
  --optional "$optional" "${absent_args[@]}" "${over_flag[@]}" "${exits[@]}" \
  --command "CPKIT_COMMIT=$commit bash scripts/gpu-proof.sh${optional:+ --optional $optional} $*"
verdict=$?
if [ "$record" = 1 ]; then
  rm -rf "evidence/$name" && cp -r "$dir" "evidence/$name"
  python3 -c "import sys; from cpkit.cli import main; sys.exit(main())" cards record --evidence "evidence/$name" --machine "${gpus}x $gpu" 2>&1 | tail -5
fi
gzip -f "$dir/case-times.jsonl" "$dir/pytest.log" "$dir/junit.xml" "$dir/pytest-launch.log" "$dir/junit-launch.xml" "$dir/pytest-gpu1.log" "$dir/junit-gpu1.xml" \
  "$dir/gpu-util.csv" 2>/dev/null
tar czf "$out/proof.tar.gz" -C "$out/evidence" "$name" && rm -rf "$out/evidence"
exit "$verdict"

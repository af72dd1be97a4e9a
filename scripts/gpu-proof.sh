#!/usr/bin/env bash
# The GPU proof of a commit, in one command, on a GPU host without network:
#   CPKIT_COMMIT=<commit> bash scripts/gpu-proof.sh [extra pytest args]
# 1. set-up, skipping what is there: the MCore and cuDNN-frontend wheels from .whl/
#    (scripts/gpu-env.sh), Transformer Engine from .te/te-bundle.tar.xz (scripts/te-install.sh),
#    the upstream checkouts from .upstream/ (scripts/upstream-pack.sh: Megatron-LM dev and
#    Megatron-Bridge as archives with their commits) as CPKIT_MLM_SRC / CPKIT_BRIDGE_SRC;
# 2. every gpu2 and gpu4 test of functional/ in one pytest process (`-m "gpu2 or gpu4"` on 4 or
#    more GPUs, `-m gpu2` on 2 or 3): the rank-pool grids of every world size side by side, the
#    TE suite through the same pools, the examples under torchrun beside them; GPU utilization
#    sampled every second;
# 3. the evidence folder evidence/<date>-<n>x<GPU>-<commit>/ (env.txt, junit.xml, case-times.jsonl,
#    gpu-util.csv, pytest.log, README.md with counts, stage walls and budgets), recorded into the
#    cards (`cpkit cards record --evidence`), and a copy as $OUT/proof.tar.gz;
# 4. each budget with its verdict (src/cpkit/validation/proof_report.py::BUDGETS); exit 0 only when the run is
#    green and within every budget.
# CPKIT_COMMIT names the commit where the tree is not a git checkout (a copy sent to a GPU host);
# the README also records the tree's fingerprint (`python -m cpkit.validation.proof_report --fingerprint .`),
# which names the same tree with or without git. CPKIT_PROOF_TIMEOUT_S (default 540) bounds pytest:
# on expiry it gets SIGINT and still writes its summary and junit.
set -uo pipefail
cd "$(dirname "$0")/.."
begin=$(date +%s.%N)
out=${OUT:-gpu-results}; mkdir -p "$out"; out=$(cd "$out" && pwd)
secs() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }

# -- 1. set-up ----------------------------------------------------------------------------------
source scripts/gpu-env.sh
if [ -f .te/te-bundle.tar.xz ]; then
  TE_WHEEL_EXPORT=$out/te-export bash scripts/te-install.sh >"$out/te-install.log" 2>&1 \
    || { echo "TE install failed (the TE tests will skip):"; tail -20 "$out/te-install.log"; }
  grep "^te-install:" "$out/te-install.log"; tail -1 "$out/te-install.log"
  for wheel in "$out"/te-export/*/*.whl; do [ -f "$wheel" ] && mv "$wheel" "$out/"; done  # comes back: 1 level down
  rm -rf "$out/te-export"
fi
source scripts/upstream-unpack.sh
setup_s=$(secs "$begin")

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
gpu=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(0); m = re.search(r'[A-Z]\d{2,3}', n); print(m[0] if m else n.split()[-1])" 2>/dev/null || echo GPU)
if [ "$gpus" -ge 4 ]; then marker="gpu2 or gpu4"; elif [ "$gpus" -ge 2 ]; then marker=gpu2; else
  echo "gpu-proof: this host has $gpus GPU(s); the proof needs 2 or more"; exit 2; fi
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

# -- 2. the tests -------------------------------------------------------------------------------
export CPKIT_CASE_TIMES="$dir/case-times.jsonl"; rm -f "$CPKIT_CASE_TIMES"
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits -l 1 >"$dir/gpu-util.csv" 2>/dev/null &
sampler=$!
tests_begin=$(date +%s.%N)
timeout -s INT "${CPKIT_PROOF_TIMEOUT_S:-540}" python3 -m pytest -n 0 -p no:cacheprovider -q -rfEsx --durations=25 \
  -m "$marker" --junitxml="$dir/junit.xml" functional "$@" 2>&1 | tee "$dir/pytest.log" | tail -40
pytest_s=$(secs "$tests_begin")
kill "$sampler" 2>/dev/null

# -- 3. evidence, cards, budgets ----------------------------------------------------------------
total_s=$(secs "$begin")
python3 -m cpkit.validation.proof_report "$dir" --gpus "$gpus" --setup-s "$setup_s" --pytest-s "$pytest_s" \
  --total-s "$total_s" --marker "$marker" --machine "${gpus}x $gpu" --commit "$commit" \
  --command "CPKIT_COMMIT=$commit bash scripts/gpu-proof.sh $*"
verdict=$?
rm -rf "evidence/$name" && cp -r "$dir" "evidence/$name"
python3 -c "import sys; from cpkit.cli import main; sys.exit(main())" cards record --evidence "evidence/$name" --machine "${gpus}x $gpu" 2>&1 | tail -5
gzip -f "$dir/case-times.jsonl" "$dir/pytest.log" "$dir/junit.xml" "$dir/gpu-util.csv" 2>/dev/null
tar czf "$out/proof.tar.gz" -C "$out/evidence" "$name" && rm -rf "$out/evidence"
exit "$verdict"

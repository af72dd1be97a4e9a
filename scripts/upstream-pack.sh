#!/usr/bin/env bash
# Pack the upstream checkouts that the GPU proof (scripts/gpu-proof.sh) holds to cpkit's tests,
# for a GPU host without network: Megatron-LM's megatron/ (its dev branch has dynamic CP) and
# Megatron-Bridge's src/, each as .upstream/<name>.tar.xz (about 1.6 and 1.0 MB) with its commit
# in .upstream/<name>.commit (git ignores .upstream/; carry it). gpu-proof.sh unpacks them into
# /tmp/upstream with .git/HEAD naming that commit, so the reports name the upstream version.
# Usage: bash scripts/upstream-pack.sh MEGATRON_LM_CHECKOUT MEGATRON_BRIDGE_CHECKOUT [MLM_REF] [BRIDGE_REF]
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: bash scripts/upstream-pack.sh MEGATRON_LM_CHECKOUT MEGATRON_BRIDGE_CHECKOUT [MLM_REF=dev] [BRIDGE_REF=HEAD]" >&2; exit 2; }
mlm=$(cd "$1" && pwd) bridge=$(cd "$2" && pwd)
cd "$(dirname "$0")/.."
mkdir -p .upstream
pack() {  # pack CHECKOUT REF PATH PREFIX NAME
  (cd "$1" && git archive --prefix="$4/" "$2" "$3") | xz -9 -T0 > ".upstream/$5.tar.xz"
  git -C "$1" rev-parse "$2" > ".upstream/$5.commit"
  echo ".upstream/$5.tar.xz: $(stat -c %s ".upstream/$5.tar.xz") bytes, commit $(cat ".upstream/$5.commit")"
}
pack "$mlm" "${3:-dev}" megatron megatron-lm mlm
pack "$bridge" "${4:-HEAD}" src megatron-bridge bridge

#!/usr/bin/env bash
# Pack the upstream code that the GPU proof (scripts/gpu-proof.sh) holds to cpkit's tests, for a
# GPU host without network, at the commits of scripts/upstream-pins.txt (Megatron-LM dev's
# megatron/, Megatron-Bridge's src/): .upstream/<name>.tar.xz (about 1.6 and 1.0 MB) and its
# commit in .upstream/<name>.commit (git ignores .upstream/; carry it). A checkout given on the
# command line is used when it has the pinned commit (fetched into it when missing); without one,
# the repository is cloned (blobless) into ${UPSTREAM_CACHE:-~/.cache/cpkit/upstream}/<name>.
# A failure leaves the previous archive in place and exits non-zero.
# Usage: bash scripts/upstream-pack.sh [MEGATRON_LM_CHECKOUT MEGATRON_BRIDGE_CHECKOUT]
#        (UPSTREAM_PINS=FILE reads another pins file; UPSTREAM_URL=https://github.com the host)
set -euo pipefail
[ $# -eq 0 ] || [ $# -eq 2 ] || { echo "usage: bash scripts/upstream-pack.sh [MEGATRON_LM_CHECKOUT MEGATRON_BRIDGE_CHECKOUT]" >&2; exit 2; }
declare -A given=()
[ $# -eq 2 ] && given=([mlm]=$(cd "$1" && pwd) [bridge]=$(cd "$2" && pwd))
cd "$(dirname "$0")/.."
pins=${UPSTREAM_PINS:-scripts/upstream-pins.txt}
cache=${UPSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cpkit/upstream}
mkdir -p .upstream
# checkout NAME REPO COMMIT: a git checkout that holds COMMIT (printed).
checkout() {
  local dir=${given[$1]:-$cache/$1}
  if [ ! -d "$dir/.git" ] && [ -z "${given[$1]:-}" ]; then
    git clone -q --filter=blob:none --no-checkout "${UPSTREAM_URL:-https://github.com}/$2" "$dir" >&2
  fi
  git -C "$dir" cat-file -e "$3^{commit}" 2>/dev/null || git -C "$dir" fetch -q origin "$3" >&2 \
    || { echo "upstream-pack: $dir has no commit $3 and cannot fetch it ($pins: $1)" >&2; return 1; }
  echo "$dir"
}
# pack NAME DIR COMMIT PATH: DIR's PATH at COMMIT as .upstream/NAME.tar.xz, written whole or not at all.
pack() {
  local prefix=$([ "$1" = mlm ] && echo megatron-lm || echo megatron-bridge) tmp=.upstream/$1.tar.xz.part
  (cd "$2" && git archive --prefix="$prefix/" "$3" "$4") | xz -9 -T0 > "$tmp" || { rm -f "$tmp"; return 1; }
  mv "$tmp" ".upstream/$1.tar.xz"
  git -C "$2" rev-parse "$3^{commit}" > ".upstream/$1.commit"
  echo ".upstream/$1.tar.xz: $(stat -c %s ".upstream/$1.tar.xz") bytes, commit $(cat ".upstream/$1.commit")"
}
while read -r name repo branch commit path; do
  case "$name" in ''|'#'*) continue ;; esac
  case "$name" in mlm|bridge) ;; *) echo "upstream-pack: $pins: name '$name' must be mlm or bridge" >&2; exit 2 ;; esac
  [[ "$commit" =~ ^[0-9a-f]{40}$ ]] || { echo "upstream-pack: $pins: $name's commit '$commit' must be 40 hex digits (git rev-parse $branch)" >&2; exit 2; }
  dir=$(checkout "$name" "$repo" "$commit")
  pack "$name" "$dir" "$commit" "$path"
done < "$pins"

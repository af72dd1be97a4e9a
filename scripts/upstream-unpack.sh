# Sourced by scripts/gpu-proof.sh and scripts/gpu-bench.sh: the upstream code carried in
# .upstream/ (scripts/upstream-pack.sh: Megatron-LM dev and Megatron-Bridge at the commits of
# scripts/upstream-pins.txt) unpacked into ${UPSTREAM_ROOT:-/tmp/upstream}, .git/HEAD naming
# their commit, and exported as CPKIT_MLM_SRC / CPKIT_BRIDGE_SRC; an archive that is not carried
# leaves its variable unset. A tree is unpacked again whenever its archive changed (its sha256 is
# kept beside the tree), so the tree is always the archive's and the report names its commit.
# unpack NAME DIR: .upstream/NAME.tar.xz into $UPSTREAM_ROOT/DIR.
unpack() {
  local name=$1 archive=.upstream/$1.tar.xz root=${UPSTREAM_ROOT:-/tmp/upstream} sha
  [ -f "$archive" ] || return 1
  sha=$(sha256sum "$archive" | cut -d' ' -f1)
  if [ "$(cat "$root/$2.sha256" 2>/dev/null)" != "$sha" ]; then
    rm -rf "${root:?}/$2" "$root/$2.sha256" && mkdir -p "$root"
    tar xJf "$archive" -C "$root" || return 1
    echo "$sha" > "$root/$2.sha256"
  fi
  [ -f ".upstream/$name.commit" ] && mkdir -p "$root/$2/.git" && cp ".upstream/$name.commit" "$root/$2/.git/HEAD"
  return 0
}
unpack mlm megatron-lm && export CPKIT_MLM_SRC=${UPSTREAM_ROOT:-/tmp/upstream}/megatron-lm
unpack bridge megatron-bridge && export CPKIT_BRIDGE_SRC=${UPSTREAM_ROOT:-/tmp/upstream}/megatron-bridge/src
true

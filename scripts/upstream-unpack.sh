# Sourced by scripts/gpu-proof.sh and scripts/gpu-bench.sh: the upstream checkouts carried in
# .upstream/ (scripts/upstream-pack.sh: Megatron-LM dev and Megatron-Bridge as archives with their
# commits) unpacked into /tmp/upstream, .git/HEAD naming their commit, and exported as
# CPKIT_MLM_SRC / CPKIT_BRIDGE_SRC; an archive that is not carried leaves its variable unset.
# unpack NAME DIR: .upstream/NAME.tar.xz into /tmp/upstream/DIR (once per host).
unpack() {
  local name=$1 archive=.upstream/$1.tar.xz
  [ -f "$archive" ] || return 1
  mkdir -p /tmp/upstream
  [ -d "/tmp/upstream/$2" ] || tar xJf "$archive" -C /tmp/upstream
  [ -f ".upstream/$name.commit" ] && mkdir -p "/tmp/upstream/$2/.git" && cp ".upstream/$name.commit" "/tmp/upstream/$2/.git/HEAD"
}
unpack mlm megatron-lm && export CPKIT_MLM_SRC=/tmp/upstream/megatron-lm
unpack bridge megatron-bridge && export CPKIT_BRIDGE_SRC=/tmp/upstream/megatron-bridge/src
true

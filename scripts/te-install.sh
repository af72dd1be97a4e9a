#!/usr/bin/env bash
# Install the Transformer Engine bundle of scripts/te-bundle.sh (.te/te-bundle.tar.xz) on a GPU
# machine without network, into ${TE_SITE:-/tmp/site}, which scripts/gpu-env.sh puts first on
# PYTHONPATH. Offline (pip --no-index), idempotent, and skipping what is there already:
# - the same bundle installed and `import transformer_engine.pytorch` working: nothing to do;
# - a wheel whose distribution is in the site at the bundle's version is skipped (TE's core and
#   Python wheels share the transformer_engine/ folder, so they are installed together);
# - first, the bundle's record of what its prebuilt extension needs (glibc, torch, Python): a host
#   that lacks it, and has no nvcc to build one, stops here with the reason;
# - TE's PyTorch extension (C++ only; it fits exactly one torch, TE and Python, named by its key
#   torch<torch.__version__, + as _>-te<TE version>-cp<python>, e.g. torch2.11.0_cu130-te2.20.2-cp312):
#   installed from the bundle's prebuilt wheel for this machine's key, else from the wheel cache
#   ${TE_WHEEL_CACHE:-~/.cache/cpkit/te-wheels}/<key>/, else built from the bundle's source
#   (needs torch with CUDA 13, nvcc and ninja; 94 s on 16 cores) into that cache, so the next
#   install skips the build. A prebuilt wheel that does not import falls back to the build.
#   With TE_WHEEL_EXPORT=DIR, the wheel used is also copied to DIR/<key>/: put that folder into
#   the wheel cache of the machine that runs te-bundle.sh, and the next bundle carries it.
# Usage: bash scripts/te-install.sh [BUNDLE]   (default .te/te-bundle.tar.xz)
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-.te/te-bundle.tar.xz}
site=${TE_SITE:-/tmp/site}
export PIP_ROOT_USER_ACTION=ignore
cache_root=${TE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cpkit/te-wheels}
[ -f "$bundle" ] || { echo "no TE bundle at $bundle: run scripts/te-bundle.sh on a machine with network and carry .te/te-bundle.tar.xz here" >&2; exit 1; }
start=$SECONDS
last=$(date +%s.%N)
# lap NAME: the seconds since the previous lap, so a slow install shows which step costs what.
lap() { local now; now=$(date +%s.%N); python3 -c "import sys; print(f'te-install: {sys.argv[1]} {float(sys.argv[3]) - float(sys.argv[2]):.1f} s')" "$1" "$last" "$now"; last=$now; }
mkdir -p "$site"
source scripts/gpu-env.sh  # cuDNN and library paths TE needs to import; /tmp/site on PYTHONPATH
[ "$site" = /tmp/site ] || export PYTHONPATH=$site:$PYTHONPATH
# torch first: TE's library finds torch's NCCL (libnccl.so.2 of a pip torch) only once torch loaded it.
imports() { python3 -m cpkit.validation.te_ext_needs import-check 2>"$1"; }
stamp=$site/.te-bundle.sha256
sha=$(sha256sum "$bundle" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$sha" ] && imports /dev/null; then
  echo "TE from $bundle is installed in $site already (transformer_engine.pytorch imports)"; exit 0
fi
# The prebuilt extension's needs (glibc, torch, Python) first, before anything is installed;
# with nvcc here an unmet need only warns, as the extension is then built from source.
command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && can_build=(--can-build) || can_build=()
python3 -m cpkit.validation.te_ext_needs check "$bundle" "${can_build[@]}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xJf "$bundle" -C "$work"
lap "unpack the bundle"
b=$work/te-bundle
te_version=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['te_version'])" "$b/manifest.json")

# missing WHEEL...: those wheels whose distribution and version are not in the site.
missing() {
  python3 - "$site" "$@" <<'EOF'
import re, sys
from importlib.metadata import distributions
site, wheels = sys.argv[1], sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
have = {(norm(d.metadata["Name"]), d.version) for d in distributions(path=[site])}
for wheel in wheels:
    name, version = wheel.rsplit("/", 1)[-1].split("-")[:2]
    if (norm(name), version) not in have:
        print(wheel)
EOF
}
# install WHEEL...: into the site, replacing older copies of the same packages. A wheel without
# a .data/ folder is a zip of its site-packages layout and is unpacked directly (TE's core wheel
# holds a 343 MB library, mostly zeros after pruning: pip took most of a minute over these
# wheels, unpacking takes seconds); any other wheel goes through pip.
install() {
  python3 - "$site" "$@" <<'EOF'
import re, shutil, subprocess, sys, zipfile
from importlib.metadata import distributions
from pathlib import Path
site, wheels = Path(sys.argv[1]), sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
old = {norm(d.metadata["Name"]): d for d in distributions(path=[str(site)])}
by_pip = []
for wheel in wheels:
    name = norm(wheel.rsplit("/", 1)[-1].split("-")[0])
    with zipfile.ZipFile(wheel) as zf:
        if any(n.split("/", 1)[0].endswith(".data") for n in zf.namelist()):
            by_pip.append(wheel)
            continue
        if name in old:  # the older copy's files first, as pip's --upgrade does
            for f in old[name].files or []:
                (site / f).unlink(missing_ok=True)
        zf.extractall(site)
if by_pip:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *by_pip], check=False)
want = {norm(w.rsplit("/", 1)[-1].split("-")[0]): w.rsplit("/", 1)[-1].split("-")[1] for w in wheels}
have = {(norm(d.metadata["Name"]), d.version) for d in distributions(path=[str(site)])}
lost = [f"{n} {v}" for n, v in want.items() if (n, v) not in have]
sys.exit(f"the wheels {lost} did not install into {site}" if lost else 0)
EOF
}

te_pair=("$b"/wheels/transformer_engine-*.whl "$b"/wheels/transformer_engine_cu13-*.whl)
if [ -n "$(missing "${te_pair[@]}")" ]; then todo=("${te_pair[@]}"); else todo=(); fi
for wheel in $(missing $(ls "$b"/wheels/*.whl | grep -v -E "/transformer_engine(_cu13)?-")); do todo+=("$wheel"); done
if [ ${#todo[@]} -gt 0 ]; then
  echo "installing ${#todo[@]} wheels into $site: $(for w in "${todo[@]}"; do basename "$w"; done | tr '\n' ' ')"
  install "${todo[@]}"
else
  echo "TE $te_version and its dependencies are in $site already"
fi
lap "TE and dependency wheels"

key=$(python3 -c "import sys, torch; v = sys.version_info; print(f'torch{torch.__version__}-te$te_version-cp{v[0]}{v[1]}'.replace('+', '_'))" 2>/dev/null)
cache=$cache_root/$key
# use_ext WHEEL: unpack the extension into the site (merged: it replaces no folder of TE's),
# record its key; fails when transformer_engine.pytorch does not import with it.
use_ext() {
  install "$1" && echo "$key" > "$site/.te-torch-ext-key" && imports "$work/import.log"
}
first() { ls "$1"/transformer_engine_torch-*.whl 2>/dev/null | head -1; }
ext=
if [ "$(cat "$site/.te-torch-ext-key" 2>/dev/null)" = "$key" ] && imports "$work/import.log"; then
  echo "TE's PyTorch extension for $key is in $site already"
elif [ -n "$(first "$b/torch-ext/$key")" ] && use_ext "$(first "$b/torch-ext/$key")"; then
  ext=$(first "$b/torch-ext/$key"); echo "installed the bundle's prebuilt PyTorch extension for $key"
elif [ -n "$(first "$cache")" ] && use_ext "$(first "$cache")"; then
  ext=$(first "$cache"); echo "installed the PyTorch extension for $key from the wheel cache $cache"
else
  if [ -s "$work/import.log" ]; then echo "TE did not import with a prebuilt extension:"; tail -3 "$work/import.log"; fi
  echo "building TE's PyTorch extension for $key from the bundle's source (no prebuilt wheel that imports, in the bundle's torch-ext/$key/ or in $cache)"
  build_start=$SECONDS
  mkdir -p "$work/ext" "$work/wheel"
  tar xzf "$b"/src/transformer_engine_torch-*.tar.gz -C "$work/ext"
  if ! (cd "$work"/ext/transformer_engine_torch-*/ && NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        python3 -m pip wheel --no-build-isolation --no-deps --no-index --no-cache-dir -w "$work/wheel" . \
        >"$work/build.log" 2>&1); then
    tail -40 "$work/build.log"; exit 1
  fi
  ext=$(first "$work/wheel")
  echo "built $(basename "$ext") in $((SECONDS - build_start)) s"
  mkdir -p "$cache" && rm -f "$cache"/*.whl && cp "$ext" "$cache/" && echo "saved it in the wheel cache $cache"
  use_ext "$ext" || { cat "$work/import.log"; exit 1; }
fi
if [ -n "${TE_WHEEL_EXPORT:-}" ] && [ -n "$ext" ]; then
  mkdir -p "$TE_WHEEL_EXPORT/$key" && cp "$ext" "$TE_WHEEL_EXPORT/$key/" && echo "exported it to $TE_WHEEL_EXPORT/$key/"
fi
[ -n "$ext" ] || imports "$work/import.log" || { cat "$work/import.log"; exit 1; }  # use_ext imported it already
lap "PyTorch extension and the import check"
echo "$sha" > "$stamp"
echo "transformer_engine.pytorch imports from $site (TE $te_version, $key) after $((SECONDS - start)) s"

#!/usr/bin/env bash
# Bundle Transformer Engine for a GPU machine without network, in ONE file of about 30 MB
# (run on a machine with network: PyPI and, to prebuild the PyTorch extension, nvcc 13).
#
# Writes .te/te-bundle.tar.xz and .te/te-bundle.manifest.json (git ignores .te*/) holding, for
# Python 3.12 on x86-64 Linux:
# - wheels/: TE's core wheel transformer-engine-cu13==$TE_VERSION with libtransformer_engine.so
#   pruned to the GPU architectures of --arch (default sm_90: H100, H200) by
#   `python -m cpkit.tools.fatbin_prune` (343 MB -> a file that is mostly zeros), TE's Python
#   wheel, and what TE imports that torch does not bring (pydantic and its small dependencies,
#   nvdlfw-inspect, einops), all downloaded without dependencies at pinned versions;
# - src/: the transformer-engine-torch source archive (its PyTorch extension exists only as source);
# - torch-ext/<key>/: TE's PyTorch extension prebuilt into a wheel, key
#   torch<torch.__version__, + as _>-te<TE version>-cp312 (e.g. torch2.11.0_cu130-te2.20.2-cp312): C++ only, it
#   works only with exactly that torch, TE and Python, and saves the GPU machine its build (94 s
#   on 16 cores). Taken from the wheel cache $TE_WHEEL_CACHE (default ~/.cache/cpkit/te-wheels,
#   one folder per key), where scripts/te-install.sh saves the wheel it builds (copy it back from
#   a GPU machine with TE_WHEEL_EXPORT, see there). With --build-torch-ext it is built here
#   (scripts/te-ext-build.sh: nvcc 13, about 25 CPU-minutes) and only that wheel is bundled; a
#   failed build fails the bundle. Without a cached wheel the bundle holds none and te-install.sh
#   builds it.
# The manifest names every file with its version, size and sha256, the pruning's numbers, and
# each extension's needs (torch_ext_needs: glibc, torch, Python), which te-install.sh checks first.
#
# Usage: bash scripts/te-bundle.sh [--arch sm_90[,sm_100...]] [--build-torch-ext]
# Then carry .te/te-bundle.tar.xz to the GPU machine's checkout and run scripts/te-install.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
te_version=${TE_VERSION:-2.20.2}
torch_version=${TE_TORCH_VERSION:-2.11.0}
arch=sm_90 build_ext=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --arch=*) arch=${1#--arch=}; shift ;;
    --build-torch-ext) build_ext=1; shift ;;
    *) echo "usage: bash scripts/te-bundle.sh [--arch sm_90[,sm_100...]] [--build-torch-ext]" >&2; exit 2 ;;
  esac
done
# What TE imports beyond torch, pinned together (pydantic pins pydantic-core exactly).
deps=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 nvdlfw-inspect==0.2.2 einops==0.8.2)
start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
stage=$work/te-bundle
mkdir -p "$stage/wheels" "$stage/src" "$work/download"
for_gpu_host=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)
python3 -m pip download -q "${for_gpu_host[@]}" -d "$work/download" \
  "transformer-engine-cu13==$te_version" "transformer-engine==$te_version" "${deps[@]}" 2>&1 | grep -v "^WARNING: Location" || true
# The extension's source archive, found in the package index's simple API (what pip reads) and
# checked against its sha256: `pip download` of it would first install torch and its CUDA wheels
# (gigabytes) into a build environment, only to read the archive's metadata.
python3 - "$stage/src" transformer-engine-torch "$te_version" "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'EOF'
import hashlib, json, sys, urllib.request
folder, name, version, index = sys.argv[1:]
request = urllib.request.Request(f"{index.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(request, timeout=60) as response:
    files = [f for f in json.load(response)["files"] if f["filename"] == f"{name.replace('-', '_')}-{version}.tar.gz"]
if len(files) != 1:
    sys.exit(f"{index} lists {len(files)} source archives for {name}=={version}, expected 1")
with urllib.request.urlopen(files[0]["url"], timeout=300) as response:
    data = response.read()
if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
    sys.exit(f"{files[0]['filename']}: its sha256 differs from the index's")
open(f"{folder}/{files[0]['filename']}", "wb").write(data)
EOF
core=$(ls "$work"/download/transformer_engine_cu13-*.whl)
mv $(ls "$work"/download/*.whl | grep -v transformer_engine_cu13-) "$stage/wheels/"
echo "pruning $(basename "$core") to $arch ($(( $(stat -c %s "$core") / 1000000 )) MB wheel)"
PYTHONPATH=src python3 -m cpkit.tools.fatbin_prune "$core" -o "$stage/wheels/$(basename "$core")" --arch "$arch" \
  --json "$work/prune.json"

cache_root=${TE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cpkit/te-wheels}
keys=("$cache_root"/torch*-te"$te_version"-cp312)
ext_note="from the wheel cache $cache_root (not built now: --build-torch-ext builds it)"
if [ "$build_ext" = 1 ]; then
  # A failed build ends the bundle here (set -e): no stale cached wheel goes out in its place.
  key=$(TE_VERSION=$te_version TE_TORCH_VERSION=$torch_version TE_WHEEL_CACHE=$cache_root \
    bash scripts/te-ext-build.sh "$stage"/src/transformer_engine_torch-*.tar.gz | tail -1)
  keys=("$cache_root/$key") ext_note="prebuilt now, $key"
fi
# Every cached extension wheel for this TE on Python 3.12 (te-install.sh picks the host's key).
found=0
for dir in "${keys[@]}"; do
  ls "$dir"/transformer_engine_torch-*.whl >/dev/null 2>&1 || continue
  mkdir -p "$stage/torch-ext/${dir##*/}" && cp "$dir"/transformer_engine_torch-*.whl "$stage/torch-ext/${dir##*/}/"
  echo "PyTorch extension ${dir##*/}: $ext_note"; found=1
done
[ "$found" = 1 ] || ext_note="none: te-install.sh builds it on the GPU machine (no wheel in $cache_root/*-te$te_version-cp312/)"

PYTHONPATH=src python3 - "$stage" "$work/prune.json" "$arch" "$te_version" "$ext_note" <<'EOF'
import hashlib, json, sys, time
from pathlib import Path
from cpkit.validation.te_ext_needs import needs_of
stage, prune, arch, te_version, ext_note = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
# What each prebuilt extension needs of a host (glibc, torch, Python): te-install.sh checks it first.
needs = {d.name: needs_of(next(d.glob("*.whl")), d.name) for d in sorted((stage / "torch-ext").glob("*"))}
files = [{"path": str(p.relative_to(stage)), "size": p.stat().st_size,
          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
         for p in sorted(stage.rglob("*")) if p.is_file()]
manifest = {"te_version": te_version, "python": "3.12", "platform": "x86_64 Linux", "arch": arch,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch_ext": ext_note,
            "torch_ext_keys": sorted(needs), "torch_ext_needs": needs,
            "pruned": json.loads(prune.read_text()), "files": files}
(stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
EOF
mkdir -p .te
echo "compressing (xz -9)"
# manifest.json first, so that te-install.sh reads it without unpacking the rest.
(cd "$work" && tar cf - te-bundle/manifest.json $(cd "$work" && find te-bundle -type f ! -name manifest.json | sort) \
  | xz -9 -T"${XZ_THREADS:-0}" > "$work/te-bundle.tar.xz")
mv "$work/te-bundle.tar.xz" .te/te-bundle.tar.xz
cp "$stage/manifest.json" .te/te-bundle.manifest.json
sha256sum .te/te-bundle.tar.xz | cut -d' ' -f1 > .te/te-bundle.tar.xz.sha256
echo "wrote .te/te-bundle.tar.xz: $(stat -c %s .te/te-bundle.tar.xz) bytes, in $((SECONDS - start)) s"

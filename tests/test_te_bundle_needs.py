"""Transformer Engine for an offline GPU host: a failed extension build fails the bundle
(scripts/te-ext-build.sh), the bundle states what its prebuilt extension needs
(cpkit.validation.te_ext_needs), scripts/te-install.sh checks that first and stops with the
reason, and its import check loads torch before TE. Fake tools and modules, no GPU, no network."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from cpkit.validation import te_ext_needs

ROOT = Path(__file__).resolve().parents[1]
KEY = "torch2.11.0_cu130-te2.20.2-cp312"
PATH = f"{Path(sys.executable).parent}:/usr/bin:/bin"


def _ext_wheel(path: Path, *glibc: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("transformer_engine_torch.cpython-312-x86_64-linux-gnu.so",
                    b"\0".join(f"GLIBC_{v}".encode() for v in glibc) + b"\0")
    return path


def test_the_needs_name_the_newest_glibc_and_the_keys_torch(tmp_path):
    wheel = _ext_wheel(tmp_path / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl", "2.2.5", "2.38", "2.34")
    assert te_ext_needs.needs_of(wheel, KEY) == {"glibc": "2.38", "torch": "2.11.0+cu130", "python": "3.12"}


def test_a_host_with_an_older_glibc_or_another_torch_is_refused_with_the_fix():
    needs = {KEY: {"glibc": "2.38", "torch": "2.11.0+cu130", "python": "3.12"}}
    host = {"glibc": "2.36", "torch": "2.11.0+cu130", "python": "3.12"}
    (problem,) = te_ext_needs.unmet(needs, KEY, host)
    assert f"the bundle's TE extension for {KEY} needs glibc 2.38, this host has 2.36" in problem and "fix:" in problem
    assert te_ext_needs.unmet(needs, KEY, {**host, "glibc": "2.39"}) == []
    other = "torch2.12.0_cu130-te2.20.2-cp312"
    (problem,) = te_ext_needs.unmet(needs, other, {**host, "torch": "2.12.0+cu130"})
    assert "no prebuilt TE extension for this host's torch 2.12.0+cu130" in problem
    assert "TE_TORCH_VERSION=2.12.0" in problem


def _fake_modules(tmp_path: Path) -> Path:
    """torch 2.11.0+cu130, and a transformer_engine whose pytorch module fails as TE's does on a
    pip-torch host when torch is not loaded first."""
    mods = tmp_path / "mods"
    (mods / "torch").mkdir(parents=True)
    (mods / "torch" / "__init__.py").write_text("__version__ = '2.11.0+cu130'\n")
    (mods / "transformer_engine").mkdir()
    (mods / "transformer_engine" / "__init__.py").write_text("")
    (mods / "transformer_engine" / "pytorch.py").write_text(
        "import sys\nif 'torch' not in sys.modules:\n    raise ImportError('libnccl.so.2: cannot open shared object file')\n")
    return mods


def test_the_import_check_loads_torch_before_te(tmp_path):
    env = {"PATH": PATH, "PYTHONPATH": f"{_fake_modules(tmp_path)}:{ROOT / 'src'}"}
    proc = subprocess.run([sys.executable, "-m", "cpkit.validation.te_ext_needs", "import-check"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    direct = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert "libnccl.so.2" in direct.stderr  # the fake fails as TE does when torch comes second


def _bundle(path: Path, needs: dict) -> Path:
    manifest = json.dumps({"te_version": "2.20.2", "torch_ext_needs": needs}).encode()
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo("te-bundle/manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return path


def test_te_install_checks_the_needs_first_and_stops_naming_glibc(tmp_path):
    copy = tmp_path / "cpkit"
    (copy / "scripts").mkdir(parents=True)
    for name in ("te-install.sh", "gpu-env.sh"):
        shutil.copy(ROOT / "scripts" / name, copy / "scripts" / name)
    bundle = _bundle(tmp_path / "te-bundle.tar.xz", {KEY: {"glibc": "99.0", "torch": "2.11.0+cu130", "python": "3.12"}})
    env = {"PATH": PATH, "HOME": str(tmp_path), "TE_SITE": str(tmp_path / "site"), "CUDA_HOME": str(tmp_path / "no-cuda"),
           "PYTHONPATH": f"{_fake_modules(tmp_path)}:{ROOT / 'src'}"}
    proc = subprocess.run(["bash", "scripts/te-install.sh", str(bundle)], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=180)
    host_py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert proc.returncode == 1
    if host_py == "cp312":
        assert "needs glibc 99.0, this host has" in proc.stderr, proc.stderr
    else:
        assert "no prebuilt TE extension for this host's torch 2.11.0+cu130" in proc.stderr, proc.stderr
    assert not list((tmp_path / "site").glob("transformer_engine*"))  # stopped before installing anything


def _fake_build_tools(tmp_path: Path, build_ok: bool) -> dict:
    cuda = tmp_path / "cuda" / "bin"
    cuda.mkdir(parents=True)
    (cuda / "nvcc").write_text("#!/bin/sh\n")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    # The build venv's python: answers the version and key questions; `pip wheel` builds or fails.
    wheel = "touch \"$w/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl\"; exit 0" if build_ok else "echo 'nvcc fatal' >&2; exit 1"
    (venv / "python").write_text(f"""#!/bin/bash
case "$*" in
  *"pip wheel"*) while [ $# -gt 0 ]; do [ "$1" = -w ] && w=$2; shift; done; {wheel} ;;
  *"print(f'torch"*) echo {KEY} ;;
  *nvidia*) echo /tmp/nvidia ;;
  *) exit 0 ;;
esac
""")
    for tool in (cuda / "nvcc", venv / "python"):
        tool.chmod(0o755)
    source = tmp_path / "src.tar.gz"
    with tarfile.open(source, "w:gz") as tar:
        tar.add(tmp_path / "cuda", arcname="transformer_engine_torch-2.20.2")
    return {"PATH": PATH, "CUDA_HOME": str(tmp_path / "cuda"), "TE_BUILD_VENV": str(tmp_path / "venv"),
            "TE_WHEEL_CACHE": str(tmp_path / "cache"), "SOURCE": str(source)}


def _build(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "te-ext-build.sh"), env["SOURCE"]], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_failed_extension_build_exits_non_zero_so_no_stale_cached_wheel_is_bundled(tmp_path):
    env = _fake_build_tools(tmp_path, build_ok=False)
    stale = tmp_path / "cache" / KEY / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"
    stale.parent.mkdir(parents=True)
    stale.write_text("built elsewhere, on glibc 2.38")
    proc = _build(env)
    assert proc.returncode == 1 and "did not build" in proc.stderr and "nvcc fatal" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1:] != [KEY]  # te-bundle.sh reads the key from here: none
    bundle = (ROOT / "scripts" / "te-bundle.sh").read_text()
    assert 'keys=("$cache_root/$key")' in bundle  # with --build-torch-ext only the wheel just built is bundled


def test_a_successful_build_replaces_the_cached_wheel_and_prints_the_key(tmp_path):
    env = _fake_build_tools(tmp_path, build_ok=True)
    proc = _build(env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == KEY
    assert [p.name for p in (tmp_path / "cache" / KEY).iterdir()] == ["transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"]

"""The CPU half of the GPU CI (scripts/GPU_CI.md): scripts/setup.sh's offline path sets a fresh
virtual environment up from a .whl/ folder alone (pip --no-index; any index it reached would
fail), scripts/gpu-ci-prepare.sh fails when a step fails, and scripts/gpu-proof.sh refuses a
misspelt optional part before any set-up, runs the gpu1 tier beside the multi-GPU tier that fits
the host (a stand-in python3 says how many GPUs there are and answers pytest), two xdist workers
per GPU (cpkit.testing.gpu_per_worker), and its verdict covers both. Fake wheels, no GPU, no network."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = f"{Path(sys.executable).parent}:/usr/bin:/bin"
OFFLINE = {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_CACHE_DIR": "1"}


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: str = "") -> Path:
    """A pure-Python wheel of `files` (path -> text), with a valid RECORD."""
    info = f"{name}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name_in, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            zf.writestr(name_in, text)
    return path


#: An in-tree build backend (PEP 660), so the editable install needs no real setuptools: the
#: checkout's src/ goes onto sys.path through a .pth file.
BACKEND = '''
import base64, hashlib, os, zipfile
META = ("Metadata-Version: 2.1\\nName: cpkit\\nVersion: 0.0.1\\nRequires-Dist: tinydep\\n"
        "Provides-Extra: test\\nRequires-Dist: tinytest; extra == 'test'\\n")
def get_requires_for_build_editable(config_settings=None): return []
def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    files = {"cpkit.pth": os.path.abspath("src") + "\\n", "cpkit-0.0.1.dist-info/METADATA": META,
             "cpkit-0.0.1.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    rec = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t)}"
           for p, t in files.items()] + ["cpkit-0.0.1.dist-info/RECORD,,"]
    files["cpkit-0.0.1.dist-info/RECORD"] = "\\n".join(rec) + "\\n"
    name = "cpkit-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        for p, t in files.items(): zf.writestr(p, t)
    return name
'''


@pytest.mark.timeout(600)
def test_setup_sets_a_fresh_venv_up_offline_from_the_wheel_folder_alone(tmp_path):
    copy = tmp_path / "cpkit"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", copy / "scripts" / "setup.sh")
    (copy / "_backend").mkdir()
    (copy / "_backend" / "fakebackend.py").write_text(BACKEND)
    (copy / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "fakebackend"\n'
                                         'backend-path = ["_backend"]\n\n[project]\nname = "cpkit"\nversion = "0.0.1"\n')
    (copy / "src" / "cpkit").mkdir(parents=True)
    (copy / "src" / "cpkit" / "__init__.py").write_text("")
    (copy / "src" / "cpkit" / "notices.py").write_text("def quiet_known_notices():\n    pass\n")
    wheels = copy / ".whl"
    wheels.mkdir()
    _wheel(wheels, "megatron_core", "0.19.2", {"megatron/core/__init__.py": "__version__ = '0.19.2'\n"})
    _wheel(wheels, "setuptools", "80.9.0", {"setuptools/__init__.py": ""})
    _wheel(wheels, "tinydep", "1.0", {"tinydep.py": ""})
    _wheel(wheels, "tinytest", "1.0", {"tinytest.py": ""})
    host = tmp_path / "host-wheels"  # the host's own torch, which set-up keeps
    host.mkdir()
    _wheel(host, "torch", "2.11.0", {"torch/__init__.py": "__version__ = '2.11.0+cu130'\n"})
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    env = {"PATH": f"{venv / 'bin'}:{PATH}", "HOME": str(tmp_path), **OFFLINE}
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", str(next(host.glob("*.whl")))], check=True, env=env,
                   timeout=300)
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=copy, env={**env, "PYTHON": py}, capture_output=True,
                          text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "set-up: offline, from .whl/" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "cpkit ready: torch 2.11.0+cu130 | megatron-core 0.19.2"
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], env=env, capture_output=True, text=True).stdout
    assert {"cpkit==0.0.1", "tinydep==1.0", "tinytest==1.0", "megatron_core==0.19.2"} <= set(listed.split()) or \
        {"cpkit==0.0.1", "tinydep==1.0", "tinytest==1.0", "megatron-core==0.19.2"} <= set(listed.split()), listed


def test_setups_offline_branch_installs_only_with_no_index():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    offline = text[text.index("if [ -d .whl ]"):text.index("\nelse\n")]
    installs = [line for line in offline.splitlines() if "pip install" in line]
    assert len(installs) == 3 and all("--no-index" in line for line in installs), installs


def _prepare_copy(tmp_path: Path, failing: str) -> Path:
    copy = tmp_path / "cpkit"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu-ci-prepare.sh", copy / "scripts")
    for step, folder in (("host-wheels.sh", ".whl"), ("te-bundle.sh", ".te"), ("upstream-pack.sh", ".upstream"),
                         ("fla-wheels.sh", ".fla")):
        body = "exit 3" if step == failing else f'mkdir -p {folder} && echo "$0 $*" > {folder}/args'
        (copy / "scripts" / step).write_text(f"cd \"$(dirname \"$0\")/..\"\n{body}\n")
    return copy


@pytest.mark.parametrize("failing", ["host-wheels.sh", "te-bundle.sh", "upstream-pack.sh", "fla-wheels.sh"])
def test_prepare_fails_naming_the_step_that_failed(tmp_path, failing):
    proc = subprocess.run(["bash", "scripts/gpu-ci-prepare.sh"], cwd=_prepare_copy(tmp_path, failing),
                          env={"PATH": PATH}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"FAILED: bash scripts/{failing}" in proc.stderr and "(exit 3)" in proc.stderr


def test_prepare_builds_te_s_extension_and_packs_the_given_checkouts(tmp_path):
    copy = _prepare_copy(tmp_path, failing="")
    proc = subprocess.run(["bash", "scripts/gpu-ci-prepare.sh", "/mlm", "/bridge"], cwd=copy, env={"PATH": PATH},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (copy / ".te/args").read_text().split()[1:] == ["--build-torch-ext"]
    assert (copy / ".upstream/args").read_text().split()[1:] == ["/mlm", "/bridge"]
    assert (copy / ".fla/args").exists()


def test_the_proof_refuses_a_misspelt_optional_part_before_any_set_up(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-proof.sh"), "--optional", "te,upstrem"],
                          env={"PATH": PATH, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--optional=te,upstrem: 'upstrem' is not a part" in proc.stderr and "fix:" in proc.stderr
    assert not (tmp_path / "evidence").exists()



@pytest.fixture(scope="module")
def proof_copy(tmp_path_factory):
    """A copy of the tree without the carried files (.whl/, .te/, ...) or evidence."""
    return Path(shutil.copytree(ROOT, tmp_path_factory.mktemp("proof") / "repo", ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".whl", ".te*", ".upstream", ".fla", "evidence", "__pycache__", "*.egg-info")))


def test_the_proof_stops_before_the_tests_when_the_set_up_lacks_te(proof_copy, tmp_path):
    """Without the TE files (and no --optional te) the proof fails at once, naming TE, before it
    asks for GPUs; named optional, it goes on to the tests (here: the CPU host's GPU check)."""
    copy = proof_copy
    env = {"PATH": PATH, "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/gpu-proof.sh"], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL before the tests" in proc.stdout and "Transformer Engine [te] is required and missing" in proc.stdout
    assert "--optional te" in proc.stdout
    optional = subprocess.run(["bash", "scripts/gpu-proof.sh", "--optional", "all"], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=300)
    assert "FAIL before the tests" not in optional.stdout
    assert optional.returncode == 2 and "the proof needs 1 or more" in optional.stdout  # no GPU on this host


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_gpu1_worker_count_is_refused_before_any_set_up(proof_copy, tmp_path, value):
    env = {"PATH": PATH, "OUT": str(tmp_path / "out"), "HOME": str(tmp_path), "CPKIT_GPU1_WORKERS_PER_GPU": value}
    proc = subprocess.run(["bash", "scripts/gpu-proof.sh"], cwd=proof_copy, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"CPKIT_GPU1_WORKERS_PER_GPU={value}: must be a whole number of 1 or more" in proc.stderr
    assert "fix: CPKIT_GPU1_WORKERS_PER_GPU=2" in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("te_ok", [True, False])
def test_te_installs_beside_the_set_up_and_its_failure_is_named(proof_copy, tmp_path, te_ok):
    """TE's install runs in the background beside cpkit's set-up; the proof waits for it, and a
    failed install stops the proof before the tests, naming its last line (a stand-in install)."""
    copy = Path(shutil.copytree(proof_copy, tmp_path / "repo"))
    (copy / ".te").mkdir()
    (copy / ".te" / "te-bundle.tar.xz").write_bytes(b"stand-in")
    (copy / "scripts" / "te-install.sh").write_text(
        'echo "te-install: stand-in"; sleep 1\n'
        'if [ "$STUB_TE" = ok ]; then echo "transformer_engine imports"; exit 0; fi\n'
        'echo "te-install: the extension did not import"; exit 1\n')
    env = {"PATH": PATH, "OUT": str(tmp_path / "out"), "HOME": str(tmp_path), "STUB_TE": "ok" if te_ok else "no"}
    proc = subprocess.run(["bash", "scripts/gpu-proof.sh", "--optional", "mlm,bridge,upstream,mcore,kernels,fla,other"],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert "te-install: stand-in" in proc.stdout, proc.stdout + proc.stderr
    if te_ok:  # on to the tests: here, the CPU host's GPU check
        assert proc.returncode == 2 and "the proof needs 1 or more" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1 and "FAIL before the tests" in proc.stdout, proc.stdout + proc.stderr
        assert "te-install: the extension did not import" in proc.stdout


#: python3 on a host of $FAKE_GPUS GPUs whose pytest is $FAKE_PYTEST; anything else goes to the real one.
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = "-c" ] && [ "$2" = "import torch; print(torch.cuda.device_count())" ]; then echo "$FAKE_GPUS"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then shift 2; exec "$REAL_PYTHON" "$FAKE_PYTEST" "$@"; fi
exec "$REAL_PYTHON" "$@"
"""
#: pytest that logs its arguments and writes a junit of one test, failing for the marker $FAKE_FAIL;
#: for the marker $FAKE_CUT it exits $FAKE_EXIT after writing a green junit (a cut pytest does).
FAKE_PYTEST = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as fh:
    fh.write(json.dumps(args) + "\\n")
marker = args[args.index("-m") + 1]
with open(os.environ["FAKE_LOG"] + ".visible", "a") as fh:
    fh.write(json.dumps([marker, os.environ.get("CUDA_VISIBLE_DEVICES")]) + "\\n")
with open(os.environ["FAKE_LOG"] + ".slots", "a") as fh:
    fh.write(json.dumps([marker, os.environ.get("CPKIT_GPU_SLOTS")]) + "\\n")
junit = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
name, failure = marker.replace(" ", "_"), '<failure message="off"/>' if marker == os.environ.get("FAKE_FAIL") else ""
with open(junit, "w") as fh:
    fh.write('<?xml version="1.0"?><testsuites><testsuite name="pytest"><testcase classname="functional.test_x" '
             f'name="test_{name}" time="1">{failure}</testcase></testsuite></testsuites>')
sys.exit(int(os.environ.get("FAKE_EXIT", "0")) if marker == os.environ.get("FAKE_CUT") else 0)
"""


def _split(marker):
    """The multi-GPU tier's two pytests: the pools' (one process) and the own launches' (3 workers)."""
    return {f"({marker}) and (cpkit_grid or cpkit_prefetch)": "0",
            f"({marker}) and not cpkit_grid and not cpkit_prefetch": "3"}


@pytest.mark.parametrize("gpus,fail,tiers,exit_code", [
    (1, "", {"gpu1": "2"}, 0),
    (2, "gpu1", {"gpu1": "4", **_split("gpu2")}, 1),
    (2, "(gpu2) and not cpkit_grid and not cpkit_prefetch", {"gpu1": "4", **_split("gpu2")}, 1),
    (4, "", {"gpu1": "8", **_split("gpu2 or gpu4")}, 0),
])
def test_the_proof_runs_gpu1_beside_the_tier_the_host_fits_and_fails_on_either(proof_copy, tmp_path, gpus, fail,
                                                                               tiers, exit_code):
    """1 GPU: gpu1 alone (no refusal, no budget); 2-3: gpu1 beside gpu2; 4 or more: gpu1 beside
    gpu2 + gpu4, the multi-GPU tests that start their own ranks in a pytest of their own beside
    the pools'. gpu1 runs on two xdist workers per GPU, each pinned (the workers wrap round the
    host's GPU ids, which the proof names), its slowest file first; a failure in gpu1 or in the
    own launches fails the proof."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "fake_pytest.py").write_text(FAKE_PYTEST)
    log = tmp_path / "pytest-calls.jsonl"
    env = {"PATH": f"{bin_dir}:{PATH}", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path), "CPKIT_COMMIT": "abc1234",
           "REAL_PYTHON": sys.executable, "FAKE_PYTEST": str(tmp_path / "fake_pytest.py"), "FAKE_LOG": str(log),
           "FAKE_GPUS": str(gpus), "FAKE_FAIL": fail}
    proc = subprocess.run(["bash", "scripts/gpu-proof.sh", "--optional", "all"], cwd=proof_copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == exit_code, proc.stdout + proc.stderr
    calls = {args[args.index("-m") + 1]: args for args in map(json.loads, log.read_text().splitlines())}
    assert {marker: args[args.index("-n") + 1] for marker, args in calls.items()} == tiers
    gpu1 = calls["gpu1"]
    visible = dict(map(json.loads, Path(f"{log}.visible").read_text().splitlines()))
    assert visible["gpu1"] == ",".join(map(str, range(gpus)))
    slots = dict(map(json.loads, Path(f"{log}.slots").read_text().splitlines()))
    # the own launches share the GPUs 3 at a time where each 2-rank launch needs the whole host
    assert {m: n for m, n in slots.items() if "not cpkit_grid" in m} == (
        {} if gpus == 1 else {"(gpu2) and not cpkit_grid and not cpkit_prefetch": "3"} if gpus < 4
        else {"(gpu2 or gpu4) and not cpkit_grid and not cpkit_prefetch": "1"})
    assert " ".join(gpu1).count("-p cpkit.testing.gpu_per_worker") == 1 and "--dist worksteal" in " ".join(gpu1)
    assert f"--junitxml={tmp_path}/out/evidence/" in " ".join(gpu1) and gpu1[-1] == "tests"
    assert [a for a in gpu1 if a.startswith("functional/")][0] == "functional/test_replay_gpu.py"
    with tarfile.open(tmp_path / "out" / "proof.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        readme = tar.extractfile(next(n for n in tar.getnames() if n.endswith("README.md"))).read().decode()
    assert {"junit-gpu1.xml.gz", "pytest-gpu1.log.gz"} <= names and ("junit.xml.gz" in names) == (gpus > 1)
    assert f"({2 * gpus} xdist workers on {gpus} GPU" in readme
    assert ("junit-launch.xml.gz" in names) == (gpus > 1)
    if gpus == 1:
        assert "no multi-GPU tier on 1 GPU" in readme and "none stated for a 1-GPU host" in readme
    if fail == "gpu1":
        assert "- FAIL: not green: gpu1: 1 failed" in readme
    elif fail:  # a test that starts its own ranks failed: the proof fails too
        assert "- FAIL: not green: gpu2: own launches: 1 failed" in readme
    if gpus == 4:
        assert "pytest wall (gpu1 beside gpu2 or gpu4): " in readme and "- pass" in readme


@pytest.mark.parametrize("gpus,cut,status,line", [
    (1, "gpu1", 124, "- FAIL: not green: gpu1: cut by the proof's deadline (CPKIT_PROOF_TIMEOUT_S; exit 124)"),
    (2, "(gpu2) and (cpkit_grid or cpkit_prefetch)", 137, "- FAIL: not green: gpu2: cut by the proof's deadline"),
    (2, "(gpu2) and not cpkit_grid and not cpkit_prefetch", 2, "gpu2: own launches: pytest exit 2 (interrupted)"),
])
def test_a_pytest_cut_by_the_deadline_fails_the_proof_though_its_junit_is_green(proof_copy, tmp_path, gpus, cut,
                                                                                status, line):
    """Each of the proof's pytests hands its exit status to the report: one cut by the deadline
    (124, or 137 after the grace) or interrupted fails the proof, though the junit it wrote
    holds only passes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "fake_pytest.py").write_text(FAKE_PYTEST)
    env = {"PATH": f"{bin_dir}:{PATH}", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path), "CPKIT_COMMIT": "abc1234",
           "REAL_PYTHON": sys.executable, "FAKE_PYTEST": str(tmp_path / "fake_pytest.py"),
           "FAKE_LOG": str(tmp_path / "calls.jsonl"), "FAKE_GPUS": str(gpus), "FAKE_FAIL": "", "FAKE_CUT": cut,
           "FAKE_EXIT": str(status)}
    proc = subprocess.run(["bash", "scripts/gpu-proof.sh", "--optional", "all"], cwd=proof_copy, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and line in proc.stdout, proc.stdout + proc.stderr


def _gpu1_paths() -> list[str]:
    """The gpu1 tier's pytest paths as scripts/gpu-proof.sh spells them (bash expands the glob)."""
    line = next(l for l in (ROOT / "scripts" / "gpu-proof.sh").read_text().splitlines() if l.startswith("gpu1_paths=("))
    out = subprocess.run(["bash", "-c", f'{line}; printf "%s\\n" "${{gpu1_paths[@]}}"'], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return out.split()


def _collect(paths: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu1",
                           *paths], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_gpu1_paths_collect_the_whole_tier_with_the_slowest_test_first():
    """pytest collects in the order of its arguments: the slowest gpu1 test (about 100 s on one
    H200) is first, so worksteal starts it at once; and the paths miss no gpu1 test."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # two collections of the whole suite, side by side
        ordered, everything = pool.map(_collect, [_gpu1_paths(), ["functional", "tests"]])
    assert ordered[0] == "functional/test_replay_gpu.py::test_the_replay_runs_every_plan_on_the_gpu_and_reports_the_models_error"
    assert len(ordered) == len(set(ordered)) and set(ordered) == set(everything)


@pytest.mark.parametrize("worker,visible,gpu", [("gw0", None, "0"), ("gw3", None, "3"), ("gw1", "5,7", "7"),
                                                ("gw2", "5, 7", "5"), ("gw1", "GPU-ab12,GPU-cd34", "GPU-cd34"),
                                                ("gw0", "", "")])
def test_each_worker_takes_its_own_gpu_of_those_the_run_sees(worker, visible, gpu):
    from cpkit.testing.gpu_per_worker import worker_gpu

    assert worker_gpu(worker, visible) == gpu


def test_a_worker_id_that_is_not_xdist_s_is_refused_with_a_fix():
    from cpkit.testing.gpu_per_worker import worker_gpu

    with pytest.raises(ValueError, match=r"PYTEST_XDIST_WORKER='master': not an xdist worker id, which is gw<N>.*fix:"):
        worker_gpu("master", None)


PIN_TEST = """
import os, conftest, pytest
@pytest.mark.parametrize("i", range(4))
def test_pin(i):
    with open(os.environ["PIN_LOG"], "a") as fh:
        fh.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '-')} {conftest.AT_IMPORT} {os.environ['CUDA_VISIBLE_DEVICES']}\\n")
"""


@pytest.mark.timeout(300)
def test_each_xdist_worker_sees_only_its_gpu_before_any_conftest_is_imported(tmp_path):
    """The plugin rides `-p` into every worker and sets CUDA_VISIBLE_DEVICES before conftests and
    test modules import (CUDA reads it once); without xdist it changes nothing."""
    (tmp_path / "conftest.py").write_text("import os\nAT_IMPORT = os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    (tmp_path / "test_pin.py").write_text(PIN_TEST)
    log = tmp_path / "pin.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "5,7", "PIN_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)
    for extra in (["-n", "2", "--dist", "worksteal"], ["-n", "0"]):
        log.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpkit.testing.gpu_per_worker",
                               "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *extra, str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        seen = set(log.read_text().splitlines())
        if extra[1] == "2":
            assert seen == {"gw0 5 5", "gw1 7 7"}, seen
        else:
            assert seen == {"- 5,7 5,7"}, seen


def test_setup_violations_name_each_required_part_the_set_up_lacks():
    from cpkit.validation.required_parts import main, setup_violations

    lines = setup_violations({"te": "no .te/te-bundle.tar.xz", "mlm": "no .upstream/mlm.tar.xz"}, ["upstream"])
    assert lines == ["Transformer Engine [te] is required and missing in the set-up: no .te/te-bundle.tar.xz "
                     "(fix: carry its files (scripts/GPU_CI.md), or name it optional: --optional te)"]
    assert main(["--absent", "te=missing", "--optional", "te"]) == 0
    assert main(["--absent", "te=missing"]) == 1
    assert main(["--optional", "tee"]) == 2


def test_the_proof_ends_at_its_deadline_with_a_kill_after_the_grace_and_writes_no_cards_unless_asked():
    text = (ROOT / "scripts" / "gpu-proof.sh").read_text()
    assert re.search(r'deadline=\(timeout -s INT -k "\$\{CPKIT_PROOF_GRACE_S:-30\}" "\$\{CPKIT_PROOF_TIMEOUT_S:-540\}"\)', text)
    pytests = [line for line in text.splitlines() if "python3 -m pytest" in line]
    assert len(pytests) == 3 and all('"${deadline[@]}" python3 -m pytest' in line for line in pytests)  # every pytest
    record = text[text.index('if [ "$record" = 1 ]; then'):]
    assert "cards record" in record and text.count('sys.exit(main())" cards record') == 1
    assert text.count('cp -r "$dir" "evidence/$name"') == 1 and 'cp -r "$dir" "evidence/$name"' in record


def test_every_script_the_gpu_ci_docs_name_exists_and_a_test_runs_it():
    docs = "".join((ROOT / p).read_text() for p in ("scripts/GPU_CI.md", ".github/workflows/gpu.yml"))
    named = set(re.findall(r"scripts/([\w.-]+\.sh)", docs))
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert {"gpu-ci-prepare.sh", "gpu-proof.sh", "setup.sh"} <= named
    missing = sorted(n for n in named if not (ROOT / "scripts" / n).is_file())
    assert missing == [], f"the docs name scripts that do not exist: {missing}"
    untested = sorted(n for n in named if f'"{n}"' not in tests and f"scripts/{n}" not in tests)
    assert untested == [], f"no test runs {untested}"

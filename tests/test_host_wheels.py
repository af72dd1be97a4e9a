"""scripts/host-wheels.sh downloads a pinned wheel for every requirement that a GPU host with only
torch lacks: cpkit's dependencies and its test extra (torch excepted), the build backend, and the
wheels scripts/gpu-env.sh installs (megatron-core, the cuDNN frontend)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "host-wheels.sh").read_text()
    return {_name(m[1]): m[2] for m in re.finditer(r"\b([A-Za-z][\w.-]*)==([\w.]+)", text)}


def test_every_requirement_but_torch_has_a_pinned_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = {_name(r) for r in project["project"]["dependencies"] + project["project"]["optional-dependencies"]["test"]}
    wanted |= {_name(r) for r in project["build-system"]["requires"]}
    wanted |= {"nvidia-cudnn-frontend"}  # the kernels extra, which scripts/gpu-env.sh installs
    missing = sorted(wanted - {"torch"} - set(_pins()))
    assert not missing, f"scripts/host-wheels.sh pins no wheel for {missing}"


def test_the_pins_are_the_versions_the_gpu_tier_runs():
    pins = _pins()
    assert pins["megatron-core"] == "0.19.2"  # the GPU tier's MCore (README "Versions")
    env = (ROOT / "scripts" / "kernels-wheel.sh").read_text()
    assert f"nvidia-cudnn-frontend=={{1:-{pins['nvidia-cudnn-frontend']}}}" in env.replace("${", "{")

"""Reading a pytest junit XML file: the node id and outcome of every test case, and the run's
timestamp. The cards' record and evidence (cpkit.cards) and the GPU proof's report
(cpkit.validation.proof_report) read runs through it.
"""

from __future__ import annotations

import gzip
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["JUNIT_OUTCOMES", "worst", "read_junit"]

#: Outcomes of one test case in a junit file, best first; `worst` picks the last of several.
JUNIT_OUTCOMES = ("passed", "xfailed", "skipped", "failed", "error")


def worst(outcomes) -> str:
    """The worst of several JUNIT_OUTCOMES (one failed parameter fails the node)."""
    return max(outcomes, key=JUNIT_OUTCOMES.index)


def _case_outcome(case: ET.Element) -> str:
    tags = {child.tag: child for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    skipped = tags.get("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def _module_path(classname: str, root: Path | None) -> tuple[str, list[str]]:
    """(test file, classes) of a junit classname such as `functional.test_x.TestY`: the longest
    dotted prefix that is a file under `root`, else the whole name as the module."""
    parts = classname.split(".")
    if root is not None:
        for cut in range(len(parts), 0, -1):
            path = "/".join(parts[:cut]) + ".py"
            if (root / path).is_file():
                return path, parts[cut:]
    return "/".join(parts) + ".py", []


def read_junit(path: str | Path, root: str | Path | None = None) -> tuple[dict[str, str], str | None]:
    """Node ids and outcomes of a pytest junit XML file (`pytest --junitxml PATH`, any junit
    family; gzipped when its name ends in .gz), and the run's timestamp when the file has one.
    A node id is rebuilt from the case's `file` attribute or its dotted `classname` (resolved against the repository at `root`)
    and its `name` (parameters included): `functional/test_x.py::TestY::test_z[nccl2-a2a]`.
    A case listed twice (a rerun) keeps its worst outcome. Raises ValueError naming the file
    when it is not such a file."""
    path = Path(path)
    try:
        tree = ET.parse(gzip.open(path) if path.name.endswith(".gz") else path)
    except (OSError, ET.ParseError) as exc:
        raise ValueError(f"{path}: not a readable junit XML file ({exc})") from None
    top = tree.getroot()
    if top.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path}: not a junit XML file (top element <{top.tag}>, expected <testsuites>)")
    root = Path(root) if root is not None else None
    outcomes: dict[str, str] = {}
    for case in top.iter("testcase"):
        name, classname = case.get("name", ""), case.get("classname", "")
        if not name or not classname:
            continue
        file, classes = _module_path(classname, root)
        given = case.get("file")  # junit family xunit1 names the file
        if given and given.endswith(".py"):
            module = given[:-3].replace("/", ".")
            file = given
            classes = classname[len(module) + 1:].split(".") if classname.startswith(module + ".") else []
        node = "::".join([file, *classes, name])
        outcome = _case_outcome(case)
        outcomes[node] = worst([outcomes[node], outcome]) if node in outcomes else outcome
    suite = top if top.tag == "testsuite" else top.find("testsuite")
    stamp = suite.get("timestamp") if suite is not None else None
    return outcomes, stamp

"""Pytest node ids as cards name them: the one matcher every card module shares (a `covered_by`
entry names a node id when it is that id, or a file, class or parametrized base name that
contains it), and the reading of node ids and outcomes from a pytest junit XML file."""

from __future__ import annotations

import gzip
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["node_matches", "node_file", "JUNIT_OUTCOMES", "CLUSTER_PREFIX", "CLUSTER_TEST_FILE", "worst",
           "read_junit"]

#: A covered_by entry `cluster:<check>` names a check of `python -m cpkit.cluster` (its log's
#: `<check>: pass` line), for runs that are not pytest runs (torchrun on a cluster).
CLUSTER_PREFIX = "cluster:"
#: The test file whose selection stands for a cluster check's code when judging staleness.
CLUSTER_TEST_FILE = "functional/test_cluster.py"

#: Outcomes of one test case in a junit file, best first; `worst` picks the last of several.
JUNIT_OUTCOMES = ("passed", "xfailed", "skipped", "failed", "error")


def node_matches(entry: str, node_id: str) -> bool:
    """True when the covered_by `entry` names `node_id`: the same id, or a file, class or
    parametrized base name that contains it."""
    return node_id == entry or node_id.startswith(entry + "::") or node_id.startswith(entry + "[")


def node_file(node_id: str) -> str:
    """The repository-relative test file of a node id (`functional/test_x.py::test_y[a]`); for a
    cluster check entry, CLUSTER_TEST_FILE (which runs the same checks on gloo)."""
    return CLUSTER_TEST_FILE if node_id.startswith(CLUSTER_PREFIX) else node_id.split("::", 1)[0]


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

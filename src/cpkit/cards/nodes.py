"""Pytest node ids as cards name them: the one matcher every card module shares (a `covered_by`
entry names a node id when it is that id, or a file, class or parametrized base name that
contains it). Node ids and outcomes from a junit file: cpkit.validation.junit."""

from __future__ import annotations

__all__ = ["node_matches", "node_file", "CLUSTER_PREFIX", "CLUSTER_TEST_FILE"]

#: A covered_by entry `cluster:<check>` names a check of `python -m cpkit.cluster` (its log's
#: `<check>: pass` line), for runs that are not pytest runs (torchrun on a cluster).
CLUSTER_PREFIX = "cluster:"
#: The test file whose selection stands for a cluster check's code when judging staleness.
CLUSTER_TEST_FILE = "functional/test_cluster.py"


def node_matches(entry: str, node_id: str) -> bool:
    """True when the covered_by `entry` names `node_id`: the same id, or a file, class or
    parametrized base name that contains it."""
    return node_id == entry or node_id.startswith(entry + "::") or node_id.startswith(entry + "[")


def node_file(node_id: str) -> str:
    """The repository-relative test file of a node id (`functional/test_x.py::test_y[a]`); for a
    cluster check entry, CLUSTER_TEST_FILE (which runs the same checks on gloo)."""
    return CLUSTER_TEST_FILE if node_id.startswith(CLUSTER_PREFIX) else node_id.split("::", 1)[0]

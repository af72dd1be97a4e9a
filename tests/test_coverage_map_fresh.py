"""The committed coverage map (evidence/coverage-map.json) stays close to the code it describes.

`cpkit validate --changed` selects by the map and widens by what changed since it was measured
(src/cpkit/validation/coverage_map.py::drift_since, from the hashes the map stores): an old map
still selects soundly, only more, so a stale map shows as slow, imprecise `--changed` runs rather
than as a failure. This test turns that slow decay into a failure with the fix in its message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cpkit.validation.coverage_map import MAP_PATH, MAP_VERSION, drift_since, load_map
from cpkit.validation.coverage_record import RECORDING_ENV
from tests.test_coverage_map import DEVICES, MODULE, TESTS, _edit, _record

ROOT = Path(__file__).resolve().parents[1]

#: How many functions (changed, new or deleted) and modules with changed module-level code the
#: committed map may be behind the code. 40: a few days of ordinary work on cpkit (a feature
#: branch touches 10-30 functions), so the map is refreshed about once per merged feature, while
#: the selection it widens by stays small: each function changed since the map adds its own
#: tests, and each new function or module-level change its module's whole feature (the measured
#: one-function changes select 8-21% of the suite; past some 40 drifted functions most of the
#: suite's features are in every selection and `--changed` stops paying for itself).
MAX_DRIFT = 40
REFRESH = "cpkit validate --record-map"  # the full validation, which writes the map from its own run


def staleness(root: Path, limit: int = MAX_DRIFT) -> str | None:
    """Why the map at `root` is too stale (a message naming the refresh command), or None."""
    cmap = load_map(root)
    if cmap is None:
        return f"no coverage map at {MAP_PATH}: record one with `{REFRESH}` (about 15 minutes on 2 cores)"
    if cmap.version != MAP_VERSION:
        return (f"{MAP_PATH} is format {cmap.version}, this cpkit writes {MAP_VERSION} (test node ids per "
                f"function): re-record it with `{REFRESH}` (about 15 minutes on 2 cores)")
    drift = drift_since(cmap, root)
    if drift.size() <= limit:
        return None
    return (f"{MAP_PATH} (measured at {cmap.commit[:12]}) is {drift.size()} functions and modules behind the "
            f"code, more than {limit}: {drift.summary()}. Every `cpkit validate --changed` widens by that "
            f"drift; refresh the map with `{REFRESH}` (about 15 minutes on 2 cores) and commit it")


@pytest.mark.skipif(bool(os.environ.get(RECORDING_ENV)), reason="this run records the map (cpkit validate --record-map): "
                    "the map it writes at its end describes the code it ran")
def test_the_committed_coverage_map_is_fresh():
    problem = staleness(ROOT)
    assert problem is None, problem


def test_staleness_counts_changed_new_and_deleted_functions_and_module_level_code(tmp_path):
    (tmp_path / "src" / "cpkit").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / MODULE).write_text(DEVICES)
    for path, text in TESTS.items():
        (tmp_path / path).write_text(text)
    assert "no coverage map" in staleness(tmp_path)
    _record(tmp_path, {"tests/test_alpha.py::test_a": ["f"]})
    assert staleness(tmp_path, limit=0) is None
    _edit(tmp_path, "return x + 1", "return x + 2")  # f changed
    _edit(tmp_path, "def h(x):", "def k(x):\n    return 0\n\n\ndef h(x):")  # k new
    _edit(tmp_path, "def g(x):\n    return x * 2\n", "")  # g deleted
    _edit(tmp_path, "LIMIT = 3", "LIMIT = 4")  # module-level code
    assert drift_since(load_map(tmp_path), tmp_path).size() == 4
    assert staleness(tmp_path, limit=4) is None
    problem = staleness(tmp_path, limit=3)
    assert "4 functions and modules behind" in problem and REFRESH in problem
    raw = json.loads((tmp_path / MAP_PATH).read_text())
    (tmp_path / MAP_PATH).write_text(json.dumps(dict(raw, version=1, files=raw["blobs"], tests=[], functions={})))
    assert "format 1" in staleness(tmp_path, limit=100) and REFRESH in staleness(tmp_path, limit=100)

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

from cpkit.validation.changed_selection import drift_selection, selection_size
from cpkit.validation.coverage_map import MAP_PATH, MAP_VERSION, drift_since, load_map
from cpkit.validation.coverage_record import RECORDING_ENV
from tests.test_coverage_map import RUNS, TESTS, _edit, make_repo

ROOT = Path(__file__).resolve().parents[1]

#: The largest share of the suite the map's drift may add to every `--changed` selection of a
#: module change. The README's promise is that a one-function change runs a small share of the
#: tests (at most 10%); a count of drifted functions did not keep it (40 allowed
#: drifted functions let module-level drift widen every selection to the whole suite).
MAX_SHARE = 0.10
REFRESH = "cpkit validate --record-map"  # the full validation, which writes the map from its own run


def staleness(root: Path, limit: float = MAX_SHARE) -> str | None:
    """Why the map at `root` is too stale (a message naming the refresh command), or None: the
    tests its drift adds to a selection (changed_selection.drift_selection), as a share of the
    tests the map recorded, exceed `limit`."""
    cmap = load_map(root)
    if cmap is None:
        return f"no coverage map at {MAP_PATH}: record one with `{REFRESH}` (about 15 minutes on 2 cores)"
    if cmap.version != MAP_VERSION:
        return (f"{MAP_PATH} is format {cmap.version}, this cpkit writes {MAP_VERSION} (test node ids per "
                f"function): re-record it with `{REFRESH}` (about 15 minutes on 2 cores)")
    drift = drift_since(cmap, root)
    added, total = selection_size(drift_selection(root, cmap, drift), cmap)
    if added <= limit * total:
        return None
    return (f"{MAP_PATH} (measured at {cmap.commit[:12]}) has drifted so far that every `cpkit validate "
            f"--changed` of a module change runs {added} of its {total} tests ({added / total:.0%}, more than "
            f"{limit:.0%}) before the change's own: {drift.summary()}. Refresh the map with `{REFRESH}` "
            "(about 15 minutes on 2 cores) and commit it")


@pytest.mark.skipif(bool(os.environ.get(RECORDING_ENV)), reason="this run records the map (cpkit validate --record-map): "
                    "the map it writes at its end describes the code it ran")
def test_the_committed_coverage_map_is_fresh():
    problem = staleness(ROOT)
    assert problem is None, problem


def test_staleness_is_the_share_of_tests_the_drift_adds_not_a_count_of_functions(tmp_path):
    """The tiny map records 4 tests (test_importer's ran no function of the module: a fifth once
    selected). A body change since the map adds the tests that ran the function; a module-level
    change the module's whole feature and every test that ran it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    make_repo(repo, TESTS, RUNS)
    assert staleness(repo, limit=0) is None  # no drift adds nothing
    _edit(repo, "return x * 2", "return x * 3")  # g changed: test_b, 1 of the 4 recorded tests
    assert staleness(repo, limit=0.25) is None
    problem = staleness(repo, limit=0.2)
    assert "runs 1 of its 4 tests (25%, more than 20%)" in problem and REFRESH in problem
    _edit(repo, "LIMIT = 3", "LIMIT = 4")  # module-level: every test that ran the module, its feature
    assert "runs 5 of its 5 tests (100%" in staleness(repo, limit=0.9)
    # One drifted function is enough when it widens past the limit; many cheap ones are not.
    cheap = tmp_path / "cheap"
    cheap.mkdir()
    make_repo(cheap, TESTS, RUNS)
    for old, new in (("return x + 1", "return x + 2"), ("return x * 2", "return x * 3"),
                     ("return x - LIMIT", "return x - LIMIT - 0")):
        _edit(cheap, old, new)
    assert drift_since(load_map(cheap), cheap).size() == 3 and staleness(cheap, limit=1.0) is None


def test_no_map_or_an_old_format_names_the_refresh_command(tmp_path):
    (tmp_path / "src" / "cpkit").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    assert "no coverage map" in staleness(tmp_path) and REFRESH in staleness(tmp_path)
    make_repo(tmp_path / "r", TESTS, RUNS)
    raw = json.loads((tmp_path / "r" / MAP_PATH).read_text())
    (tmp_path / "r" / MAP_PATH).write_text(json.dumps(dict(raw, version=1, files=raw["blobs"], tests=[], functions={})))
    assert "format 1" in staleness(tmp_path / "r") and REFRESH in staleness(tmp_path / "r")

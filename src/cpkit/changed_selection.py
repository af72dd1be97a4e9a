"""What `cpkit validate --changed` runs: the measured callers of the changed functions (the
coverage map, src/cpkit/coverage_map.py) united with the static selection (the change map and
the symbol graph, src/cpkit/change_map.py::select_tests), never fewer tests than either.

Per changed module, from its diff hunks:
- a changed line in a function body selects the test files that ran that function (rank
  processes included);
- a changed function the map has no coverage for (new, or never run) selects the module's whole
  feature: its change-map row and every test importing it (`--changed --wide` for that module);
- a changed line outside any function body (module or class level, a signature, a decorator),
  a new or a deleted module selects the whole feature plus every test that ran any function of
  the module.
A missing or stale map (one whose modules or test files differ at BASE from when it was
measured) selects everything, with the reason.

The report also names the GPU tests (gpu1/gpu2/gpu4) the change makes stale: those in the
selected files and those of GPU-only test files importing a changed module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cpkit.change_map import EVERYTHING, select_tests
from cpkit.coverage_map import CoverageMap, functions_at_lines, load_map, staleness, tracked_files

__all__ = ["ChangedSelection", "select_changed", "GPU_LEVELS"]

GPU_LEVELS = ("gpu1", "gpu2", "gpu4")


@dataclass
class ChangedSelection:
    """Test files to run (or everything), why, the map's state, and per GPU level the test
    files whose GPU tests the change makes stale."""

    files: list[str]
    reasons: dict[str, str]
    everything: bool
    map_state: str  # "fresh" or why the map was not used
    gpu_stale: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"files": self.files, "reasons": self.reasons, "everything": self.everything,
                "coverage_map": self.map_state, "gpu_stale": self.gpu_stale}


def _whole_feature(path: str, root: Path) -> tuple[set[str], bool]:
    """(the test files of `path`'s feature, whether that is everything): --wide for the path."""
    wide = select_tests([path], root, narrow=False)
    return set(wide.files), wide.everything


def _measured(path: str, root: Path, lines: set[int] | None, cmap: CoverageMap) -> tuple[set[str], bool, str]:
    """(test files, everything?, reason) the coverage map adds for changed module `path`."""
    file = root / path
    if not file.is_file() or lines is None:
        picked, everything = _whole_feature(path, root)
        picked |= cmap.tests_of_module(path)
        return picked, everything, "new or deleted module: its feature and every test that ran it"
    names, outside = functions_at_lines(file.read_text(), lines)
    picked: set[str] = set()
    everything = False
    why = []
    for name in sorted(names):
        tests = cmap.tests_of(path, name)
        if tests is None:
            feature, everything_ = _whole_feature(path, root)
            picked |= feature
            everything |= everything_
            why.append(f"{name} (no recorded coverage: its whole feature)")
        else:
            picked.update(tests)
            why.append(f"{name} ({len(tests)} test files ran it)")
    if outside:
        feature, everything_ = _whole_feature(path, root)
        picked |= feature | cmap.tests_of_module(path)
        everything |= everything_
        why.append(f"lines {min(outside)}-{max(outside)} outside a function body: its feature and every "
                   "test that ran the module")
    return picked, everything, "; ".join(why) or "no changed line in code"


def _gpu_stale(root: Path, changed_modules: list[str], files: list[str], everything: bool,
               cmap: CoverageMap | None) -> dict[str, list[str]]:
    """GPU level -> test files whose tests at that level the change makes stale."""
    levels = cmap.levels if cmap is not None else {}
    candidates = set(files)
    if everything:
        candidates |= set(levels)
    for path in changed_modules:
        for test in _whole_feature(path, root)[0]:
            if levels.get(test) and not set(levels[test]) - set(GPU_LEVELS):  # a GPU-only file
                candidates.add(test)
    out: dict[str, list[str]] = {}
    for test in sorted(candidates):
        for level in GPU_LEVELS:
            if levels.get(test, {}).get(level):
                out.setdefault(level, []).append(test)
    return {level: out[level] for level in GPU_LEVELS if level in out}


def select_changed(root: Path, base: str, changed: list[str], lines: dict[str, set[int] | None], *,
                   wide: bool = False) -> ChangedSelection:
    """The selection for repository paths `changed` since commit `base` (`lines`: changed line
    numbers per changed module, None for an untracked one), per the module docstring."""
    root = Path(root).resolve()
    static = select_tests(changed, root, narrow=not wide, lines=lines)
    modules = [p for p in changed if p.startswith("src/cpkit/") and p.endswith(".py")]
    try:
        cmap = load_map(root)
        stale = staleness(cmap, tracked_files(root, base))
    except (ValueError, KeyError, OSError) as exc:
        cmap, stale = None, f"the coverage map cannot be read ({exc}); refresh it with `cpkit validate --record-map`"
    if stale is not None and modules:
        reasons = dict(static.reasons, **{"(coverage map)": stale + ": running everything"})
        return ChangedSelection(list(EVERYTHING), reasons, True, stale,
                                _gpu_stale(root, modules, [], True, cmap))
    files = dict.fromkeys(static.files)
    reasons = dict(static.reasons)
    everything = static.everything
    if cmap is not None and stale is None:
        for path in modules:
            picked, everything_, why = _measured(path, root, lines.get(path), cmap)
            everything |= everything_
            files.update(dict.fromkeys(sorted(p for p in picked if p not in files)))
            reasons[path] = f"{reasons.get(path, '')}; measured: {why}".lstrip("; ")
    picked = sorted(f for f in files if f in EVERYTHING or (root / f).exists())
    if everything:
        picked = list(EVERYTHING)
    return ChangedSelection(picked, reasons, everything, stale or "fresh",
                            _gpu_stale(root, modules, picked, everything, cmap))

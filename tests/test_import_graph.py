"""The library's import graph: library modules never import test support.

Read from the source by src/cpkit/import_graph.py (`ast`, nothing is imported), so a lazy import
inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpkit.import_graph import imports, module_name

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "cpkit"

# Test support, and the layers built on top of it (benchmarks launch ranks with the test launcher;
# the cluster runner runs the functional tests' scenarios under torchrun).
SUPPORT = ("cpkit.testing",)
ON_TOP_OF_SUPPORT = ("cpkit.testing", "cpkit.bench", "cpkit.cluster")


def _module_name(path: Path, root: Path = SRC) -> str:
    return module_name(path, root)


def _imports(path: Path, root: Path = SRC) -> set[str]:
    return imports(path, root)


def _is_under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if not _is_under(_module_name(p), ON_TOP_OF_SUPPORT))


def test_the_library_is_found():
    names = {_module_name(p) for p in LIBRARY}
    for expected in ("cpkit.attention.functional", "cpkit.layout", "cpkit.groups", "cpkit.group_info",
                     "cpkit.rebind", "cpkit.eval_cp", "cpkit.eval_loop", "cpkit.loss", "cpkit.dynamic.runtime", "cpkit.rank_grid",
                     "cpkit.topology"):
        assert expected in names


@pytest.mark.parametrize("path", LIBRARY, ids=_module_name)
def test_library_module_imports_no_test_support(path):
    bad = sorted(name for name in _imports(path) if _is_under(name, SUPPORT) or name == "cpkit.models")
    assert not bad, f"{_module_name(path)} imports test support {bad}; move what it needs into the library"


def test_the_check_catches_a_lazy_import(tmp_path):
    # The check must be able to fail: an import inside a function is found too.
    module = tmp_path / "cpkit" / "sub" / "lazy.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..testing.models import build_gpt\n    return build_gpt\n")
    assert "cpkit.testing.models" in _imports(module, root=tmp_path)

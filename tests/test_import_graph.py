"""The library's import graph: each of cpkit's layers imports only the layers below it (the
product neither the harness nor the validation tooling), library modules never import test
support, no module imports itself back through others, and no module is over 500 lines.

Read from the source by src/cpkit/validation/import_graph.py (`ast`, nothing is imported), so a
lazy import inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpkit.validation.import_graph import (FEATURES, LAYERS, feature_of, feature_violations, import_cycles, imports, layer_of,
                                          layer_violations, module_name)

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "cpkit"

# Test support, and the layer built on top of it (the cluster runner, itself a test runner, runs
# the functional tests' scenarios under torchrun). Benchmarks are a product part: library.
SUPPORT = ("cpkit.testing",)
ON_TOP_OF_SUPPORT = ("cpkit.testing", "cpkit.cluster")


def _module_name(path: Path, root: Path = SRC) -> str:
    return module_name(path, root)


def _imports(path: Path, root: Path = SRC) -> set[str]:
    return imports(path, root)


def _is_under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if not _is_under(_module_name(p), ON_TOP_OF_SUPPORT))


def test_each_layer_imports_only_layers_below():
    """The product (what a training loop imports) imports neither the harness nor the validation
    tooling; the harness imports no tooling; neither imports the consumers on top (test support,
    benchmarks, cards and skills checks, commands)."""
    bad = layer_violations(SRC)
    order = ", ".join(name for name, _ in LAYERS)
    assert not bad, "imports that reach a layer above the importer's own:\n  " + "\n  ".join(bad) + \
        f"\nThe layers, lowest first: {order}; each imports only its own and those before it " \
        "(src/cpkit/validation/import_graph.py::LAYERS). Move what the importer needs down, into " \
        "its own layer or below, or move the importer up."


def test_the_layers_are_found():
    names = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    by_layer = {name: {m for m in names if LAYERS[layer_of(m)][0] == name} for name, _ in LAYERS}
    assert {"cpkit.parallel.layout", "cpkit.parallel.groups", "cpkit.parallel.rank_grid", "cpkit.devices", "cpkit.process_device",
            "cpkit.attention.p2p", "cpkit.dynamic.runtime"} <= by_layer["the product"]
    assert {"cpkit.harness.launch", "cpkit.harness.rank_pool", "cpkit.harness.attribution"} <= by_layer["the harness"]
    assert {"cpkit.validation.change_map", "cpkit.validation.coverage_map",
            "cpkit.validation.junit"} <= by_layer["the validation tooling"]
    assert {"cpkit.cli", "cpkit.cards.check", "cpkit.bench.attention.attention", "cpkit.testing.pytest_plugin"} <= \
        by_layer["the consumers"]


def test_the_layer_check_names_the_module_and_the_import(tmp_path):
    # The check must be able to fail: a lazy import of the harness from a product module, and one
    # of a command from the tooling, are each reported with the file, line and both layers.
    src = tmp_path / "src"
    _write(src, {
        "cpkit/__init__.py": "",
        "cpkit/models.py": "import os\n\ndef build():\n    from cpkit.harness.launch import launch\n",
        "cpkit/harness/__init__.py": "",
        "cpkit/harness/launch.py": "from cpkit import models\nfrom cpkit.validation import change_map\n",
        "cpkit/validation/__init__.py": "",
        "cpkit/validation/change_map.py": "from ..cli import main\nfrom cpkit.harness.launch import launch\n",
        "cpkit/cli.py": "import cpkit.validation.change_map\nimport cpkit.harness.launch\n",
    })
    assert layer_violations(src) == [
        "src/cpkit/harness/launch.py:2: cpkit.harness.launch (the harness) imports cpkit.validation.change_map "
        "(the validation tooling)",
        "src/cpkit/models.py:4: cpkit.models (the product) imports cpkit.harness.launch (the harness)",
        "src/cpkit/validation/change_map.py:1: cpkit.validation.change_map (the validation tooling) imports "
        "cpkit.cli (the consumers)",
    ]


def test_the_library_is_found():
    names = {_module_name(p) for p in LIBRARY}
    for expected in ("cpkit.attention.functional", "cpkit.parallel.layout", "cpkit.parallel.groups", "cpkit.parallel.group_info",
                     "cpkit.eval_cp.rebind", "cpkit.eval_cp.context", "cpkit.eval_cp.loop", "cpkit.loss", "cpkit.dynamic.runtime", "cpkit.parallel.rank_grid",
                     "cpkit.hierarchical.topology"):
        assert expected in names


@pytest.mark.parametrize("path", LIBRARY, ids=_module_name)
def test_library_module_imports_no_test_support(path):
    bad = sorted(name for name in _imports(path) if _is_under(name, SUPPORT))
    assert not bad, f"{_module_name(path)} imports test support {bad}; move what it needs into the library"


def test_the_benchmarks_and_their_model_are_library():
    """Users run `python -m cpkit.bench`: no benchmark module imports test scaffolding (its model
    is `cpkit.attention.gpt`, its launcher `cpkit.harness.launch`)."""
    names = {_module_name(p) for p in LIBRARY}
    assert "cpkit.bench.attention.attention" in names and "cpkit.bench.eval_cp.eval_cp" in names and "cpkit.attention.gpt" in names


def test_the_check_catches_a_lazy_import(tmp_path):
    # The check must be able to fail: an import inside a function is found too.
    module = tmp_path / "cpkit" / "sub" / "lazy.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..testing.models import build_gpt\n    return build_gpt\n")
    assert "cpkit.testing.models" in _imports(module, root=tmp_path)


def test_no_import_circle_in_the_package():
    circles = import_cycles(SRC)
    assert not circles, "import circles (each a set of modules that import one another, lazily " \
        "or not): " + "; ".join(" <-> ".join(c) for c in circles) + \
        ". Break each so that every layer imports only downward (move the shared part into a lower module)"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_check_catches_a_lazy_circle(tmp_path):
    # The check must be able to fail: a circle closed by an import inside a function is found,
    # through a third module and a relative import.
    _write(tmp_path, {
        "cpkit/__init__.py": "",
        "cpkit/parallel/layout.py": "def f():\n    from cpkit.parallel.groups import build\n",
        "cpkit/parallel/groups.py": "from .rank_grid import grid\n",
        "cpkit/parallel/rank_grid.py": "from cpkit.parallel.layout import CPLayout\n",
        "cpkit/leaf.py": "import cpkit.parallel.layout\n",
    })
    assert import_cycles(tmp_path) == [["cpkit.parallel.groups", "cpkit.parallel.layout", "cpkit.parallel.rank_grid"]]


def test_a_package_importing_its_submodules_is_no_circle(tmp_path):
    # attention/__init__ re-exports p2p, which imports attention.comm: Python runs that fine.
    _write(tmp_path, {
        "cpkit/__init__.py": "",
        "cpkit/attention/__init__.py": "from cpkit.attention.p2p import ring\nfrom . import comm\n",
        "cpkit/attention/p2p.py": "from cpkit.attention import comm\nfrom .comm import send\n",
        "cpkit/attention/comm.py": "import cpkit.attention.merge\n",
        "cpkit/attention/merge.py": "",
    })
    assert import_cycles(tmp_path) == []
    # ...but a submodule that takes a name defined by its package's __init__ closes one.
    (tmp_path / "cpkit/attention/merge.py").write_text("from cpkit.attention import ring\n")
    assert import_cycles(tmp_path) == [["cpkit.attention", "cpkit.attention.comm", "cpkit.attention.merge",
                                        "cpkit.attention.p2p"]]


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    long = {_module_name(p): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by concern): " + \
        ", ".join(f"{m} ({n})" for m, n in long.items())


def test_each_feature_imports_the_base_and_what_it_builds_on():
    """One package per CP feature: the shared base imports no feature, and a feature imports no
    other feature than those it builds on (BUILDS_ON)."""
    assert feature_violations(SRC) == []


def test_every_feature_package_exists_and_the_base_is_small():
    """`ls src/cpkit` shows the features; at most 12 modules at the top, none over 500 lines."""
    for feature in FEATURES:
        if feature != "cpkit.hybrid" or (SRC / "cpkit" / "hybrid").is_dir():
            assert (SRC / feature.replace(".", "/") / "__init__.py").is_file(), feature
    top = sorted(p.name for p in (SRC / "cpkit").glob("*.py"))
    assert len(top) <= 12, top
    long = {p.relative_to(SRC).as_posix(): n for p in (SRC / "cpkit").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_feature_check_names_the_import(tmp_path):
    src = tmp_path / "src"
    _write(src, {
        "cpkit/__init__.py": "",
        "cpkit/loss.py": "from cpkit.attention import comm\n",
        "cpkit/attention/__init__.py": "",
        "cpkit/attention/comm.py": "def f():\n    from cpkit.eval_cp.rebind import rebind\n",
        "cpkit/eval_cp/__init__.py": "",
        "cpkit/eval_cp/rebind.py": "from cpkit.loss import x\n",
        "cpkit/dynamic/__init__.py": "",
        "cpkit/dynamic/runtime.py": "from cpkit.eval_cp import rebind\n",
    })
    assert feature_of("cpkit.attention.comm") == "cpkit.attention" and feature_of("cpkit.loss") is None
    assert feature_violations(src) == [
        "src/cpkit/attention/comm.py:2: cpkit.attention.comm (cpkit.attention) imports cpkit.eval_cp.rebind (cpkit.eval_cp)",
        "src/cpkit/loss.py:1: cpkit.loss (the shared base) imports cpkit.attention.comm (cpkit.attention)",
    ]

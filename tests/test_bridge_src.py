"""cpkit.upstream.bridge: Bridge files loaded by path, on a stand-in Bridge src/ tree (CI has
no Bridge): a function runs with what it uses, an import that fails here is named when reached."""

from __future__ import annotations

import textwrap

import pytest

from cpkit.errors import CPConfigError
from cpkit.upstream import bridge as bridge_src


@pytest.fixture
def fake_src(tmp_path, monkeypatch):
    root = tmp_path / "src"
    package = root / "megatron" / "bridge"
    (package / "training").mkdir(parents=True)
    (package / "utils").mkdir()
    (package / "training" / "initialize.py").write_text(textwrap.dedent("""
        import math
        from not_a_package_cpkit_knows import heavy
        from megatron.bridge.utils.helpers import double, CONSTANT_CLASS

        LIMIT = 3

        def uses_heavy():
            return heavy(1)

        def area(side):
            return double(math.prod([side, side]))

        def calls_area(side):
            return area(side) + 1

        class Config:
            @property
            def size(self):
                return 2

            def check(self):
                assert self.size == 2, "size must be 2"
    """))
    (package / "utils" / "helpers.py").write_text(textwrap.dedent("""
        import not_a_package_cpkit_knows_either

        def double(x):
            return 2 * x

        class CONSTANT_CLASS:
            pass
    """))
    monkeypatch.setenv(bridge_src.BRIDGE_SRC_ENV, str(root))
    return root


def test_a_function_runs_with_what_it_uses(fake_src):
    init = bridge_src.load_functions("megatron/bridge/training/initialize.py", ["calls_area"])
    assert init.calls_area(3) == 19  # area and double came along; helpers.py's import did not run


def test_an_import_that_fails_here_is_named_when_reached(fake_src):
    init = bridge_src.load_functions("megatron/bridge/training/initialize.py", ["uses_heavy"])
    assert "heavy" in bridge_src.missing_imports(init)
    with pytest.raises(ImportError, match="from not_a_package_cpkit_knows import heavy"):
        init.uses_heavy()


def test_a_method_is_a_function_taking_self(fake_src):
    init = bridge_src.load_functions("megatron/bridge/training/initialize.py", ["Config.check"])
    check = getattr(init, "Config.check")

    class Holder:
        size = 3

    with pytest.raises(AssertionError, match="size must be 2"):
        check(Holder())


def test_an_unknown_function_is_refused(fake_src):
    with pytest.raises(AttributeError, match="no function"):
        bridge_src.load_functions("megatron/bridge/training/initialize.py", ["not_there"])


def test_a_directory_that_is_not_bridge_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv(bridge_src.BRIDGE_SRC_ENV, str(tmp_path))
    with pytest.raises(CPConfigError, match="CPKIT_BRIDGE_SRC"):
        bridge_src.bridge_src()


def test_without_bridge_the_reason_names_the_variable(monkeypatch):
    monkeypatch.delenv(bridge_src.BRIDGE_SRC_ENV, raising=False)
    monkeypatch.setattr(bridge_src.importlib.util, "find_spec", lambda name: None)
    src, why = bridge_src.bridge_src()
    assert src is None and bridge_src.BRIDGE_SRC_ENV in why

"""The pytest plugin's worker choice: many-core hosts spread the suite, CI's 2 cores do not."""

from types import SimpleNamespace

import pytest

from cpkit.testing import pytest_plugin


@pytest.mark.parametrize("cpus,workers", [(1, 0), (2, 0), (4, 0), (7, 0), (8, 2), (16, 4), (64, 16)])
def test_auto_workers_never_oversubscribe(cpus, workers):
    assert pytest_plugin.auto_workers(cpus) == workers


class _Config:
    def __init__(self, numprocesses=None, xdist=True):
        self.option = SimpleNamespace(numprocesses=numprocesses, dist="no", tx=[], usepdb=False)
        self.pluginmanager = SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist")

    def getoption(self, name, default=None):
        return getattr(self.option, name, default)


def test_many_core_host_groups_files_over_workers(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(pytest_plugin.os, "cpu_count", lambda: 16)
    config = _Config()
    pytest_plugin.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist, config.option.tx) == (4, "loadgroup", ["popen"] * 4)


@pytest.mark.parametrize("config,cpus", [(_Config(numprocesses=0), 16), (_Config(xdist=False), 16), (_Config(), 2)],
                         ids=["user-chose-n0", "xdist-disabled", "two-cores"])
def test_explicit_choice_or_small_host_is_left_alone(config, cpus, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(pytest_plugin.os, "cpu_count", lambda: cpus)
    pytest_plugin.pytest_cmdline_main(config)
    assert config.option.dist == "no" and config.option.tx == []

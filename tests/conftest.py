"""Unit-test fixtures. A world-size-1 gloo process group (`world1`, the most any unit test may
use) comes from the cpkit pytest plugin (src/cpkit/testing/pytest_plugin.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mcore_cpu(world1):
    """world1 plus the MCore CPU shim (a no-op where CUDA is available)."""
    from cpkit.mcore_cpu import install_mcore_cpu_shim

    install_mcore_cpu_shim()
    yield world1

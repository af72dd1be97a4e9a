"""Fixtures the functional test files share."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture
def flex_compiled():
    """FlexAttention run uncompiled (its unfused path: the [s_q, s_k] scores in memory) fails the
    test. torch says so once per process, so its record of warnings shown is cleared first."""
    from torch.nn.attention import flex_attention as module

    getattr(module, "_WARNINGS_SHOWN", set()).clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*called without torch.compile.*")
        yield

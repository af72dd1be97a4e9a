"""cpkit.testing.upstream_xfail: an upstream defect is expected only in the MCore versions that
have it, and names the one exception it makes a check raise."""

import pytest

from cpkit.testing.upstream_xfail import UpstreamDefect, mcore_has


@pytest.mark.parametrize("first,fixed_in,version,has", [
    (None, None, (0, 16, 1), True),
    (None, "0.19", (0, 16, 1), True),
    (None, "0.19", (0, 18, 9), True),
    (None, "0.19", (0, 19, 0), False),
    (None, "0.19", (0, 19, 2), False),
    ("0.17", None, (0, 16, 1), False),
    ("0.17", None, (0, 17, 0), True),
    ("0.17", None, (0, 19, 2), True),
    ("0.16.1", "0.17", (0, 16, 0), False),
    ("0.16.1", "0.17", (0, 16, 1), True),
    ("0.17", None, (0, 17), True),  # a short version tuple is x.y.0
])
def test_a_defect_is_expected_in_first_up_to_fixed_in(first, fixed_in, version, has):
    assert mcore_has(first, fixed_in, version) is has
    defect = UpstreamDefect("MCore x.py::f is off by 2 at cp2", first=first, fixed_in=fixed_in)
    assert (defect.expected(version) is defect) is has


def test_the_reason_names_the_versions_and_the_expected_exception():
    text = str(UpstreamDefect("MCore x.py::f", first="0.17"))
    assert "MCore x.py::f" in text and ">=0.17" in text and "AssertionError" in text
    assert UpstreamDefect("r", fixed_in="0.19").versions == "<0.19"
    assert UpstreamDefect("r").versions == "all"


@pytest.mark.parametrize("raises", [None, "AssertionError", AssertionError("x"), int])
def test_raises_must_be_an_exception_class(raises):
    with pytest.raises(TypeError, match="must be an exception class"):
        UpstreamDefect("r", raises=raises)


def test_an_empty_reason_is_refused():
    with pytest.raises(ValueError, match="reason is empty"):
        UpstreamDefect("  ")


def test_the_default_expects_a_check_that_failed_not_any_exception():
    defect = UpstreamDefect("r")
    assert defect.raises is AssertionError
    from cpkit.errors import CPConfigError

    assert not issubclass(CPConfigError, defect.raises)

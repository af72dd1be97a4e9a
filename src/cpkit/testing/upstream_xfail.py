"""Known upstream defects as strict xfails that expect one exception, in the versions that have them.

An `UpstreamDefect` is what a grid's `xfail(case)` callable returns for a case that fails because
of an upstream library (MCore), not cpkit: the reason (the upstream symbol, the smallest
counterexample, the ratio measured), the exception the check raises because of it (`raises`,
AssertionError: what `CaseResult.check()` raises for a numeric mismatch on every failing rank)
and the MCore versions that have it (`first`, `fixed_in`). `grid_params` turns it into
`pytest.mark.xfail(strict=True, reason=..., raises=...)`, so a case that fails for another reason
(a CPConfigError, a crash, a launch timeout, a case that did not run: `CaseResult.check()` raises
a non-AssertionError for those) fails the run instead of counting as the expected failure, and a
case that passes fails it too (strict).

`UpstreamDefect.expected()` is the defect where the installed MCore has it and None elsewhere:
an xfail that holds for a version range turns into a plain test outside it, so a fix upstream
or a regression shows on the version that has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["UpstreamDefect", "mcore_has"]


def _parse(version: str) -> tuple[int, ...]:
    from cpkit.compat import _parse as parse  # the one parser of MCore versions

    return (parse(version) + (0, 0, 0))[:3]  # "0.19" is 0.19.0


def mcore_has(first: Optional[str], fixed_in: Optional[str], version: Optional[tuple[int, ...]] = None) -> bool:
    """True when MCore `version` (default: the installed one) is in [first, fixed_in): at least
    `first` (None: every version) and below `fixed_in` (None: not fixed yet)."""
    if version is None:
        from cpkit.compat import MCORE_VERSION

        version = MCORE_VERSION
    version = (tuple(version) + (0, 0, 0))[:3]
    return (first is None or version >= _parse(first)) and (fixed_in is None or version < _parse(fixed_in))


@dataclass(frozen=True)
class UpstreamDefect:
    """A known upstream defect that makes a check fail (see the module docstring)."""

    reason: str
    """The upstream symbol (path::symbol), what it does wrong, the smallest counterexample and
    the measured ratio; shown as the xfail's reason."""
    first: Optional[str] = None
    """The first MCore version known to have it (None: every version cpkit runs)."""
    fixed_in: Optional[str] = None
    """The first MCore version without it (None: not fixed)."""
    raises: type = AssertionError
    """The exception the check raises because of it; the strict xfail accepts only this."""

    def __post_init__(self):
        if not (isinstance(self.raises, type) and issubclass(self.raises, BaseException)):
            raise TypeError(f"UpstreamDefect.raises={self.raises!r}: must be an exception class, e.g. AssertionError")
        if not self.reason.strip():
            raise ValueError("UpstreamDefect.reason is empty: name the upstream symbol and the counterexample")

    def expected(self, version: Optional[tuple[int, ...]] = None) -> Optional["UpstreamDefect"]:
        """self where MCore `version` (default: the installed one) has the defect, else None."""
        return self if mcore_has(self.first, self.fixed_in, version) else None

    @property
    def versions(self) -> str:
        """The MCore versions that have it, as a requirement string ('>=0.17', '<0.19', 'all')."""
        parts = ([f">={self.first}"] if self.first else []) + ([f"<{self.fixed_in}"] if self.fixed_in else [])
        return ",".join(parts) or "all"

    def __str__(self) -> str:
        return f"{self.reason} [MCore {self.versions}; expects {self.raises.__name__}]"

"""The one error type for bad CP configuration or input."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["CPConfigError", "Violation"]


@dataclass(frozen=True)
class Violation:
    """One violated constraint: which field, its value, what is required, how to fix it."""

    field: str
    value: Any
    constraint: str
    fix: str

    @property
    def message(self) -> str:
        return f"{self.field}={self.value!r}: {self.constraint}; fix: {self.fix}"

    def to_dict(self) -> dict:
        return {"field": self.field, "value": _jsonable(self.value), "message": self.message}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


class CPConfigError(ValueError):
    """Raised for bad CP configuration; lists every violation at once.

    `.violations` holds all of them; `.field` and `.value` are the first one's, for the common
    single-violation case.
    """

    def __init__(self, violations: Iterable[Violation] | str):
        if isinstance(violations, str):
            # MCore's build_module re-raises `type(e)(f"{e} when instantiating X")` while the
            # original is being handled: keep the original's violations and MCore's message.
            handled = sys.exc_info()[1]
            self.violations = list(getattr(handled, "violations", None) or [])
            first = self.violations[0] if self.violations else None
            self.field = getattr(first, "field", None)
            self.value = getattr(first, "value", None)
            super().__init__(violations)
            return
        self.violations = list(violations)
        if not self.violations:
            raise ValueError("CPConfigError needs at least one Violation")
        self.field = self.violations[0].field
        self.value = self.violations[0].value
        lines = "\n".join(f"  - {v.message}" for v in self.violations)
        n = len(self.violations)
        super().__init__(f"{n} CP configuration error{'s' if n > 1 else ''}:\n{lines}")

    @classmethod
    def single(cls, field: str, value: Any, constraint: str, fix: str) -> "CPConfigError":
        return cls([Violation(field, value, constraint, fix)])

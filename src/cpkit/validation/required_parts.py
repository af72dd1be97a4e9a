"""Whether the GPU proof tested everything it should (scripts/gpu-proof.sh): a run is not a pass
when a required part did not run, even if every test that did run passed.

A part did not run when the set-up says it is absent (te-install.sh failed, an upstream archive
was not carried) or when a test skipped for it: pytest's own skip reason names the missing
dependency ("Transformer Engine is not importable", "CPKIT_MLM_SRC is not set", ...). A skip that
names no dependency (a case outside a window, a GPU count) is the test's own business.

    violations(junit, optional=parse_optional("te,upstream"), absent={"mlm": "no archive"})

Budget overruns are reported, and fail the run only when asked (`fail_over_budget`): a loaded
host runs slower without testing less.
"""

from __future__ import annotations

import gzip
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

__all__ = ["PARTS", "ALIASES", "OPTIONAL_ENV", "parse_optional", "missing_dependency_skips", "violations",
           "setup_violations", "main"]

OPTIONAL_ENV = "CPKIT_OPTIONAL"


@dataclass(frozen=True)
class Part:
    title: str
    skip_reasons: tuple[str, ...]  # regexes over a skip message that mean "this part is missing"


#: Each part the proof requires, with the skip reasons (from the code that skips) that name it.
PARTS = {
    "te": Part("Transformer Engine", (r"Transformer Engine is not importable",)),
    "mlm": Part("Megatron-LM checkout (CPKIT_MLM_SRC)", (r"CPKIT_MLM_SRC",)),
    "bridge": Part("Megatron-Bridge checkout (CPKIT_BRIDGE_SRC)", (r"CPKIT_BRIDGE_SRC", r"Megatron-Bridge not found")),
    "mcore": Part("megatron-core", (r"could not import 'megatron",)),
    "kernels": Part("cuDNN frontend (cpkit[kernels])", (r"nvidia-cudnn-frontend is not importable",)),
    "fla": Part("flash-linear-attention (fla)", (r"flash-linear-attention \(fla\) is not importable",
                                                  r"flash-linear-attention is not installed")),
}
#: Names that stand for several parts.
ALIASES = {"upstream": ("mlm", "bridge")}
#: Any other skip that says a dependency is missing; it counts as the part "other".
OTHER_MISSING = re.compile(r"could not import|not importable|is not installed|No module named")


class RequiredPartsError(ValueError):
    """A bad optional-parts list, said with the field, the value, the constraint and a fix."""


def parse_optional(text: str | Iterable[str] | None, field: str = OPTIONAL_ENV) -> frozenset[str]:
    """The parts named optional: a comma list of PARTS keys, ALIASES, "other" or "all"."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text or ()) if n.strip()]
    known = sorted([*PARTS, *ALIASES, "other", "all"])
    parts: set[str] = set()
    for name in names:
        if name == "all":
            parts |= {*PARTS, "other"}
        elif name in ALIASES:
            parts |= set(ALIASES[name])
        elif name in PARTS or name == "other":
            parts.add(name)
        else:
            raise RequiredPartsError(f"{field}={','.join(names)}: {name!r} is not a part; it must be one of "
                                     f"{', '.join(known)} (comma-separated); fix: e.g. {field}=te,upstream")
    return frozenset(parts)


def _part_of(message: str) -> str | None:
    for key, part in PARTS.items():
        if any(re.search(pattern, message) for pattern in part.skip_reasons):
            return key
    return "other" if OTHER_MISSING.search(message) else None


def missing_dependency_skips(junit: str | Path) -> list[tuple[str, str, str]]:
    """(part, test id, skip message) of every test in the junit file that skipped for a missing
    dependency (xfails are not skips). Raises ValueError naming the file when it is no junit file."""
    path = Path(junit)
    try:
        top = ET.parse(gzip.open(path) if path.name.endswith(".gz") else path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise ValueError(f"{path}: not a readable junit XML file ({exc}); fix: pass pytest's --junitxml output") from None
    found = []
    for case in top.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or skipped.get("type") == "pytest.xfail":
            continue
        message = skipped.get("message", "") or (skipped.text or "")
        part = _part_of(message)
        if part is not None:
            found.append((part, f"{case.get('classname', '')}::{case.get('name', '')}", message))
    return found


_FIX = "fix: carry its files (scripts/GPU_CI.md), or name it optional: --optional {}"


def _title(part: str) -> str:
    return PARTS[part].title if part in PARTS else "another dependency"


def setup_violations(absent: Mapping[str, str], optional: Iterable[str] = ()) -> list[str]:
    """The required parts the set-up lacks, one line each (the proof stops before its tier on them:
    minutes of GPU time for a run that cannot pass)."""
    optional = parse_optional(list(optional), field="optional")
    out = []
    for part, why in sorted(absent.items()):
        if part not in PARTS:
            raise RequiredPartsError(f"absent: {part!r} is not a part; it must be one of {', '.join(PARTS)}")
        if part not in optional:
            out.append(f"{_title(part)} [{part}] is required and missing in the set-up: {why} ({_FIX.format(part)})")
    return out


def violations(junit: str | Path | Iterable[str | Path], optional: Iterable[str] = (), *,
               absent: Mapping[str, str] | None = None, over_budget: Iterable[str] = (),
               fail_over_budget: bool = False) -> list[str]:
    """Why the run does not pass, one line each; [] when it passes.

    junit: the run's pytest junit XML, or several (the proof's tiers, read together); optional:
    parts that may be missing (parse_optional's names); absent: part -> why the set-up lacks it;
    over_budget: the budgets the run overran, a violation only with fail_over_budget."""
    optional = parse_optional(list(optional), field="optional")
    out = setup_violations(absent or {}, optional)
    by_part: dict[str, list[tuple[str, str]]] = {}
    for path in [junit] if isinstance(junit, (str, Path)) else junit:
        for part, test, message in missing_dependency_skips(path):
            by_part.setdefault(part, []).append((test, message))
    for part, skips in sorted(by_part.items()):
        if part not in optional:
            test, message = skips[0]
            out.append(f"{_title(part)} [{part}] is required: {len(skips)} test(s) skipped for it, "
                       f"e.g. {test}: {message[:200]} ({_FIX.format(part)})")
    if fail_over_budget:
        out += [f"over budget: {name}" for name in over_budget]
    return out


def main(argv=None) -> int:
    """`python -m cpkit.validation.required_parts --optional PARTS --absent PART=WHY ...`: print the
    required parts the set-up lacks; exit 1 when there is one, 2 on a bad argument."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m cpkit.validation.required_parts", allow_abbrev=False,
                                     description="the required parts a GPU proof's set-up lacks")
    parser.add_argument("--optional", default="", help="parts that may be missing (comma list)")
    parser.add_argument("--absent", action="append", default=[], metavar="PART=WHY", help="a part the set-up lacks")
    args = parser.parse_args(argv)
    try:
        problems = setup_violations(dict(a.split("=", 1) for a in args.absent), parse_optional(args.optional, "--optional"))
    except (RequiredPartsError, ValueError) as exc:
        print(f"required_parts: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"- {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

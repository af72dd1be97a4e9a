"""`python -m cpkit.bench <name> [options]`: run one benchmark (the `main` of BENCHMARKS[name]).

`--help` lists every benchmark with the first line of its docstring, read from the source so
that the list imports neither torch nor megatron-core; a misspelled name is argparse's
"invalid choice". `python -m cpkit.bench <name> --help` gives that benchmark's own options."""

import argparse
import ast
import importlib
import importlib.util
import sys

from cpkit.notices import quiet_known_notices

#: Each benchmark's name -> its module, grouped per feature like the product (cpkit.bench.<feature>).
BENCHMARKS = {
    "attention": "cpkit.bench.attention.attention",
    "window": "cpkit.bench.attention.window",
    "eval_cp": "cpkit.bench.eval_cp.eval_cp",
    "scheduler": "cpkit.bench.dynamic.scheduler",
    "calibrate": "cpkit.bench.dynamic.calibrate",
    "replay": "cpkit.bench.dynamic.replay",
    "dynamic_step": "cpkit.bench.dynamic.dynamic_step",
    "link": "cpkit.bench.dynamic.link",
    "hybrid": "cpkit.bench.hybrid.gdn_layer",
    "changed_recall": "cpkit.bench.validation.changed_recall",
    "changed_samples": "cpkit.bench.validation.changed_samples",
}


def describe(name: str) -> str:
    """The first line of benchmark `name`'s module docstring, without its leading command."""
    spec = importlib.util.find_spec(BENCHMARKS[name])
    with open(spec.origin, encoding="utf-8") as fh:
        doc = ast.get_docstring(ast.parse(fh.read())) or ""
    first = doc.splitlines()[0] if doc else ""
    return first.split("`: ", 1)[-1] if first.startswith("`") else first


def build_parser() -> argparse.ArgumentParser:
    """The parser of the benchmark name: choices BENCHMARKS, each described in --help."""
    listing = "\n".join(f"  {name:<13} {describe(name)}" for name in BENCHMARKS)
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m cpkit.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one benchmark: it prints a table and writes JSON under bench-results/.",
        epilog=f"benchmarks:\n{listing}\n\n`python -m cpkit.bench NAME --help` lists a benchmark's options.")
    parser.add_argument("benchmark", choices=BENCHMARKS, metavar="NAME", help=f"one of {', '.join(BENCHMARKS)}")
    return parser


def main(argv=None) -> int:
    """Run the benchmark named by argv[0] with the rest of argv; usage errors exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        build_parser().parse_args(argv[:1] or [])  # --help, or "invalid choice" / "required": exits
        return 2
    quiet_known_notices()  # before a benchmark imports megatron-core
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m cpkit.bench <name> [options]`: run one benchmark (cpkit.bench.<name>.main)."""

import importlib
import sys

from cpkit.notices import quiet_known_notices

BENCHMARKS = ["attention", "scheduler", "eval_cp", "calibrate", "window", "replay", "dynamic_step", "link", "changed_recall"]


def main(argv=None) -> int:
    quiet_known_notices()  # before a benchmark imports megatron-core
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m cpkit.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"cpkit.bench.{argv[0]}").main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks: `python -m cpkit.bench <name>` prints a table and writes JSON."""

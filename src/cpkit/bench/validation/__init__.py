"""Benchmarks of the validation tooling: `changed_recall` and `changed_samples` (what
`cpkit validate --changed` catches and what it costs)."""

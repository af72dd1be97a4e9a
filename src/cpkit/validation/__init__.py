"""Validation tooling: what to run for a change, and what the results say. Not part of what a
training loop imports (and not the validation of a layout: that is cpkit.parallel.layout).

- Selecting tests: `change_map` (paths -> test files, and the validating skill's table),
  `import_graph` and `symbol_graph` (read with `ast`), `coverage_map` and `coverage_record` (the
  measured map), `code_hashes`, `changed_selection` (what `cpkit validate --changed` runs).
- Running and judging them: `pytest_runner`, `junit` (reading a run's junit file), `mutants`
  (faults for mutation testing), `proof_report` (the GPU proof's report), `repo` (the repository
  a command works on).
- Checking cards and skills against the code: `anchors` (`path::symbol` references),
  `strict_yaml` (their loader).

It stands on the product and the harness; the commands, cards and skills checks stand on it
(`LAYERS` in import_graph, held by tests/test_import_graph.py).
"""

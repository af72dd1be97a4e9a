"""The scenarios of the functional tests, importable: functional/test_<name>.py and
`python -m cpkit.cluster` run the same functions (one per check), never copies.

Each module has a scenario function taking one case (a dict with "id") and run on every rank of
a launch, `cases(backend, world_size)` (the functional grid) and `cluster_cases(...)` (cases for
the world size and nodes of a torchrun job). They build the small test models of cpkit.testing.models.
"""

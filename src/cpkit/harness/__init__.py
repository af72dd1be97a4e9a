"""The multi-rank harness: runs code on many ranks, for the tests, the benchmarks and the
examples' plain-`python` mode. Not part of what a training loop imports.

- `launch`: run a callable on N spawned ranks (gloo on CPU, NCCL with one GPU per rank), with a
  timeout, the failing rank's traceback and a hung rank's stack; `grid`, `rank_pool`,
  `rank_worker`, `pool_groups`: grids of cases on persistent rank pools.
- `rendezvous`, `rank_stderr`, `gpu_claim`, `launch_times`: start-up retries, each rank's stderr,
  host-wide GPU claims, the timing table.
- `children`: processes a test run starts that must end with it (torchrun launches);
  `attribution`: which test a rank's work belongs to (for the coverage map).

The harness stands on the product and never the other way round; the validation tooling stands on
both (src/cpkit/validation/import_graph.py::LAYERS, held by tests/test_import_graph.py).
"""

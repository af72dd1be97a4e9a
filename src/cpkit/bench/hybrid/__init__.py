"""Benchmarks of hybrid-model CP: `hybrid` (a gated delta net layer under CP against one GPU, and the layout transition)."""

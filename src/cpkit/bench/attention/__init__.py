"""Benchmarks of CP attention: `attention` (cpkit vs TE, torch CP and one GPU's SDPA; dense and
features) and `window` (sliding-window compute per rank)."""

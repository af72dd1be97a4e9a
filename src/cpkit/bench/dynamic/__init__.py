"""Benchmarks of dynamic CP: the step model's inputs (`calibrate`, `link`), the modeled plans
(`scheduler`), replays on one GPU (`replay`) and real training steps (`dynamic_step`)."""

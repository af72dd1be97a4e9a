"""Benchmarks of eval-time CP: `eval_cp` (evaluate() at the training layout vs a higher eval CP)."""

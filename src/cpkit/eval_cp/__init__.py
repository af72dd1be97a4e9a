"""Eval-time CP: evaluate at a different CP degree than training by rebinding the process-group
references cached on every module, then restoring them exactly.

`context.py` (`eval_cp_context`, `build_eval_pg_collection`, `evaluate`), `rebind.py` (finding
and swapping cached group references), `loop.py` (the eval loop over eval-DP shards) and
`plan.py` (`cpkit plan eval-cp`: the eval layout and its cost, no torch).
"""

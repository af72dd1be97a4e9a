"""CP for hybrid models: attention layers in zigzag, recurrent layers (gated delta net) in
contiguous, and the routes between the two layouts.

`layout.py` (CpPartitionMode, build_routes, relayout: one differentiable all-to-all per
transition, routes computed once per batch) and `gdn.py` (the gated delta rule, chunked, under CP
in Megatron-LM's two modes: chunkwise state passing and headwise all-to-all).
"""

"""CP for hybrid models: attention layers in zigzag, recurrent layers (gated delta net, Mamba-2)
in contiguous, and the routes between the two layouts.

`layout.py` (CpPartitionMode, build_routes, relayout: one differentiable all-to-all per
transition, routes computed once per batch); `gdn.py` (the gated delta rule, chunked in
`delta_rule.py`) and `mamba.py` (Mamba-2's SSD scan, chunked in `ssd.py`) under CP in Megatron-LM's
two modes, chunkwise state passing and headwise all-to-all, on the collectives of `recurrent_cp.py`;
`model.py`, a small hybrid model of them.
"""

"""Hierarchical CP (`a2a+p2p`): which layouts are valid and why, how to fix one, and how a layout
maps onto hosts.

`head_rules.py` (the head-count rules of a2a and a2a+p2p), `layout_fixes.py` (the passing layouts
`cpkit layout check` suggests), `topology.py` (a2a inside a host, p2p across). The layout and its
groups are the shared base (`cpkit.parallel`); the a2a+p2p attention is
`cpkit.attention.hierarchical`.
"""

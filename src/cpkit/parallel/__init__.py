"""The shared base every CP feature stands on: the parallel layout and its process groups.

`layout.py` (`CPLayout`: tp x cp x dp sizes, the comm type, hierarchical sizes, validated before
anything is built), `rank_grid.py` (which ranks share each group: pure arithmetic),
`groups.py` (`build_pg_collection`: MCore's ProcessGroupCollection for a layout, hierarchical
groups included) and `group_info.py` (a group's size, rank and device).
"""

"""The zigzag <-> contiguous routes (src/cpkit/hybrid/layout.py), all ranks simulated in one
process: the indices against a reference written from the definition, every route delivering
each row to the right place, and the errors for lengths the modes cannot split."""

from __future__ import annotations

import pytest
import torch

from cpkit.errors import CPConfigError
from cpkit.hybrid.layout import CpPartitionMode, build_routes, check_partition_lengths, partition_indices
from cpkit.sharding import thd_partition


def reference_indices(mode: str, lens: list[int], cp: int, rank: int) -> list[int]:
    """From the definition: 2*cp chunks per sequence; zigzag takes r and 2cp-1-r, contiguous 2r and 2r+1."""
    out, start = [], 0
    for length in lens:
        c = length // (2 * cp)
        for j in ((rank, 2 * cp - 1 - rank) if mode == "zigzag" else (2 * rank, 2 * rank + 1)):
            out += range(start + j * c, start + (j + 1) * c)
        start += length
    return out


def _cu(lens):
    return [0] + torch.tensor(lens).cumsum(0).tolist()


CASES = [  # (cp, lengths): sbhd (one sequence), empty sequences, length exactly 2*cp, cp 3
    (2, [16]), (4, [64]), (3, [36]),
    (2, [4, 0, 12, 8]), (4, [8, 0, 0, 24, 16]), (3, [6, 18, 0, 12]), (2, [0]),
]


@pytest.mark.parametrize("cp,lens", CASES)
@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
def test_partition_indices_follow_the_definition(cp, lens, mode):
    cu = _cu(lens)
    for rank in range(cp):
        assert partition_indices(mode, cu, rank, cp).tolist() == reference_indices(mode, lens, cp, rank)
    # zigzag is the layout cpkit's attention shards THD batches in
    assert partition_indices("zigzag", cu, 1, cp).tolist() == thd_partition(torch.tensor(cu), 1, cp).tolist()


def _simulate(cu, cp, to):
    """Apply every rank's route as an all-to-all would: rank r's rows in mode `to`."""
    src_mode = "contiguous" if to == "zigzag" else "zigzag"
    routes = [build_routes(cu, r, cp) for r in range(cp)]
    pick = (lambda rt: rt.to_contiguous) if to == "contiguous" else (lambda rt: rt.to_zigzag)
    held = [partition_indices(src_mode, cu, r, cp) for r in range(cp)]  # rows = their global index
    sent = []
    for r in range(cp):
        route = pick(routes[r])
        rows = held[r][route.send_index]
        sent.append(list(torch.split(rows, list(route.send_splits))))
    out = []
    for r in range(cp):
        route = pick(routes[r])
        received = torch.cat([sent[q][r] for q in range(cp)])
        assert [int(sent[q][r].numel()) for q in range(cp)] == list(route.recv_splits)
        local = torch.empty_like(received)
        local[route.recv_index] = received
        out.append(local)
    return out


@pytest.mark.parametrize("cp,lens", CASES)
@pytest.mark.parametrize("to", ["contiguous", "zigzag"])
def test_every_route_delivers_each_row_to_its_place(cp, lens, to):
    cu = _cu(lens)
    got = _simulate(cu, cp, to)
    for rank in range(cp):
        assert got[rank].tolist() == reference_indices(to, lens, cp, rank)


def test_a_route_at_cp_1_keeps_every_row_in_place():
    routes = build_routes([0, 5, 9], 0, 1)
    assert routes.to_contiguous.send_index.tolist() == list(range(9))
    assert routes.to_contiguous.recv_index.tolist() == list(range(9))


def test_lengths_the_modes_cannot_split_are_all_named_with_their_padding():
    with pytest.raises(CPConfigError) as err:
        check_partition_lengths([0, 6, 6, 9, 17], 2)
    messages = [v.message for v in err.value.violations]
    assert len(messages) == 2  # sequences 0 (6) and 2 (3); sequence 1 is empty, sequence 3 is 8
    assert messages[0].startswith("cu_seqlens (sequence 0)=6: zigzag and contiguous need every sequence "
                                  "padded to a multiple of 2*cp = 4; fix: pad sequence 0 by 2 token(s) to 8")
    assert "pad sequence 2 by 1 token(s) to 4" in messages[1]
    # the fix passes the check
    assert check_partition_lengths([0, 8, 8, 12, 20], 2) == [0, 8, 8, 12, 20]
    with pytest.raises(CPConfigError, match="must not decrease"):
        check_partition_lengths([0, 8, 4], 2)
    assert CpPartitionMode("contiguous") is CpPartitionMode.CONTIGUOUS

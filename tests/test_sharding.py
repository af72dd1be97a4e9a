"""cpkit.sharding: MCore/TE load-balanced layout, round trips, THD partition, position ids, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkit.errors import CPConfigError
from cpkit.sharding import (
    check_cu_seqlens,
    gather_seq,
    gather_thd,
    pad_cu_seqlens,
    position_ids,
    shard_seq,
    shard_thd,
    thd_local_cu_seqlens,
    thd_partition,
    thd_position_ids,
    zigzag_indices,
)
from cpkit.testing.reference import reference_shard


def _te_partition(cu: list[int], rank: int, cp: int) -> list[int]:
    """TE's thd_partition_indices_kernel transcribed token by token (the layout to match)."""
    cu_s = [c // cp for c in cu]
    out = []
    for token in range(cu[-1] // cp):
        seq = max(i for i in range(len(cu_s) - 1) if cu_s[i] <= token)
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + cu_s[seq] * cp + seq_len // 2 * offset)
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_seq_matches_mcore_get_batch_on_this_cp_rank(cp, monkeypatch, world1):
    from cpkit.compat import mcore_batch_on_this_cp_rank

    class _Group:  # MCore reads size and rank through torch.distributed (0.19) or the group (0.16)
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return cp

        def rank(self):
            return self._rank

    real_size, real_rank = torch.distributed.get_world_size, torch.distributed.get_rank
    monkeypatch.setattr(torch.distributed, "get_world_size",
                        lambda group=None: group.size() if isinstance(group, _Group) else real_size(group))
    monkeypatch.setattr(torch.distributed, "get_rank",
                        lambda group=None: group.rank() if isinstance(group, _Group) else real_rank(group))
    tokens = torch.arange(3 * 32).view(3, 32)  # [b, s]: MCore's batch layout
    for rank in range(cp):
        expected = mcore_batch_on_this_cp_rank({"tokens": tokens.clone()}, _Group(rank))["tokens"]
        assert torch.equal(shard_seq(tokens, rank, cp, seq_dim=1), expected)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("layout,seq_dim", [("sbhd", 0), ("bshd", 1)])
def test_shard_gather_round_trip(cp, layout, seq_dim):
    x = torch.randn(16, 3, 2, 5) if layout == "sbhd" else torch.randn(3, 16, 2, 5)
    shards = [shard_seq(x, r, cp, seq_dim) for r in range(cp)]
    assert all(s.shape[seq_dim] == 16 // cp for s in shards)
    assert torch.equal(gather_seq(shards, seq_dim), x)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_indices_and_position_ids_follow_the_shards(cp):
    for rank in range(cp):
        expected = shard_seq(torch.arange(24 if cp != 4 else 32), rank, cp, seq_dim=0)
        seq_len = expected.numel() * cp
        assert torch.equal(zigzag_indices(seq_len, rank, cp), expected)
        assert torch.equal(position_ids(seq_len, rank, cp), expected)
    assert zigzag_indices(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_pad_cu_seqlens_pads_each_sequence_to_2cp():
    assert pad_cu_seqlens([5, 8, 1, 0], 2).tolist() == [0, 8, 16, 20, 20]
    assert pad_cu_seqlens(torch.tensor([3, 6]), 1).tolist() == [0, 4, 10]
    assert pad_cu_seqlens([1], 4).dtype == torch.int32


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_partition_matches_te_kernel(cp):
    cu = pad_cu_seqlens([13, 1, 40, 0, 7], cp)
    for rank in range(cp):
        got = thd_partition(cu, rank, cp)
        if cp > 1:
            assert got.tolist() == _te_partition(cu.tolist(), rank, cp)
        assert got.numel() == int(cu[-1]) // cp
    union = torch.cat([thd_partition(cu, r, cp) for r in range(cp)]).sort().values
    assert torch.equal(union, torch.arange(int(cu[-1])))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_round_trip_local_cu_and_position_ids(cp):
    cu = pad_cu_seqlens([13, 40, 7], cp)
    total = int(cu[-1])
    x = torch.randn(total, 3, 4)
    shards = [shard_thd(x, cu, r, cp) for r in range(cp)]
    assert torch.equal(gather_thd(shards, cu), x)
    # [1, t] token tensors shard along dim 1
    tokens = torch.arange(total).view(1, total)
    assert torch.equal(shard_thd(tokens, cu, 0, cp, seq_dim=1)[0], thd_partition(cu, 0, cp))
    local_cu = thd_local_cu_seqlens(cu, cp)
    assert local_cu.tolist() == [c // cp for c in cu.tolist()]
    starts = cu.tolist()
    for r in range(cp):
        index = thd_partition(cu, r, cp).tolist()
        expected = [i - max(s for s in starts[:-1] if s <= i) for i in index]
        assert thd_position_ids(cu, r, cp).tolist() == expected


@settings(max_examples=25, deadline=None)
@given(cp=st.sampled_from([1, 2, 4, 8]), lens=st.lists(st.integers(0, 50), min_size=1, max_size=6),
       rank_seed=st.integers(0, 7))
def test_thd_partition_property(cp, lens, rank_seed):
    cu = pad_cu_seqlens(lens, cp)
    rank = rank_seed % cp
    index = thd_partition(cu, rank, cp)
    if cp > 1:
        assert index.tolist() == _te_partition(cu.tolist(), rank, cp)
    shards = [shard_thd(torch.arange(int(cu[-1])), cu, r, cp) for r in range(cp)]
    assert torch.equal(gather_thd(shards, cu), torch.arange(int(cu[-1])))


def test_seq_not_divisible_by_2cp_raises_config_error():
    with pytest.raises(CPConfigError, match=r"divisible by 2\*cp = 4") as info:
        shard_seq(torch.zeros(6, 2), 0, 2, seq_dim=0)
    assert isinstance(info.value, ValueError)
    assert info.value.field == "x.shape[0]" and info.value.value == 6
    assert "pad the sequence by 2" in str(info.value)
    with pytest.raises(CPConfigError, match=r"divisible by 2\*cp = 8"):
        zigzag_indices(12, 0, 4)


def test_thd_lengths_not_padded_raise_config_error():
    with pytest.raises(CPConfigError, match=r"sequence 1.*multiple of 2\*cp = 4.*pad_cu_seqlens"):
        thd_partition(torch.tensor([0, 8, 14]), 0, 2)
    with pytest.raises(CPConfigError, match=r"cu_seqlens\[0\]"):
        check_cu_seqlens(torch.tensor([2, 8]), 2)
    with pytest.raises(CPConfigError, match="1-D"):
        check_cu_seqlens(torch.tensor([[0, 8]]), 2)


def test_bad_cp_rank_or_size_raise_config_error():
    with pytest.raises(CPConfigError, match="cp_rank"):
        shard_seq(torch.zeros(8), 2, 2, seq_dim=0)
    with pytest.raises(CPConfigError, match="cp_size"):
        zigzag_indices(8, 0, 0)


def test_zero_length_thd_sequences_are_valid_and_hold_no_tokens():
    cu = torch.tensor([0, 8, 8, 16], dtype=torch.int32)  # the middle sequence is empty
    assert check_cu_seqlens(cu, 2) == [0, 8, 8, 16]
    idx = [thd_partition(cu, r, 2).tolist() for r in range(2)]
    assert idx == [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]
    x = torch.arange(16.0)
    assert torch.equal(gather_thd([shard_thd(x, cu, r, 2) for r in range(2)], cu), x)


@pytest.mark.parametrize("cp_rank", [-1, 2, 5])
def test_thd_partition_rejects_a_cp_rank_outside_the_group(cp_rank):
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(CPConfigError) as err:
        thd_partition(cu, cp_rank, 2)
    v = err.value.violations[0]
    assert (v.field, v.value) == ("cp_rank", cp_rank)
    assert "must be an int in [0, cp_size=2)" in v.constraint


def test_decreasing_offsets_are_named_as_such():
    with pytest.raises(CPConfigError) as err:
        check_cu_seqlens(torch.tensor([0, 8, 4]), 2)
    v = err.value.violations[0]
    assert (v.field, v.value) == ("cu_seqlens (sequence 1)", -4)
    assert v.constraint == "offsets must not decrease (8 -> 4)" and "cumulative" in v.fix


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_agree_with_the_plain_reference_slicing(cp):
    # The dist tiers slice their references with reference_shard (no cpkit.sharding code): the
    # two must agree, for sbhd and for THD with an empty sequence.
    x = torch.randn(8 * cp, 2, 3)
    cu = pad_cu_seqlens([13, 0, 40, 7], cp)
    t = torch.randn(int(cu[-1]), 3)
    for r in range(cp):
        assert torch.equal(reference_shard(x, r, cp), shard_seq(x, r, cp, seq_dim=0))
        assert torch.equal(reference_shard(t, r, cp, cu), shard_thd(t, cu, r, cp))


def test_offsets_copied_to_a_device_are_checked_from_their_host_values_without_a_device_read():
    """offsets_to keeps the host values on the device tensor, so the offset check (once per
    micro-batch in a training step) needs no device-to-host sync. The meta device has no data:
    reading it back raises, so a check that reads the device fails here."""
    from cpkit.sharding import check_cu_seqlens, offsets_to

    host = pad_cu_seqlens([5, 3], 2)
    on_meta = offsets_to(host, "meta")
    assert on_meta.device.type == "meta" and on_meta.dtype == host.dtype
    assert check_cu_seqlens(on_meta, 2) == host.tolist()
    assert thd_partition(offsets_to(host, "cpu"), 0, 2).tolist() == thd_partition(host, 0, 2).tolist()
    with pytest.raises(CPConfigError, match=r"cu_seqlens \(sequence 1\)=4: .*multiple of 2\*cp = 8"):
        check_cu_seqlens(on_meta, 4)  # the same checks, on the kept values
    on_meta.add_(0)  # changed in place: the kept values may be stale, so the device is read
    with pytest.raises((NotImplementedError, RuntimeError)):
        check_cu_seqlens(on_meta, 2)

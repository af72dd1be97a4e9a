"""Sliding-window liveness of ring blocks (`cpkit.attention.band.Band.live`) against a dense
brute force, and the ring's skipping of dead blocks (`cpkit.attention.p2p`).

The brute force places every rank's tokens with the sharding functions (`shard_seq`,
`thd_partition`), builds the dense window mask of two ranks' tokens (same sequence, causal or
two-sided window) and asks `.any()`; Band must agree for every (rank, src) pair.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkit.attention import band as band_mod
from cpkit.attention import p2p
from cpkit.attention.band import Band, Window, check_window
from cpkit.attention.chunks import local_seq
from cpkit.sharding import shard_seq, thd_partition

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)


def _thd_seq(chunks: list[int], n: int):
    """A THD level of n ranks whose sequences have the given chunk lengths (length 2n * chunk)."""
    lens = [2 * n * c for c in chunks]
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    return local_seq(int(cu[-1]) // n, n, cu, max(2 * n, max(lens))), cu


def _positions(n: int, rank: int, cu=None, tokens: int = 0):
    """(global position, sequence id) of `rank`'s tokens, from the sharding functions."""
    if cu is None:
        return shard_seq(torch.arange(tokens), rank, n, seq_dim=0), torch.zeros(tokens // n, dtype=torch.int64)
    index = thd_partition(cu, rank, n)
    return index, torch.searchsorted(cu, index, right=True) - 1


def _brute_live(window: Window, causal: bool, q, k) -> bool:
    (qi, qs), (ki, ks) = q, k
    diff = qi.view(-1, 1) - ki.view(1, -1)
    ok = qs.view(-1, 1) == ks.view(1, -1)
    if causal:
        ok &= diff >= 0
    if window.left is not None:
        ok &= diff <= window.left
    if window.right is not None:
        ok &= diff >= -window.right
    return bool(ok.any())


_windows = st.tuples(st.integers(-1, 20), st.integers(-1, 20), st.booleans()).map(
    lambda w: (check_window(w[:2], w[2]), w[2])).filter(lambda w: w[0] is not None)


def _check_all_pairs(seq, n, window, causal, cu=None):
    for rank in range(n):
        band = Band(window, causal, seq, rank, "cpu")
        q = _positions(n, rank, cu, seq.tokens * n)
        for src in range(n):
            want = src == rank or _brute_live(window, causal, q, _positions(n, src, cu, seq.tokens * n))
            assert band.live(src) == want, (rank, src)
            assert (band.block(src) is None) == (not want), (rank, src)


@PROPERTY
@given(n=st.integers(1, 4), chunks=st.lists(st.integers(0, 7), min_size=1, max_size=6), w=_windows)
def test_thd_liveness_is_the_dense_mask_any(n, chunks, w):
    """Random packings (empty sequences included), windows, causal or two-sided, cp 1..4: a
    block is live iff some query sees some key of the same sequence."""
    window, causal = w
    seq, cu = _thd_seq(chunks, n)
    _check_all_pairs(seq, n, window, causal, cu)


@PROPERTY
@given(n=st.integers(1, 4), chunk=st.integers(0, 12), w=_windows)
def test_sbhd_liveness_is_the_dense_mask_any(n, chunk, w):
    window, causal = w
    seq = local_seq(2 * chunk if n > 1 else chunk, n)
    _check_all_pairs(seq, n, window, causal)


@PROPERTY
@given(n=st.integers(2, 4), chunks=st.lists(st.integers(0, 7), min_size=1, max_size=6), w=_windows)
def test_the_last_ring_step_is_live_for_some_rank(n, chunks, w):
    """Why the ring never stops early: at forward step n-1 (src = rank + 1) rank 0's chunk 2n-1
    meets chunk 2n-2, adjacent, so some rank needs that step whenever the window reaches a
    neighbouring token (it is dead for every rank only when a query sees itself alone)."""
    window, causal = w
    seq, _ = _thd_seq(chunks, n)
    reaches = (window.left is None or window.left >= 1) or (not causal and (window.right is None or window.right >= 1))
    last = any(Band(window, causal, seq, r, "cpu").live((r + 1) % n) for r in range(n))
    assert last == (reaches and max(chunks) > 0)


def test_thd_liveness_is_read_from_the_device_once_per_band(monkeypatch):
    """One vectorised computation (one device-to-host copy) serves every src of a Band, forward
    and backward; sbhd and one rank compute nothing on tensors of the batch."""
    calls = []
    real = band_mod._visible_offsets
    monkeypatch.setattr(band_mod, "_visible_offsets", lambda *a: calls.append(a[0].device) or real(*a))
    seq, _ = _thd_seq([3, 0, 5, 1], 4)
    band = Band(Window(2, None), True, seq, 1, "cpu")
    for _ in range(2):
        assert [band.live(s) for s in range(4)] == [True, True, True, True]
        assert all(band.block(s) is not None for s in range(4))
    assert len(calls) == 1
    one_rank, _ = _thd_seq([3, 5], 1)
    assert Band(Window(2, None), True, one_rank, 0, "cpu").block(0) is not None and len(calls) == 1


def test_grid_thd_window_cases_skip_blocks_that_only_long_sequences_would_skip():
    """The functional grid's THD window cases at cp=4: ranks 0 and 3 skip each other, while
    ranks 0-2 and 1-3 are live only through the shorter sequences (a liveness test that looked
    at the long ones alone would skip them and fail the grid's comparison)."""
    from functional.test_attention_features import THD_WINDOW_LENS, _feature_cases

    from cpkit.sharding import pad_cu_seqlens

    n = 4
    for feature in ("window-causal", "window-two-sided"):
        (case,) = _feature_cases(feature, "thd")
        window = check_window(case["window"], case["causal"])

        def live(lens):
            cu = pad_cu_seqlens(lens, n).long()
            seq = local_seq(int(cu[-1]) // n, n, cu, 64)
            return [[Band(window, case["causal"], seq, r, "cpu").live(s) for s in range(n)] for r in range(n)]

        grid = live(THD_WINDOW_LENS)
        assert not grid[0][3] and not grid[3][0], feature
        assert grid[0][2] and grid[1][3], feature
        long_only = live([x for x in THD_WINDOW_LENS if x >= 45])
        assert not long_only[0][2] and not long_only[1][3], feature


class _Loopback:
    """A ring of `size` whose exchanges hand back what was sent: the numbers are not a ring's,
    but every step runs, so the blocks computed per step can be counted."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def exchange(self, send, recv, reverse=False):
        recv.copy_(send)
        return self

    def wait(self):
        return None


@pytest.mark.parametrize("thd", [False, True])
def test_ring_computes_live_blocks_only(monkeypatch, thd):
    """cp=4, causal window 5: rank 0 computes its own block and rank 1's, forward and backward,
    and nothing for ranks 2 and 3 (sbhd s = 48; THD sequences of 48 and 64 tokens)."""
    counts = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = p2p._attend_fwd, p2p._attend_bwd

    def fwd(*a):
        counts["fwd"] += 1
        return real_fwd(*a)

    def bwd(*a):
        counts["bwd"] += 1
        return real_bwd(*a)

    monkeypatch.setattr(p2p, "_attend_fwd", fwd)
    monkeypatch.setattr(p2p, "_attend_bwd", bwd)
    n, rank, window = 4, 0, Window(5, None)
    if thd:
        seq, _ = _thd_seq([6, 8], n)
        lead = (seq.tokens,)
    else:
        seq = local_seq(12, n)
        lead = (12, 2)
    band = Band(window, True, seq, rank, "cpu")
    assert [band.live(s) for s in range(n)] == [True, True, False, False]
    assert [p2p._skipped(p2p._block_case(s, rank, True, band)) for s in range(n)] == [False, False, True, True]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*lead, 2, 8, generator=gen) for _ in range(3))
    comm = _Loopback(n, rank)
    out, lse, kv = p2p.ring_forward(q, k, v, comm, True, 0.3, seq, band=band)
    dq, dk, dv = p2p.ring_backward(torch.randn_like(out), q, kv, out, lse, comm, True, 0.3, seq, band=band)
    assert counts == {"fwd": 2, "bwd": 2}
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_all_gather_band_reads_no_liveness_until_asked(monkeypatch):
    """all_gather builds its Band with ring=False: it never asks which ring blocks are live, so
    no THD liveness is computed (no device-to-host copy) unless something asks, and then the
    answer is the same as a ring Band's."""
    calls = []
    real = band_mod._visible_offsets
    monkeypatch.setattr(band_mod, "_visible_offsets", lambda *a: calls.append(1) or real(*a))
    seq, _ = _thd_seq([3, 0, 5, 1], 4)
    lazy = Band(Window(2, None), True, seq, 1, "cpu", ring=False)
    lazy.mask_for(lazy.natural_keys(seq.tokens * 4)).dense()
    assert calls == []
    eager = Band(Window(2, None), True, seq, 1, "cpu")
    assert [lazy.live(s) for s in range(4)] == [eager.live(s) for s in range(4)] and len(calls) == 2

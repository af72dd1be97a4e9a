"""A gloo mesh failure, or a rank that dies without a word, while ranks join is retried once
(cpkit.harness.rendezvous); nothing else is.

The launcher's and the pool's one-attempt functions are replaced by fakes here: gloo's mesh
failure cannot be provoked on demand. functional/test_launcher.py checks on real ranks that a
joining failure is marked as such and that a failure of another kind is not retried.
"""

from __future__ import annotations

import pytest

import cpkit.harness.launch as launch_mod
from cpkit.harness.launch import RankFailure, launch
from cpkit.harness.rank_pool import PoolStartError, RankPool
from cpkit.harness.rank_stderr import describe_exit
from cpkit.harness.rendezvous import START_ATTEMPTS, is_transient_rendezvous

MESH = ("RuntimeError: Gloo connectFullMesh failed with [third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:1771.")
SILENT = describe_exit(1, 2, 255, "")  # "rank 1 of 2 died with exit code 255; it wrote nothing to stderr"
SAID = describe_exit(1, 2, 1, "RuntimeError: CUDA error: invalid device ordinal")


def _rank_fn():
    return 1


def test_only_gloos_mesh_failure_is_transient():
    assert is_transient_rendezvous("gloo", MESH)
    assert not is_transient_rendezvous("nccl", MESH)
    assert not is_transient_rendezvous("gloo", "RuntimeError: Unable to find address for: eth9")
    assert START_ATTEMPTS == 2


def test_a_rank_that_died_without_a_word_is_transient_on_any_backend():
    assert is_transient_rendezvous("nccl", SILENT) and is_transient_rendezvous("gloo", SILENT)
    assert "died with exit code 1" in SAID and not is_transient_rendezvous("nccl", SAID)
    assert not is_transient_rendezvous("nccl", describe_exit(1, 2, 0, ""))  # exited, not died


def _scripted(monkeypatch, failures):
    """Replace one launch attempt by `failures` (RankFailures raised in turn), then success."""
    calls = []

    def once(fn, world_size, backend, *rest):
        calls.append(backend)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return [fn()] * world_size

    monkeypatch.setattr(launch_mod, "_launch_once", once)
    return calls


def test_a_mesh_failure_while_joining_starts_the_ranks_again_once(monkeypatch, capsys):
    calls = _scripted(monkeypatch, [RankFailure("rank 1 failed", 1, {1: MESH}, joining=True)])
    assert launch(_rank_fn, 2) == [1, 1]
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert "launch of _rank_fn on 2 ranks" in err and "Connection closed by peer" in err


def test_a_second_mesh_failure_is_reported(monkeypatch):
    flake = RankFailure("rank 1 failed", 1, {1: MESH}, joining=True)
    calls = _scripted(monkeypatch, [flake, flake, flake])
    with pytest.raises(RankFailure) as info:
        launch(_rank_fn, 2)
    assert info.value is flake and len(calls) == START_ATTEMPTS


@pytest.mark.parametrize("failure", [
    RankFailure("rank 0 failed", 0, {0: MESH}, joining=False),  # raised by fn: the code under test
    RankFailure("rank 0 failed", 0, {0: "RuntimeError: Unable to find address"}, joining=True),
    RankFailure("rank 1 failed", 1, {0: MESH, 1: "AssertionError"}, joining=True),  # the first rank decides
], ids=["after-joining", "other-joining-error", "first-rank-not-mesh"])
def test_other_failures_are_reported_at_once(monkeypatch, failure):
    calls = _scripted(monkeypatch, [failure])
    with pytest.raises(RankFailure) as info:
        launch(_rank_fn, 2)
    assert info.value is failure and len(calls) == 1


def test_a_gloo_mesh_message_on_nccl_is_not_retried(monkeypatch):
    monkeypatch.setenv("CPKIT_GPU_CLAIM", "0")
    failure = RankFailure("rank 1 failed", 1, {1: MESH}, joining=True)
    calls = _scripted(monkeypatch, [failure])
    with pytest.raises(RankFailure):
        launch(_rank_fn, 2, backend="nccl")
    assert calls == ["nccl"]


def _scripted_pool(monkeypatch, problems_in_turn):
    calls = []

    def once(self):
        calls.append(1)
        if len(calls) <= len(problems_in_turn):
            raise PoolStartError("failed to start", problems_in_turn[len(calls) - 1])

    monkeypatch.setattr(RankPool, "_start_once", once)
    return calls


@pytest.mark.parametrize("backend,problems,expected_calls,raises", [
    ("gloo", [{1: MESH}], 2, False),
    ("gloo", [{1: MESH}, {0: MESH}], 2, True),
    ("gloo", [{0: "ImportError: no module named user_loop"}], 1, True),
    ("nccl", [{1: MESH}], 1, True),
    ("nccl", [{1: SILENT}], 2, False),
    ("nccl", [{1: SILENT}, {1: SILENT}], 2, True),
    ("nccl", [{1: SAID}], 1, True),
], ids=["mesh-once", "mesh-twice", "import-error", "nccl-mesh", "silent-once", "silent-twice", "said-why"])
def test_a_pool_starts_again_only_after_a_mesh_failure_or_a_silent_death(monkeypatch, capsys, backend, problems,
                                                            expected_calls, raises):
    calls = _scripted_pool(monkeypatch, problems)
    pool = RankPool(2, backend)
    if raises:
        with pytest.raises(PoolStartError):
            pool.start()
    else:
        pool.start()
        assert "starting the ranks again once" in capsys.readouterr().err
    assert len(calls) == expected_calls

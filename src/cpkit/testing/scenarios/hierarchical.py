"""Scenario of functional/test_hierarchical.py and `python -m cpkit.cluster hierarchical`:
hierarchical CP (a2a+p2p) trains a small GPT like cp=1, refuses a broken hcp at build time,
provably communicates, and logs its groups. The numbered checks are described in
functional/test_hierarchical.py. cp = the world size of the launch.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from cpkit.compat import get_pg, new_pg_collection
from cpkit.errors import CPConfigError
from cpkit.parallel.groups import HCP_LOG_PREFIX, build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.process_device import device
from cpkit.sharding import shard_batch
from cpkit.testing.compare import assert_grads_close, first_layer_name, max_rel_diff
from cpkit.testing.models import GPTConfig, build_gpt, eval_step, make_batch, named_gradients, train_step
from cpkit.testing.reference import single_rank_pg_collection

__all__ = ["WORLD", "cases", "cluster_cases", "expected_hcp_line", "hierarchical_case"]

WORLD = 4
STEPS = 3
HEADS, KV_HEADS = 8, 4  # kv heads divisible by every a2a level used here (4, 2, 1)
TOL = {
    torch.float32: dict(loss=1e-5, rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(loss=5e-3, rtol=2e-2, atol=2e-2),
}
# Margins the local-only model must exceed (see the module docstring for observed values).
LOCAL_GRAD_MARGIN = 0.2
LOCAL_LOSS_MARGIN_FP32 = 100 * TOL[torch.float32]["loss"]
PROBE_GRAD = "self_attention.linear_qkv.weight"  # of the first layer: attention's direct input


def cases(backend: str, world_size: int) -> list[dict]:
    """The functional grid: a2a+p2p [2,2], [4,1], [1,4] on 4 ranks (nccl adds p2p and a2a at cp=4)."""
    if world_size != WORLD:
        return []
    cases = [dict(id=f"a2a+p2p-[{a},{p}]", comm="a2a+p2p", hcp=[a, p]) for a, p in ((2, 2), (4, 1), (1, 4))]
    if backend == "nccl":
        cases += [dict(id=f"{comm}-cp4", comm=comm, hcp=None) for comm in ("p2p", "a2a")]
    return cases


class _Lines(logging.Handler):
    """Collects formatted log messages."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _build_logged(*args, **kwargs):
    """build_gpt with the `cpkit.parallel.groups` logger captured at INFO: (model, logged lines)."""
    log = logging.getLogger("cpkit.parallel.groups")
    handler, old_level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)  # the root default (WARNING) would drop the INFO lines
    try:
        model = build_gpt(*args, **kwargs)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    return model, handler.lines


def expected_hcp_line(hcp: list[int], world: int = WORLD) -> str:
    """Rank 0's line for cp = world: a2a = the first `a` ranks, p2p = every a-th rank."""
    a = hcp[0]
    return f"{HCP_LOG_PREFIX} a2a={list(range(a))} p2p={list(range(0, world, a))}"


def _detach_cp_attention(model) -> None:
    """Rebind every CP attention module to no CP group: each rank attends to its own chunk only,
    while RoPE positions and the loss reduction stay CP-aware (the silent-broken mode)."""
    from cpkit.attention.module import ContextParallelAttention

    mods = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    assert mods, "no ContextParallelAttention in the model"
    for m in mods:
        m.set_context_parallel_group(None, None, None, m.cp_comm_type)
        assert m.cp_size == 1


def _check_build_refuses_broken_hcp(cfg, pgc, single, dev) -> list[str]:
    """Each degenerate hcp fails build_gpt with CPConfigError naming the field and a fix."""
    a2a, p2p = pgc.hcp
    fields = {k: v for k, v in vars(pgc).items() if k != "hcp"}
    variants = {
        # (hcp value, field named, text in the constraint)
        "missing": (None, "pg_collection.hcp", "leaves hcp unset"),
        "one group": ([a2a], "pg_collection.hcp", "exactly two groups"),
        "single-rank groups": ([single, single], "pg_collection.hcp", "must multiply to the cp group size 4"),
        "[cp, single-rank]": ([pgc.cp, single], "hierarchical_context_parallel_sizes", "sizes [4, 1]"),
        "swapped levels": ([p2p, a2a], "pg_collection.hcp", "level 0"),
    }
    messages = []
    for name, (hcp, field, text) in variants.items():
        broken = new_pg_collection(**fields, hcp=hcp)
        try:
            build_gpt(cfg, broken, attention="cpkit", cp_comm_type="a2a+p2p",
                      hierarchical_cp_sizes=[2, 2], device=dev)
        except CPConfigError as exc:
            msg = str(exc)
            assert exc.field == field, f"{name}: error names {exc.field}, not {field}: {msg}"
            assert f"{field}=" in msg and text in msg, f"{name}: unexpected message {msg}"
            assert "fix:" in msg and ("build_pg_collection" in msg or "same layout" in msg), \
                f"{name}: the message gives no fix: {msg}"
            messages.append(msg)
        else:
            raise AssertionError(f"a2a+p2p with {name} hcp built without error (silent local attention)")
    return messages


def hierarchical_case(case):
    """One case on every rank (numbered checks as in the module docstring); returns the global
    losses, the local-only loss and gradient gaps, rank 0's HCP log lines, the refusal messages
    and the CP model's step times (seconds, for comparing comm types on GPUs)."""
    install_mcore_cpu_shim()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    seq = 64 if dev.type == "cpu" else 4096
    tol = TOL[dtype]
    rank, world = dist.get_rank(), dist.get_world_size()
    heads, kv_heads = case.get("heads", HEADS), case.get("kv_heads", KV_HEADS)
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=heads, num_query_groups=kv_heads,
                    seq_length=seq, dtype=dtype)
    layout = CPLayout(world_size=world, cp=world, cp_comm_type=case["comm"],
                      hierarchical_context_parallel_sizes=case["hcp"], seq_length=seq,
                      num_attention_heads=heads, num_query_groups=kv_heads)
    pgc = build_pg_collection(layout)
    ref_pgc = single_rank_pg_collection()
    batches = [make_batch(cfg, batch_size=2, seed=step, device=dev) for step in range(STEPS)]
    kwargs = dict(attention="cpkit", cp_comm_type=case["comm"], hierarchical_cp_sizes=case["hcp"], device=dev)

    # 2. the silent-broken mode is refused at build time
    refused = []
    if case["hcp"] == [2, 2]:
        refused = _check_build_refuses_broken_hcp(cfg, pgc, get_pg(ref_pgc, "cp"), dev)

    # cp=1 reference: MCore's local attention in fp32, cpkit's at cp=1 in bf16 (as test_gpt)
    ref = build_gpt(cfg, ref_pgc, attention="local" if dtype == torch.float32 else "cpkit", device=dev)
    ref_losses, ref_grads = [], None
    for step, batch in enumerate(batches):
        ref_losses.append(train_step(ref, batch, ref_pgc))
        if step == 0:
            ref_grads = named_gradients(ref)
    ref_after = eval_step(ref, batches[-1], ref_pgc)

    # 4. the log line, captured while the CP model is built
    model, lines = _build_logged(cfg, pgc, **kwargs)
    hcp_lines = [line for line in lines if line.startswith(HCP_LOG_PREFIX)]
    if rank != 0:
        assert lines == [], f"rank {rank} logged the groups: {lines}"
    elif case["hcp"]:
        assert hcp_lines == [expected_hcp_line(case["hcp"], world)], f"logged {lines}"
    else:
        assert hcp_lines == [] and lines, f"logged {lines}"

    # 1. three training steps equal the reference
    shards = [shard_batch(b, pgc.cp) for b in batches]
    losses, grads, seconds = [], None, []
    for step, local in enumerate(shards):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        losses.append(train_step(model, local, pgc))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds.append(time.perf_counter() - start)
        if step == 0:
            grads = named_gradients(model)
        assert abs(losses[step] - ref_losses[step]) <= tol["loss"], \
            f"step {step}: loss {losses[step]} vs reference {ref_losses[step]}"
    after = eval_step(model, shards[-1], pgc)
    assert abs(after - ref_after) <= tol["loss"], f"loss after {STEPS} steps {after} vs reference {ref_after}"
    assert_grads_close(grads, ref_grads, rtol=tol["rtol"], atol=tol["atol"], scaled=dtype != torch.float32,
                       what="step-0 gradient")

    # 3. CP communication happened: local-only attention is far from the reference
    broken = build_gpt(cfg, pgc, **kwargs)
    _detach_cp_attention(broken)
    local_loss = train_step(broken, shards[0], pgc)
    probe = first_layer_name(ref_grads, PROBE_GRAD)
    local_grad_diff = max_rel_diff(named_gradients(broken)[probe], ref_grads[probe])
    cp_grad_diff = max_rel_diff(grads[probe], ref_grads[probe])
    assert local_grad_diff > LOCAL_GRAD_MARGIN, \
        f"local-only attention changes {probe}'s gradient by only {local_grad_diff:.3g} of its scale"
    assert cp_grad_diff < tol["atol"], f"{probe}: CP gradient off by {cp_grad_diff:.3g} of its scale"
    if dtype == torch.float32:
        assert abs(local_loss - ref_losses[0]) > LOCAL_LOSS_MARGIN_FP32, \
            f"local-only loss {local_loss} within {LOCAL_LOSS_MARGIN_FP32} of the reference {ref_losses[0]}"
    return dict(losses=losses, ref_losses=ref_losses, local_loss=local_loss,
                local_grad_diff=local_grad_diff, cp_grad_diff=cp_grad_diff,
                hcp_lines=hcp_lines, refused=refused, step_seconds=seconds)


def cluster_cases(backend: str, world_size: int, a2a_sizes) -> list[dict]:
    """Cases for `python -m cpkit.cluster hierarchical` on any world size (cp = world): on 4
    ranks the functional grid, else a2a+p2p [a, world // a] for each a2a size `a` given; either
    way only those whose a2a level is in `a2a_sizes` (those that fit the nodes). KV heads are
    raised to `a` where 4 does not divide by it."""
    if world_size == WORLD:
        return [c for c in cases(backend, world_size)
                if (c["hcp"][0] if c["hcp"] else (WORLD if c["comm"] == "a2a" else 1)) in a2a_sizes]
    out = []
    for a in sorted(set(a2a_sizes)):
        if world_size % a == 0 and 1 <= a < world_size:
            kv_heads = KV_HEADS if KV_HEADS % a == 0 else a
            out.append(dict(id=f"a2a+p2p-[{a},{world_size // a}]", comm="a2a+p2p", hcp=[a, world_size // a],
                            heads=2 * kv_heads, kv_heads=kv_heads))
    return out

"""Scenario of functional/test_attention.py and `python -m cpkit.cluster attention`: CP attention
against single-rank full attention (outputs and gradients).

Each rank builds the same full q, k, v and output gradient from the case's seed, computes a
full-sequence reference on its own, shards the inputs with `cpkit.sharding` (the layout the CP
attention expects), runs `context_parallel_attention` and its backward over all ranks, and
asserts output, dq, dk, dv with `torch.testing.assert_close` against the reference's slice cut by
`cpkit.testing.reference.reference_shard` (plain chunking, no code shared with cpkit.sharding).
Sizes and tolerances: see functional/test_attention.py.
"""

from __future__ import annotations

import re
import zlib

import torch
import torch.distributed as dist

from cpkit.attention import context_parallel_attention, reference_attention
from cpkit.attention.options import CPAttentionOptions
from cpkit.errors import CPConfigError
from cpkit.process_device import device
from cpkit.sharding import pad_cu_seqlens, shard_seq, shard_thd
from cpkit.testing.groups import new_hierarchical_groups
from cpkit.testing.reference import reference_shard

__all__ = ["DTYPES", "HEADS", "TOLERANCE", "attention_case", "cases", "cluster_cases"]

HEADS, HEAD_DIM_CPU, HEAD_DIM_GPU = 8, 16, 64
TOLERANCE = {  # dtype -> (rtol, atol as a fraction of max |reference|, or absolute for fp32)
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

def cases(backend: str, world_size: int) -> list[dict]:
    """The functional grid on `world_size` (2 or 4) ranks of `backend` (see the module docstring)."""
    if world_size == 2:
        comms = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 2), ("a2a+p2p", 1)]
    else:
        comms = [("p2p", None), ("all_gather", None), ("a2a", None), ("a2a+p2p", 2)]
    gpu = backend == "nccl"
    seqs = [8192, 32768] if gpu else [64]
    dtypes = ["bf16"] if gpu else ["fp32"]
    cases = []
    for comm, a2a in comms:
        for dtype in dtypes:
            for causal in (True, False):
                for fmt in ("sbhd", "thd"):
                    for gqa in (True, False):
                        # The long sbhd length only for the trained configuration (causal GQA):
                        # what it adds over 8K (many merged blocks, wide LSE range) is numeric,
                        # not a mask or head-layout path, which the 8K cases cover.
                        long_ok = causal and gqa
                        for s in (seqs if fmt == "sbhd" and long_ok else seqs[:1]):
                            cases.append(_case(comm, a2a, world_size, dtype, causal, fmt, gqa, s, gpu))
        if not gpu:  # dtype plumbing: 16-bit inputs, grads in the input dtype
            for dtype in ("bf16", "fp16"):
                cases.append(_case(comm, a2a, world_size, dtype, True, "sbhd", True, seqs[0], gpu))
    if world_size == 4:  # a2a over 4 ranks needs heads and kv heads divisible by 4, on every rank
        for heads, kv_heads in ((6, 6), (8, 2)):
            case = _case("a2a", None, world_size, dtypes[0], True, "sbhd", kv_heads < heads, seqs[0], gpu)
            case.update(id=f"a2a-rejects-heads{heads}-kv{kv_heads}", heads=heads, kv_heads=kv_heads,
                        expect_error="divisible by 4")
            cases.append(case)
    return cases


def _case(comm, a2a, world_size, dtype, causal, fmt, gqa, s, gpu) -> dict:
    name = comm if a2a is None else f"{comm}[{a2a},{world_size // a2a}]"
    cid = f"{name}-{dtype}-{'causal' if causal else 'nomask'}-{fmt}-{'gqa' if gqa else 'mha'}"
    if gpu and fmt == "sbhd":
        cid += f"-s{s // 1024}k"
    return dict(id=cid, comm=comm, a2a=a2a, dtype=dtype, causal=causal, fmt=fmt, gqa=gqa, s=s, gpu=gpu)


def _cp_group(case):
    """(cp_group argument, this rank's CP position)."""
    world = dist.get_world_size()
    if case["comm"] != "a2a+p2p":
        return dist.group.WORLD, dist.get_rank()
    # With groups built over WORLD in order, position p2p_rank * A + a2a_rank is the global rank.
    # Every case asks for them: a rank pool or the cluster runner hands out the groups of an
    # earlier case again (cpkit.harness.pool_groups.GroupReuse), so no case adds groups.
    return list(new_hierarchical_groups(list(range(world)), case["a2a"])), dist.get_rank()


def _inputs(case, cp: int, dev):
    gen = torch.Generator().manual_seed(zlib.crc32(case["id"].encode()))  # same on every rank
    heads = case.get("heads", HEADS)
    kv_heads = case.get("kv_heads", HEADS // 2 if case["gqa"] else HEADS)
    dim = HEAD_DIM_GPU if case["gpu"] else HEAD_DIM_CPU
    dtype = DTYPES[case["dtype"]]
    cu = None
    if case["fmt"] == "sbhd":
        b = 1 if case["s"] > 8192 else 2
        shape = (case["s"], b)
    else:
        lens = [5000, 777, 12345, 6000] if case["gpu"] else [13, 3, 40, 7, 22]
        cu = pad_cu_seqlens(lens, cp)
        shape = (int(cu[-1]),)
    q, dout = (torch.randn(*shape, heads, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(*shape, kv_heads, dim, generator=gen) for _ in range(2))
    # Round to the test dtype first so that the reference sees exactly the CP inputs.
    q, k, v, dout = (x.to(dtype).to(dev) for x in (q, k, v, dout))
    return q, k, v, dout, cu


def _reference(q, k, v, dout, causal, cu):
    """float32 full attention and its grads (out, dq, dk, dv) of the full inputs."""
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    if cu is None:
        out = _full_attention(qf, kf, vf, causal)
    else:
        bounds = cu.tolist()
        out = torch.cat([
            _full_attention(qf[a:b].unsqueeze(1), kf[a:b].unsqueeze(1), vf[a:b].unsqueeze(1), causal).squeeze(1)
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a
        ])
    out.backward(dout.float())
    return out.detach(), qf.grad, kf.grad, vf.grad


def _full_attention(q, k, v, causal):
    if q.device.type == "cpu":
        return reference_attention(q, k, v, causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32 without O(s^2) memory
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=causal
        )
    return out.permute(2, 0, 1, 3)


def attention_case(case: dict) -> dict:
    """One case on every rank: CP attention over all ranks against the full-sequence reference
    (outputs and gradients, assert_close per dtype); returns the max errors per tensor. A case
    with "expect_error" must raise CPConfigError matching it instead."""
    dev = device()
    cp_group, cp_rank = _cp_group(case)
    cp = dist.get_world_size()
    q, k, v, dout, cu = _inputs(case, cp, dev)
    if "expect_error" in case:
        q_l, k_l, v_l = (shard_seq(x, cp_rank, cp, seq_dim=0) for x in (q, k, v))
        try:
            context_parallel_attention(q_l, k_l, v_l, cp_group=cp_group, cp_comm_type=case["comm"],
                                       causal=case["causal"])
        except CPConfigError as exc:
            assert re.search(case["expect_error"], str(exc)), f"{exc} does not match {case['expect_error']!r}"
            return {}
        raise AssertionError(f"DID NOT RAISE CPConfigError matching {case['expect_error']!r}")
    ref = _reference(q, k, v, dout, case["causal"], cu)

    if cu is None:
        shard = lambda x: shard_seq(x, cp_rank, cp, seq_dim=0)  # noqa: E731
    else:
        shard = lambda x: shard_thd(x, cu, cp_rank, cp)  # noqa: E731
    q_l, k_l, v_l = (shard(x).detach().requires_grad_() for x in (q, k, v))
    options = CPAttentionOptions(**case["options"]) if "options" in case else None  # forced speed settings
    out = context_parallel_attention(
        q_l, k_l, v_l, cp_group=cp_group, cp_comm_type=case["comm"], causal=case["causal"],
        cu_seqlens=None if cu is None else cu.to(dev), options=options,
    )
    out.backward(shard(dout))

    dtype = DTYPES[case["dtype"]]
    rtol, atol_factor = TOLERANCE[dtype]
    errors = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q_l.grad, k_l.grad, v_l.grad), ref):
        assert got.dtype == dtype, f"{name} dtype {got.dtype}, expected the input dtype {dtype}"
        want = reference_shard(want, cp_rank, cp, cu)  # the expected slice, without cpkit.sharding
        atol = atol_factor if dtype == torch.float32 else atol_factor * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        errors[name] = (got.float() - want).abs().max().item()
    return errors


def cluster_cases(backend: str, world_size: int, a2a_size: int, *, with_a2a: bool = True) -> list[dict]:
    """Every comm type over all `world_size` ranks, for any world size (`python -m cpkit.cluster
    attention`): p2p, all_gather, a2a (unless `with_a2a` is False, e.g. when it would span
    nodes) and a2a+p2p with a2a groups of `a2a_size` (when 1 < a2a_size < world_size), each
    causal and without mask, sbhd and THD, GQA. Heads scale with the world so that a2a divides
    them; the sequence so that it splits into 2 * world_size chunks."""
    comms = [("p2p", None), ("all_gather", None)] + ([("a2a", None)] if with_a2a else [])
    if 1 < a2a_size < world_size and world_size % a2a_size == 0:
        comms.append(("a2a+p2p", a2a_size))
    gpu = backend == "nccl"
    kv_heads = world_size * max(1, 4 // world_size)
    chunk = 2 * world_size
    seq = 8192 if gpu else chunk * -(-64 // chunk)
    out = []
    for comm, a2a in comms:
        for causal in (True, False):
            for fmt in ("sbhd", "thd"):
                case = _case(comm, a2a, world_size, "bf16" if gpu else "fp32", causal, fmt, True, seq, gpu)
                case.update(heads=2 * kv_heads, kv_heads=kv_heads)
                out.append(case)
    return out

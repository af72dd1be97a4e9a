"""Dynamic-CP runtime at world size 1: packing, sharding, the per-micro-batch group switch and
its restore, idle ranks, and one whole step at cp=1 against per-sequence forwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpkit.dynamic import Plan, build_group_registry, runtime
from cpkit.testing.plans import hand_plan
from cpkit.dynamic.runtime import (
    dp_cp_position,
    dynamic_cp_step,
    forward_backward_local,
    pack_thd,
    packed_seq_params_for,
    prepare_microbatch,
    use_cp_group,
    zero_loss,
)
from cpkit.errors import CPConfigError
from cpkit.testing.models import GPTConfig, build_gpt, named_gradients
from cpkit.loss import all_reduce_gradients
from cpkit.sharding import gather_thd, thd_partition
from cpkit.testing.fakes import fake_group
from cpkit.testing.reference import per_sequence_reference, reference_shard, single_rank_pg_collection, token_sample

CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=64)


def _sample(length: int, seed: int, vocab: int = CFG.vocab_size) -> dict:
    return token_sample(length, seed, vocab)


def _fake_registry(dp_cp_size: int, position: int):
    """A registry over global ranks 0..n-1 of fake groups whose rank() is `position`'s in each."""
    def new_group(ranks):
        return fake_group(ranks, rank=ranks.index(position) if position in ranks else None)
    return build_group_registry([list(range(dp_cp_size))], position, new_group=new_group)


# --------------------------------------------------------------------------------- packing


def test_pack_thd_cu_seqlens_and_padding():
    samples = [_sample(3, 0), _sample(5, 1), _sample(8, 2)]
    packed = pack_thd(samples, cp_size=2)
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 16]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 12, 20]  # each padded to a multiple of 2*cp = 4
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.seq_lens == (3, 5, 8) and packed.max_seqlen == 8
    for key in ("tokens", "labels", "loss_mask"):
        t = packed.tensors[key]
        assert t.shape == (1, 20)
        for (a, n), s in zip([(0, 3), (4, 5), (12, 8)], samples):
            assert torch.equal(t[0, a:a + n], s[key])
    mask = packed.tensors["loss_mask"][0]
    assert mask.sum() == 16 and mask[3] == 0 and mask[9:12].sum() == 0
    assert packed.tensors["tokens"][0, 3] == 0


def test_pack_thd_cp1_pads_to_even_and_honours_pad_values():
    packed = pack_thd([_sample(3, 0), _sample(5, 1)], cp_size=1)  # 2*cp = 2, as pad_cu_seqlens
    assert packed.cu_seqlens.tolist() == [0, 3, 8] and packed.cu_seqlens_padded.tolist() == [0, 4, 10]
    packed4 = pack_thd([_sample(3, 0)], cp_size=4, pad_values={"labels": -100})
    assert packed4.cu_seqlens_padded.tolist() == [0, 8]
    assert packed4.tensors["labels"][0, 3:].tolist() == [-100] * 5


@pytest.mark.parametrize("bad, what", [
    ([], "at least one sample"),
    ([{"tokens": torch.zeros(3)}, {"labels": torch.zeros(3)}], "must have the keys"),
    ([{"tokens": torch.zeros(3), "labels": torch.zeros(4)}], "one length"),
    ([{"tokens": torch.zeros(1, 3)}], "1-D"),
    ([{"tokens": torch.zeros(0)}], ">= 1"),
])
def test_pack_thd_rejects_bad_samples(bad, what):
    with pytest.raises(CPConfigError, match=what):
        pack_thd(bad, cp_size=2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_covers_every_token_once_with_sequence_positions(cp):
    samples = [_sample(n, i) for i, n in enumerate([5, 16, 9, 1])]
    packed = pack_thd(samples, cp_size=cp)
    shards = [packed.shard(r) for r in range(cp)]
    for key in ("tokens", "labels", "loss_mask"):
        full = gather_thd([s[key] for s in shards], packed.cu_seqlens_padded, seq_dim=1)
        assert torch.equal(full, packed.tensors[key])
    assert _wrong_positions(packed) == []  # positions restart at 0 in every packed sequence
    assert sum(float(s["loss_mask"].sum()) for s in shards) == 31


def _wrong_positions(packed) -> list[int]:
    """CP ranks whose position_ids are not, token for token, arange(length) of each packed
    sequence; the expected slice comes from reference_shard, not from cpkit.sharding."""
    cu = packed.cu_seqlens_padded
    want = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    return [r for r in range(packed.cp_size)
            if not torch.equal(packed.shard(r)["position_ids"][0], reference_shard(want, r, packed.cp_size, cu))]


def _left_sided(clamp: bool):
    """thd_position_ids with a left-sided searchsorted: the first token of every sequence but the
    first gets the previous sequence's length (and, unclamped, the first one a negative position)."""
    def thd_position_ids(cu_seqlens, cp_rank, cp_size):
        index = thd_partition(cu_seqlens, cp_rank, cp_size)
        cu = cu_seqlens.to(torch.int64)
        seq = torch.searchsorted(cu, index) - 1
        return index - cu[seq.clamp(min=0) if clamp else seq]
    return thd_position_ids


@pytest.mark.parametrize("clamp", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_position_check_catches_a_left_sided_searchsorted(monkeypatch, cp, clamp):
    # The mutant in-process: the check above must fail on it (it did, planted in src, with
    # functional/test_dynamic_cp.py's learned-positions case).
    monkeypatch.setattr(runtime, "thd_position_ids", _left_sided(clamp))
    packed = pack_thd([_sample(n, i) for i, n in enumerate([5, 16, 9, 1])], cp_size=cp)
    assert _wrong_positions(packed) != []


def test_packed_seq_params_carry_group_and_offsets():
    packed = pack_thd([_sample(3, 0), _sample(6, 1)], cp_size=2)
    group = fake_group([4, 5])
    psp = packed_seq_params_for(packed, group)
    assert psp.qkv_format == "thd"
    assert psp.cp_group is group and psp.local_cp_size == 2
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 3, 9]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 4, 12]
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 8


# --------------------------------------------------------------------------- micro-batches


def test_prepare_microbatch_idle_and_busy_ranks():
    lens = [5, 7, 3]
    plan = hand_plan([[((0, 1), (0, 1))], [((1,), (2,))]], lens, dp_cp_size=2)
    fetched = []

    def get(i):
        fetched.append(i)
        return _sample(lens[i], i)

    reg0 = _fake_registry(2, 0)
    assert prepare_microbatch(plan, 1, reg0, 0, get) is None  # rank 0 idles in micro-batch 1
    assert fetched == []  # an idle rank fetches nothing
    mb = prepare_microbatch(plan, 0, reg0, 0, get)
    assert fetched == [0, 1]
    assert mb.assignment.cp_size == 2 and mb.cp_rank == 0 and dist.get_process_group_ranks(mb.group) == [0, 1]
    assert mb.packed.cu_seqlens_padded.tolist() == [0, 8, 16]
    # Chunks 0 and 3 of each sequence: 2 real tokens of the 5, 3 of the 7 (its last is padding).
    assert mb.batch["tokens"].shape == (1, 8) and mb.num_tokens == 5.0
    reg1 = _fake_registry(2, 1)
    other = prepare_microbatch(plan, 0, reg1, 1, get)
    assert other.cp_rank == 1 and other.num_tokens == 7.0  # every real token counted once
    assert prepare_microbatch(plan, 1, reg1, 1, get).batch["tokens"].shape == (1, 4)  # 3, even at cp=1


def test_prepare_microbatch_rejects_a_plan_for_another_dp_cp_size():
    plan = hand_plan([[((0,), (0,))]], [4], dp_cp_size=1)
    with pytest.raises(CPConfigError, match="DPxCP size 2"):
        prepare_microbatch(plan, 0, _fake_registry(2, 0), 0, lambda i: _sample(4, i))


def test_dp_cp_position():
    reg = build_group_registry([[4, 6, 5, 7]], 5, new_group=lambda ranks: fake_group(ranks))
    assert dp_cp_position(reg, 5) == 2
    with pytest.raises(CPConfigError, match="not in the DPxCP group"):
        dp_cp_position(reg, 0)


# ---------------------------------------------------------------------- the group switch


@pytest.fixture(scope="module")
def pgc(mcore_cpu):
    return single_rank_pg_collection()


@pytest.fixture()
def model(pgc):
    return build_gpt(CFG, pgc, attention="cpkit")


def _bindings(model):
    """Every cached group reference and CP size, by (module name, attr): objects, not copies."""
    out = {}
    for name, m in model.named_modules():
        for attr in ("pg_collection", "cp_group", "cp_global_ranks", "cp_comm_type", "tp_cp_group"):
            if attr in vars(m):
                out[(name, attr)] = vars(m)[attr]
        if getattr(m, "config", None) is not None:
            out[(name, "config.context_parallel_size")] = m.config.context_parallel_size
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] or a[k] == b[k] and type(a[k]) is int for k in a)


def test_use_cp_group_switches_and_restores_after_an_exception(model, pgc):
    before = _bindings(model)
    static_cp = pgc.cp
    group = fake_group([0, 1])
    with pytest.raises(RuntimeError, match="boom"):
        with use_cp_group(model, group, pg_collection=pgc):
            attn = [m for m in model.modules() if type(m).__name__ == "ContextParallelAttention"]
            assert attn and all(m.cp_group is group for m in attn)
            colls = [vars(m)["pg_collection"] for m in model.modules() if "pg_collection" in vars(m)]
            assert colls and all(c.cp is group and c is not pgc for c in colls)  # MCore 0.16 RoPE reads it
            assert model.config.context_parallel_size == 2
            assert pgc.cp is static_cp  # the caller's collection is never mutated
            raise RuntimeError("boom")
    assert _same(_bindings(model), before)
    assert pgc.cp is static_cp
    # And it can be entered again (no stale "already active" state).
    with use_cp_group(model, fake_group([0, 1, 2, 3]), pg_collection=pgc):
        assert model.config.context_parallel_size == 4
    assert _same(_bindings(model), before)


class StickyAttention(torch.nn.Module):
    """TE-style CP attention as MCore 0.16 wraps it: forward switches to packed_seq_params.cp_group
    through set_context_parallel_group and never switches back."""

    def __init__(self, group):
        super().__init__()
        self.set_context_parallel_group(group, [0], None, "p2p")

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(self, packed_seq_params):
        group = packed_seq_params.cp_group
        self.set_context_parallel_group(group, dist.get_process_group_ranks(group), None, self.cp_comm_type)


def test_use_cp_group_undoes_a_sticky_te_style_switch(pgc):
    static = pgc.cp
    net = torch.nn.Sequential(StickyAttention(static))
    group = fake_group([0, 1])
    packed = pack_thd([_sample(4, 0)], cp_size=2)
    with use_cp_group(net, group, pg_collection=pgc):
        assert net[0].cp_group is group and net[0].cp_global_ranks == [0, 1]
        net[0](packed_seq_params_for(packed, fake_group([2, 3])))  # the forward's own switch
    assert net[0].cp_group is static and net[0].cp_global_ranks == [0]
    net[0](packed_seq_params_for(packed, group))  # without use_cp_group the switch sticks
    assert net[0].cp_group is group


def test_use_cp_group_finds_the_model_collection(model, pgc):
    before = _bindings(model)
    with use_cp_group(model, fake_group([0, 1])):
        assert dist.get_process_group_ranks(model.pg_collection.cp) == [0, 1]
    assert _same(_bindings(model), before)


def test_use_cp_group_refuses_nesting(model, pgc):
    with use_cp_group(model, fake_group([0, 1]), pg_collection=pgc):
        with pytest.raises(CPConfigError, match="already active"):
            with use_cp_group(model, fake_group([0, 1]), pg_collection=pgc):
                pass


def test_idle_rank_contributes_a_zero_loss_and_zero_gradients(model, pgc):
    model.zero_grad(set_to_none=True)
    shares = forward_backward_local(model, [None, None], total_tokens=10.0, pg_collection=pgc)
    assert [float(s) for s in shares] == [0.0, 0.0]
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.grad is not None and not p.grad.any() for p in params)


def test_zero_loss_reaches_every_parameter():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    loss = zero_loss(net)
    assert loss.dtype == torch.float32 and float(loss.detach()) == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    with pytest.raises(CPConfigError, match="no trainable parameter"):
        zero_loss(torch.nn.ReLU())


def test_all_reduce_gradients_fills_missing_grads(world1):
    net = torch.nn.Linear(3, 2)
    net.weight.grad = torch.ones_like(net.weight)
    all_reduce_gradients(net, world1)
    assert torch.equal(net.weight.grad, torch.ones(2, 3)) and torch.equal(net.bias.grad, torch.zeros(2))


# ----------------------------------------------------------------------------- a whole step


def test_step_at_cp1_equals_per_sequence_forwards(pgc):
    """World size 1: two micro-batches of packed THD (at cp=1) give the mean loss over all
    tokens and the gradients of forwarding every sequence on its own with MCore's attention."""
    lens = [7, 12, 3, 9]
    samples = [_sample(n, 10 + i) for i, n in enumerate(lens)]
    ref = build_gpt(CFG, pgc, attention="local")
    ref_loss = per_sequence_reference(ref, samples, pgc, total_tokens=float(sum(lens)))

    model = build_gpt(CFG, pgc, attention="cpkit")
    registry = build_group_registry([[0]], 0)
    plan = hand_plan([[((0,), (0, 2))], [((0,), (1, 3))]], lens, dp_cp_size=1)
    result = dynamic_cp_step(model, plan, registry, lambda i: samples[i], pg_collection=pgc)
    assert result.num_tokens == sum(lens) and result.cp_sizes == (1, 1)
    assert abs(result.loss - ref_loss) <= 1e-5
    assert abs(sum(result.local_losses) - result.loss) <= 1e-12
    ref_grads, grads = named_gradients(ref), named_gradients(model)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5)


def test_step_rejects_a_dp_cp_group_that_is_not_the_registry(pgc, model):
    registry = build_group_registry([[0, 1]], 0, new_group=lambda ranks: fake_group(ranks))
    plan = hand_plan([[((0, 1), (0,))]], [4], dp_cp_size=2)
    with pytest.raises(CPConfigError, match="registry's ranks"):
        dynamic_cp_step(model, plan, registry, lambda i: _sample(4, i), pg_collection=pgc)


def test_step_reraises_the_get_sample_error_of_this_rank(pgc, model):
    """A failing get_sample surfaces as its own error (after the failure count is shared), not
    as a NameError from the failure path."""
    registry = build_group_registry([[0]], 0)
    plan = hand_plan([[((0,), (0,))]], [4], dp_cp_size=1)

    def broken(i):
        raise KeyError(f"sample {i} is missing")

    with pytest.raises(KeyError, match="sample 0 is missing"):
        dynamic_cp_step(model, plan, registry, broken, pg_collection=pgc)


# --------------------------------------------------------------------------------- details

def _two_rank_all_reduce(monkeypatch, peer_tokens, peer_failed):
    """agree_on_tokens over a DPxCP group of two, the other rank's stats added by the all-reduce."""
    monkeypatch.setattr(runtime, "group_size", lambda group: 2)
    monkeypatch.setattr(runtime.dist, "all_reduce",
                        lambda t, group=None: t.add_(torch.tensor([peer_tokens, peer_failed], dtype=t.dtype)))


def test_agree_on_tokens_sums_the_ranks_tokens(monkeypatch):
    _two_rank_all_reduce(monkeypatch, peer_tokens=7, peer_failed=0)
    assert runtime.agree_on_tokens(5, None, object(), "cpu", "step") == 12


def test_a_healthy_rank_raises_when_one_peer_failed(monkeypatch):
    _two_rank_all_reduce(monkeypatch, peer_tokens=0, peer_failed=1)
    with pytest.raises(RuntimeError, match=r"step: 1 other rank\(s\) of the DPxCP group failed"):
        runtime.agree_on_tokens(5, None, object(), "cpu", "step")


def test_the_failing_rank_raises_its_own_error_after_the_all_reduce(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "group_size", lambda group: 2)
    monkeypatch.setattr(runtime.dist, "all_reduce", lambda t, group=None: calls.append(t.tolist()))
    error = KeyError("sample 3")
    with pytest.raises(KeyError) as info:
        runtime.agree_on_tokens(0, error, object(), "cpu", "step")
    assert info.value is error and calls == [[0.0, 1.0]]


def test_use_cp_group_sets_tp_cp_to_the_block_at_tp1_and_to_the_given_group_otherwise(model, pgc):
    group = fake_group([0, 1])
    with use_cp_group(model, group, pg_collection=pgc) as rebinding:
        assert rebinding.target.tp_cp is group  # tp x cp is cp itself at tp == 1
    given = fake_group([0, 1])
    with use_cp_group(model, group, pg_collection=pgc, tp_cp_group=given) as rebinding:
        assert rebinding.target.tp_cp is given and rebinding.target.cp is group


def test_step_gives_every_trainable_parameter_a_gradient(pgc, model):
    """Parameters the loss does not reach get zero gradients: every rank then sends the same
    buffers in the DPxCP gradient all-reduce."""
    registry = build_group_registry([[0]], 0)
    plan = hand_plan([[((0,), (0,))]], [4], dp_cp_size=1)
    first = next(model.parameters())
    model.zero_grad(set_to_none=True)
    dynamic_cp_step(model, plan, registry, lambda i: _sample(4, i), pg_collection=pgc,
                    loss_fn=lambda m, batch, pgs, total_tokens, packed_seq_params: first.sum())
    assert torch.equal(first.grad, torch.ones_like(first))
    rest = [p for p in model.parameters() if p.requires_grad and p is not first]
    assert rest and all(p.grad is not None and not p.grad.any() for p in rest)


def test_step_rejects_a_plan_for_another_dp_cp_size_before_any_collective(pgc, model):
    registry = build_group_registry([[0]], 0)
    plan = Plan((), (), 2, 64, (), ())  # no micro-batches: nothing else would look at its size
    with pytest.raises(CPConfigError) as info:
        dynamic_cp_step(model, plan, registry, lambda i: _sample(4, i), pg_collection=pgc)
    assert info.value.field == "plan.dp_cp_size"


@pytest.mark.parametrize("per_token", [True, False])
def test_moe_step_divides_router_loss_gradients_by_the_token_count(pgc, per_token):
    """World size 1, an MoE GPT with aux and z losses: one sample per micro-batch (the router's
    losses are over a micro-batch's tokens) gives the loss and every gradient, router weights
    included, of MCore's schedule with calculate_per_token_loss at cp=1. The router's loss
    gradients are divided by the global token count T like the LM loss's, whatever the
    model's calculate_per_token_loss (without it MCore's router does not weight them by the
    micro-batch's token count; the runtime does)."""
    from cpkit.testing.scenarios.loss_matrix import MODELS, _dynamic_reference

    lens = [12, 6, 8]
    samples = [_sample(n, 40 + i) for i, n in enumerate(lens)]
    cfg = CFG.with_(extra=dict(MODELS["moe"], calculate_per_token_loss=True))
    ref_loss, _, ref_grads = _dynamic_reference(cfg, samples, torch.device("cpu"))

    model = build_gpt(cfg.with_(extra=dict(cfg.extra, calculate_per_token_loss=per_token)), pgc)
    plan = hand_plan([[((0,), (i,))] for i in range(len(lens))], lens, dp_cp_size=1)
    result = dynamic_cp_step(model, plan, build_group_registry([[0]], 0), lambda i: samples[i],
                             pg_collection=pgc)
    assert abs(result.loss - ref_loss) <= 1e-5
    grads = named_gradients(model)
    assert any("router" in name for name in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_router_loss_scale_is_filled_on_the_device_without_a_host_copy():
    """The scale is set every micro-batch between forward and backward: a copy from host memory
    (torch.tensor(scale, device=cuda)) waits for the stream there, so the host could not queue
    the backward while the forward runs. A fill on the device (aten.full) is only queued; a
    tensor built from host data dispatches no device op at all (its copy is below dispatch)."""
    pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    class Ops(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    with Ops() as ops, runtime._router_loss_scale(0.25, torch.device("meta")):
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    assert scale.device.type == "meta" and scale.dtype == torch.float32 and scale.dim() == 0
    assert ops.seen == ["aten.full.default"], f"the scale was not made by a fill on the device: {ops.seen}"
    assert MoEAuxLossAutoScaler.main_loss_backward_scale is before

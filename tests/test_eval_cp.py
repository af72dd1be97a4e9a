"""Eval-CP rebinding at world size 1, what is particular to cpkit's eval_cp_context: the Rebinding
report, the exact set_context_parallel_group calls, the guards, YaRN caches, the eval layout and
data. Real MCore GPT modules (cpkit.testing.models), and process groups on torch's fake backend
(cpkit.testing.fakes.fake_group) where a CP size > 1 is needed. The behaviour every
implementation must have (identity inside and after, exceptions, 1000 cycles, VPP chunks, RoPE
caches, mixed collections, no TE) is in tests/test_eval_cp_protocol.py, run against cpkit and
the other implementations."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from cpkit.eval_cp import loop as eval_loop, rebind
from cpkit.compat import get_pg, new_pg_collection
from cpkit.errors import CPConfigError
from cpkit.eval_cp.context import (
    CP_ATTENTION_ATTRS,
    REBIND_TABLE,
    EvalCPWarning,
    build_eval_pg_collection,
    eval_cp_context,
    eval_layout,
    eval_shard,
    evaluate,
    reduce_eval_loss,
    install_pg_collection,
)
from cpkit.parallel.layout import CPLayout
from cpkit.testing.models import GPTConfig, build_gpt, eval_step, make_batch
from cpkit.testing.fakes import fake_group
from cpkit.testing.reference import single_rank_pg_collection
from cpkit.testing.te_support import TELikeAttention

CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)
TABLE_ATTRS = [r.attr for r in REBIND_TABLE]


@pytest.fixture(scope="module")
def pgc(mcore_cpu):
    return single_rank_pg_collection()


def fake_target(pgc, cp_ranks=(0, 1), hcp=None, **overrides):
    """An eval collection at CP = len(cp_ranks) on the model's tp and pp groups."""
    cp = fake_group(cp_ranks)
    groups = dict(tp=pgc.tp, pp=pgc.pp, mp=pgc.mp, cp=cp, dp=fake_group([0]), tp_cp=fake_group(cp_ranks),
                  dp_cp=fake_group(cp_ranks), tp_dp_cp=fake_group(cp_ranks), hcp=hcp)
    groups.update(overrides)
    return new_pg_collection(**groups)


def snapshot(model):
    """(module, attr) -> the object there now, for every table / CP-attention attribute, plus
    every config's CP fields."""
    out = {}
    for name, m in model.named_modules():
        for attr in set(TABLE_ATTRS) | set(CP_ATTENTION_ATTRS):
            if attr in vars(m):
                out[(name, attr)] = vars(m)[attr]
        cfg = getattr(m, "config", None)
        if cfg is not None:
            for attr in ("context_parallel_size", "hierarchical_context_parallel_sizes", "cp_comm_type"):
                out[(f"{name}.config", attr)] = getattr(cfg, attr)
    return out


def assert_same_objects(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key] is value, f"{key}: {after[key]!r} is not the original {value!r}"


# ---------------------------------------------------------------------------------------------
# Rebinding


def test_cpkit_attention_is_bound_through_set_context_parallel_group_and_reported(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    target = fake_target(pgc)
    before = snapshot(model)
    with eval_cp_context(model, target) as rebinding:
        rebound = set(rebinding.rebound)
        attention = [(n, m) for n, m in model.named_modules() if hasattr(m, "set_context_parallel_group")]
        assert len(attention) == CFG.num_layers
        for name, m in attention:
            assert m.cp_group is target.cp and m.cp_global_ranks == [0, 1] and m.cp_comm_type == "p2p"
            assert f"{name}.set_context_parallel_group" in rebound
        assert "rotary_pos_emb.cp_group" in rebound and "config.context_parallel_size" in rebound
    assert_same_objects(model, before)


def test_each_distinct_config_is_rebound_once_and_reported(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    chunks = [model.decoder.layers[0], model.decoder.layers[1]]  # two chunks sharing model.config
    with eval_cp_context(chunks, fake_target(pgc)) as rebinding:
        assert rebinding.rebound.count("config.context_parallel_size") == 1
        assert any(r.startswith("[1].") for r in rebinding.rebound)
    a, b = build_gpt(CFG, pgc), build_gpt(CFG, pgc)
    with eval_cp_context([a, b], fake_target(pgc)) as rebinding:
        assert rebinding.rebound.count("config.context_parallel_size") == 2


def test_eval_at_cp1_inside_the_context_equals_outside(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    batch = make_batch(CFG, batch_size=2)
    outside = eval_step(model, batch, pgc)
    with eval_cp_context(model, single_rank_pg_collection()) as rebinding:
        assert model.pg_collection is rebinding.target
        inside = eval_step(model, batch, rebinding.target)
    assert inside == outside


class Holder(torch.nn.Module):
    def __init__(self, pgc, attention):
        super().__init__()
        self.pg_collection = pgc
        self.attention = attention


def test_te_like_attention_gets_set_context_parallel_group_with_the_right_arguments(pgc):
    te = TELikeAttention()
    holder = Holder(pgc, te)
    target = fake_target(pgc)
    with eval_cp_context(holder, target):
        assert te.calls == [(target.cp, [0, 1], TELikeAttention.cp_stream, "p2p", "dual_chunk_swap")]
        assert holder.pg_collection is target
    assert len(te.calls) == 1, "restore must put the snapshot back, not call set_context_parallel_group"
    assert te.cp_group is None and te.cp_comm_type == "p2p"
    assert "cp_stream" not in vars(te), "the instance must not keep a shadow of the class stream"


def test_te_like_attention_a2a_p2p_gets_the_hierarchical_pair(pgc):
    te = TELikeAttention()
    a2a, p2p = fake_group([0, 1]), fake_group([0, 2])
    target = fake_target(pgc, cp_ranks=(0, 1, 2, 3), hcp=[a2a, p2p])
    with eval_cp_context(Holder(pgc, te), target, cp_comm_type="a2a+p2p"):
        group, ranks, stream, comm, _ = te.calls[0]
        assert group == [a2a, p2p] and ranks == [0, 1, 2, 3] and comm == "a2a+p2p"
        assert stream is TELikeAttention.cp_stream
    assert te.cp_comm_type == "p2p"


def test_te_like_attention_at_eval_cp1_turns_cp_off(pgc):
    te = TELikeAttention(cp_comm_type="a2a")
    te.cp_group = fake_group([0, 1])
    with eval_cp_context(Holder(pgc, te), fake_target(pgc, cp_ranks=(0,))):
        assert te.calls[0][:4] == (None, None, None, "a2a")
    assert dist.get_process_group_ranks(te.cp_group) == [0, 1]


def test_a2a_p2p_without_hierarchical_groups_is_rejected_before_anything_changes(pgc):
    holder = Holder(pgc, TELikeAttention(cp_comm_type="a2a+p2p"))
    with pytest.raises(CPConfigError, match="eval_pgs.hcp"):
        install_pg_collection(holder, fake_target(pgc, cp_ranks=(0, 1, 2, 3)))
    assert holder.pg_collection is pgc and holder.attention.calls == []


def test_nested_use_on_the_same_model_is_rejected(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = snapshot(model)
    with eval_cp_context(model, fake_target(pgc)):
        inner = snapshot(model)
        with pytest.raises(CPConfigError, match="already active"):
            with eval_cp_context(model, fake_target(pgc)):
                pass
        with pytest.raises(CPConfigError, match="already active"):
            install_pg_collection([model.decoder], fake_target(pgc))  # overlapping part too
        assert_same_objects(model, inner)
    assert_same_objects(model, before)


def test_target_with_other_tp_or_pp_members_is_rejected(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = snapshot(model)
    with pytest.raises(CPConfigError) as info:
        install_pg_collection(model, fake_target(pgc, tp=fake_group([0, 1]), pp=fake_group([0, 4])))
    fields = {v.field for v in info.value.violations}
    assert fields == {"eval_pgs.tp", "eval_pgs.pp"}
    assert_same_objects(model, before)
    with eval_cp_context(model, fake_target(pgc)):  # not left marked as active
        pass


def test_target_without_a_cp_group_is_rejected(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    with pytest.raises(CPConfigError, match="eval_pgs.cp"):
        install_pg_collection(model, new_pg_collection(tp=pgc.tp, pp=pgc.pp))


def test_a_model_without_cp_bearing_modules_warns():
    with pytest.warns(EvalCPWarning, match="no CP-bearing module"):
        with eval_cp_context(torch.nn.Linear(2, 2), new_pg_collection(cp=fake_group([0, 1]))) as rebinding:
            assert rebinding.rebound == []


def test_mcore_local_attention_cannot_change_cp_size(pgc):
    model = build_gpt(CFG, pgc, attention="local")
    with pytest.raises(CPConfigError, match="DotProductAttention"):
        install_pg_collection(model, fake_target(pgc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with eval_cp_context(model, single_rank_pg_collection()):  # same CP size: fine
            pass


class GatedDeltaNetLike(torch.nn.Module):
    """Like MCore 0.19's GatedDeltaNet: keeps cp_size = pg_collection.cp.size()."""

    def __init__(self, pgc):
        super().__init__()
        self.pg_collection = pgc
        self.cp_size = pgc.cp.size()


class YarnLike(torch.nn.Module):
    """Like YarnRotaryEmbedding: a cp_group and a cos/sin cache built at the training CP."""

    def __init__(self, cp_group):
        super().__init__()
        self.cp_group = cp_group
        self.max_seq_len_cached, self.offset_cached, self.dtype_cached, self.packed_seq_cached = 16, 0, torch.float32, False
        self.register_buffer("cos_cached", torch.ones(16), persistent=False)
        self.register_buffer("sin_cached", torch.zeros(16), persistent=False)


def test_cached_cp_size_and_derived_caches_follow_the_target(pgc):
    gdn, yarn = GatedDeltaNetLike(pgc), YarnLike(pgc.cp)
    cos = yarn.cos_cached
    holder = torch.nn.ModuleList([gdn, yarn])
    with eval_cp_context(holder, fake_target(pgc, cp_ranks=(0, 1, 2, 3))):
        assert gdn.cp_size == 4 and yarn.cp_group.size() == 4
        assert yarn.max_seq_len_cached == -1  # forces a rebuild at the eval CP
        yarn.cos_cached = torch.full((8,), 2.0)  # what a rebuild would do
    assert gdn.cp_size == 1 and yarn.max_seq_len_cached == 16
    assert yarn.cos_cached is cos and yarn.cp_group is pgc.cp


class FailingAttention(TELikeAttention):
    fail = True

    def set_context_parallel_group(self, *args, **kwargs):
        if self.fail:
            self.cp_group = "half-written"
            raise RuntimeError("TE refused the group")
        super().set_context_parallel_group(*args, **kwargs)


def test_a_failure_midway_restores_what_was_changed(pgc):
    holder = Holder(pgc, FailingAttention())
    with pytest.raises(RuntimeError, match="TE refused"):
        install_pg_collection(holder, fake_target(pgc))
    assert holder.pg_collection is pgc and holder.attention.cp_group is None
    holder.attention.fail = False
    install_pg_collection(holder, fake_target(pgc)).restore()  # the model was not left active


def test_restore_is_idempotent(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = snapshot(model)
    rebinding = install_pg_collection(model, fake_target(pgc))
    assert rebinding.active
    rebinding.restore()
    rebinding.restore()
    assert not rebinding.active
    assert_same_objects(model, before)


# ---------------------------------------------------------------------------------------------
# Eval layout, groups, data ownership


def test_eval_layout_moves_cp_and_dp_only():
    ev = eval_layout(CPLayout(world_size=16, tp=2, pp=2, cp=1), 4)
    assert (ev.tp, ev.pp, ev.cp, ev.dp) == (2, 2, 4, 1)
    hier = eval_layout(CPLayout(world_size=4), 4, hierarchical_sizes=[2, 2])
    assert hier.cp_comm_type == "a2a+p2p" and hier.hierarchical_context_parallel_sizes == [2, 2]
    back = eval_layout(CPLayout(world_size=4, cp=4, cp_comm_type="a2a+p2p",
                                hierarchical_context_parallel_sizes=[2, 2]), 1)
    assert back.cp == 1 and back.dp == 4


def test_eval_layout_comm_type_override_keeps_the_levels_only_for_a2a_p2p():
    train = CPLayout(world_size=8, cp=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 4])
    kept = eval_layout(train, 4, cp_comm_type="a2a+p2p")
    assert (kept.cp, kept.cp_comm_type, kept.hierarchical_context_parallel_sizes) == (4, "a2a+p2p", [2, 2])
    flat = eval_layout(train, 4, cp_comm_type="p2p")
    assert (flat.cp, flat.cp_comm_type, flat.hierarchical_context_parallel_sizes) == (4, "p2p", None)
    a2a = eval_layout(CPLayout(world_size=4), 4, cp_comm_type="a2a")
    assert (a2a.cp_comm_type, a2a.hierarchical_context_parallel_sizes) == ("a2a", None)


def test_eval_layout_errors_name_the_eval_field():
    with pytest.raises(CPConfigError) as info:
        eval_layout(CPLayout(world_size=8, tp=2, seq_length=100), 8)
    fields = {v.field for v in info.value.violations}
    assert "eval_context_parallel_size" in fields
    with pytest.raises(CPConfigError, match="product"):
        eval_layout(CPLayout(world_size=4), 4, hierarchical_sizes=[2, 4])


def test_build_eval_pg_collection_reuses_training_groups_of_the_same_members(pgc):
    layout = CPLayout(world_size=1)
    train = single_rank_pg_collection()
    fresh = build_eval_pg_collection(layout, 1)
    reused = build_eval_pg_collection(layout, 1, train_pgs=train)
    assert fresh.tp is not train.tp
    for field in ("tp", "pp", "cp", "dp", "dp_cp", "tp_cp", "tp_dp_cp", "mp"):
        assert get_pg(reused, field) is get_pg(train, field), field


def test_build_eval_pg_collection_keeps_its_own_group_where_the_training_one_differs_or_is_unset(pgc):
    from cpkit.parallel.group_info import members

    train = new_pg_collection(tp=fake_group([0, 1]), cp=fake_group([0, 1]))  # other members, no hcp
    ev = build_eval_pg_collection(CPLayout(world_size=1), 1, hierarchical_sizes=[1, 1], train_pgs=train)
    assert (members(ev.tp), members(ev.cp)) == ((0,), (0,))
    assert members(get_pg(ev, "hcp")) == ((0,), (0,))


@pytest.mark.parametrize("num_samples,dp_size", [(0, 1), (1, 4), (7, 3), (12, 4), (1024, 256), (13, 8)])
def test_eval_shard_covers_every_sample_exactly_once(num_samples, dp_size):
    shards = [eval_shard(num_samples, r, dp_size) for r in range(dp_size)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(num_samples)) and len(flat) == len(set(flat))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_eval_shard_rejects_a_bad_rank():
    with pytest.raises(CPConfigError, match="dp_rank"):
        eval_shard(8, 4, 4)
    with pytest.raises(CPConfigError, match="num_samples"):
        eval_shard(-1, 0, 1)


def test_evaluate_at_world_size_1_equals_eval_step(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    data = make_batch(CFG, batch_size=5, seed=3)
    result = evaluate(model, data, pgc, micro_batch_size=2)
    assert result.samples == range(5) and result.micro_batches == 3
    assert result.num_tokens == 5 * CFG.seq_length
    assert abs(result.loss - eval_step(model, data, pgc)) < 1e-6
    assert model.training


def test_evaluate_filler_micro_batches_change_nothing_but_the_count(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    data = make_batch(CFG, batch_size=2, seed=4)
    plain = evaluate(model, data, pgc, micro_batch_size=1)
    filled = evaluate(model, data, pgc, micro_batch_size=1, min_micro_batches=4)
    assert (plain.micro_batches, filled.micro_batches) == (2, 4)
    assert filled.num_tokens == plain.num_tokens == 2 * CFG.seq_length
    assert abs(filled.loss - plain.loss) < 1e-7


def test_micro_batches_are_views_of_consecutive_rows_and_filler_is_masked():
    # evaluate() used to gather rows on the CPU per micro-batch (aten::index): 32 ms each on a
    # 64-core GPU host with 4 ranks. Consecutive rows are now views; padding is loss-masked.
    from cpkit.eval_cp.loop import _micro_batches

    data = make_batch(CFG, batch_size=5, seed=5)
    mbs = _micro_batches(data, range(1, 4), 2, pad=True, at_least=3)
    assert [mb["tokens"].shape[0] for mb in mbs] == [2, 2, 2]
    first = mbs[0]["tokens"]
    assert first.data_ptr() == data["tokens"][1].data_ptr() and first.is_contiguous()  # a view
    assert torch.equal(mbs[1]["tokens"][0], data["tokens"][3])
    assert [float(mb["loss_mask"].sum()) for mb in mbs] == [2 * CFG.seq_length, CFG.seq_length, 0.0]


def test_evaluate_pipeline_transfers_skip_the_device_sync_and_leave_the_model_config(pgc, monkeypatch):
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules

    import cpkit.eval_cp.loop as eval_loop

    model = build_gpt(GPTConfig(), pgc)
    assert model.config.batch_p2p_sync and model.config.batch_p2p_comm  # MCore's defaults
    seen = {}

    class Recorder:
        def __init__(self, pp_group, config):
            seen["config"] = config

    monkeypatch.setattr(p2p, "P2PCommunicator", Recorder)
    monkeypatch.setattr(schedules, "get_forward_backward_func", lambda **_: lambda **kw: [])
    monkeypatch.setattr(eval_loop.dist, "all_reduce", lambda *a, **k: None)
    eval_loop._pipeline_sums(model, [{"tokens": torch.zeros(1, 8, dtype=torch.long)}], pgc, 1, torch.device("cpu"))
    quiet = seen["config"]
    assert quiet is not model.config and quiet.batch_p2p_sync is False
    assert model.config.batch_p2p_sync is True  # the model's own config is untouched
    assert quiet.batch_p2p_comm and quiet.pipeline_dtype == model.config.pipeline_dtype
    model.config.batch_p2p_sync = False
    assert eval_loop._no_p2p_sync(model.config) is model.config  # nothing to turn off: no copy


def test_a_replica_without_samples_runs_only_loss_masked_filler():
    # More eval replicas than samples: a replica's shard is empty, yet it must take part in every
    # micro-batch of the pipeline; its one row (copied from the data) is the filler's source.
    from cpkit.eval_cp.loop import _micro_batches

    one_row = make_batch(CFG, batch_size=1, seed=6)
    mbs = _micro_batches(one_row, range(0), 2, pad=True, at_least=3)
    assert len(mbs) == 3
    for mb in mbs:
        assert mb["tokens"].shape[0] == 2 and torch.equal(mb["tokens"][0], one_row["tokens"][0])
        assert float(mb["loss_mask"].sum()) == 0.0
    assert _micro_batches(one_row, range(0), 2, pad=False, at_least=0) == []


# ---------------------------------------------------------------------------------------------
# Rebinding internals the GPT models above do not reach


def test_model_roots_names_the_type_that_is_not_a_module():
    with pytest.raises(CPConfigError, match="int") as info:
        rebind.model_roots([torch.nn.Linear(2, 2), 3])
    assert info.value.violations[0].value == ["int"]
    with pytest.raises(CPConfigError) as info:
        rebind.model_roots([])
    assert info.value.violations[0].value == "[]"


class _GroupHolder(torch.nn.Module):
    """A module on MCore's global groups (pg_collection None) that caches a cp_group of its own."""

    def __init__(self, cp_group):
        super().__init__()
        self.pg_collection = None
        self.cp_group = cp_group


def test_a_module_on_the_global_groups_keeps_its_collection_and_rebinds_its_group(pgc):
    module = _GroupHolder(pgc.cp)
    target = fake_target(pgc)
    with eval_cp_context(module, target) as rebinding:
        assert module.pg_collection is None
        assert module.cp_group is target.cp
        assert rebinding.rebound == ["<model>.cp_group"]
    assert module.cp_group is pgc.cp


def test_side_stream_is_one_stream_per_switch(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda: made.append(object()) or made[-1])
    rebinding = rebind.Rebinding(None, [])
    try:
        first = rebinding.side_stream()
        assert first is not None and first is made[0]
        assert rebinding.side_stream() is first
        assert len(made) == 1
    finally:
        rebinding.restore()


def test_every_derived_cache_attribute_a_rebuild_writes_is_put_back(pgc):
    yarn = YarnLike(pgc.cp)
    before = {attr: getattr(yarn, attr) for attr in
              ("offset_cached", "dtype_cached", "packed_seq_cached", "cos_cached", "sin_cached")}
    with eval_cp_context(yarn, fake_target(pgc, cp_ranks=(0, 1, 2, 3))):
        # what YaRN's get_cached_cos_sin writes when it rebuilds at the eval CP
        yarn.offset_cached, yarn.dtype_cached, yarn.packed_seq_cached = 3, torch.bfloat16, True
        yarn.cos_cached, yarn.sin_cached = torch.full((8,), 2.0), torch.full((8,), 3.0)
    for attr, value in before.items():
        assert getattr(yarn, attr) is value, attr


def test_a_given_comm_type_reaches_the_config_only_when_given(pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    config = model.config
    trained = config.cp_comm_type
    with eval_cp_context(model, fake_target(pgc)):
        assert config.cp_comm_type == trained
    with eval_cp_context(model, fake_target(pgc), cp_comm_type="all_gather"):
        assert config.cp_comm_type == "all_gather"
    assert config.cp_comm_type == trained


class _NoStrategyAttention(TELikeAttention):
    """TE before load-balancing strategies: set_context_parallel_group takes no strategy."""

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.calls.append((cp_group, cp_global_ranks, cp_stream, cp_comm_type))
        self.cp_group, self.cp_global_ranks, self.cp_comm_type = cp_group, cp_global_ranks, cp_comm_type


def test_the_strategy_is_passed_only_to_a_set_context_parallel_group_that_takes_it(pgc):
    old = _NoStrategyAttention()  # keeps a load_balancing_strategy it cannot be given
    target = fake_target(pgc)
    with eval_cp_context(Holder(pgc, old), target):
        assert old.calls == [(target.cp, [0, 1], TELikeAttention.cp_stream, "p2p")]
    new = TELikeAttention()
    new.load_balancing_strategy = None  # none set: the callee's own default applies
    with eval_cp_context(Holder(pgc, new), fake_target(pgc)):
        assert new.calls[0][4] == "default"


class _RefusesOtherSizes(torch.nn.Module):
    """A module that cannot change its CP size and knows it only through its cp_group."""

    def __init__(self, cp_group):
        super().__init__()
        self.cp_group = cp_group


def test_a_module_that_cannot_change_cp_size_is_measured_by_its_cp_group(pgc, monkeypatch):
    monkeypatch.setitem(rebind.UNSUPPORTED_MODULES, rebind._qualname(_RefusesOtherSizes), "built for one size")
    module = _RefusesOtherSizes(fake_group([0, 1]))
    with eval_cp_context(module, fake_target(pgc, cp_ranks=(0, 1))):
        assert module.cp_group.size() == 2
    with pytest.raises(CPConfigError, match=r"cannot change CP size 2 -> 4: built for one size"):
        install_pg_collection(module, fake_target(pgc, cp_ranks=(0, 1, 2, 3)))


# ---------------------------------------------------------------------------------------------
# Eval loop details

def test_reduce_eval_loss_of_a_single_token_is_its_loss(pgc):
    assert reduce_eval_loss(torch.tensor(2.5), torch.tensor(1), pgc) == (2.5, 1.0)
    mean, count = reduce_eval_loss(torch.tensor(0.0), torch.tensor(0), pgc)
    assert math.isnan(mean) and count == 0.0


def test_reduce_eval_loss_sums_loss_and_tokens_over_the_dp_cp_group(pgc, monkeypatch):
    """A stand-in dp x cp group of two whose other rank holds loss 6 over 3 tokens."""
    seen = []
    monkeypatch.setattr(eval_loop, "group_size", lambda group: 2)

    def all_reduce(buf, group=None):
        seen.append(group)
        buf.add_(torch.tensor([6.0, 3.0], dtype=buf.dtype))

    monkeypatch.setattr(eval_loop.dist, "all_reduce", all_reduce)
    assert reduce_eval_loss(torch.tensor(2.0), torch.tensor(1), pgc) == (2.0, 4.0)
    assert seen == [pgc.dp_cp]


def test_the_pipeline_schedule_sums_what_the_plain_loop_sums(pgc):
    """_pipeline_sums through MCore's schedule at pp = 1 (its no-pipelining function) gives the
    loss sum and token count of the forward loop evaluate() runs at pp = 1."""
    from cpkit.eval_cp.loop import _micro_batches, _pipeline_sums

    model = build_gpt(CFG, pgc, attention="cpkit").eval()
    data = make_batch(CFG, batch_size=3, seed=7)
    local = eval_loop._micro_batches(data, range(3), 2, pad=True, at_least=0)
    with torch.no_grad():
        sums = eval_loop._pipeline_sums(model, local, pgc, 2, torch.device("cpu"))
    plain = evaluate(model, data, pgc, micro_batch_size=2)
    assert float(sums[1]) == plain.num_tokens == 3 * CFG.seq_length
    assert abs(float(sums[0]) / float(sums[1]) - plain.loss) < 1e-6

"""Eval-CP rebinding behaviour, run against every implementation of the protocol in
cpkit.testing.eval_cp_impls: cpkit's eval_cp_context, a stand-in that re-installs the training
groups on exit, and Megatron-Bridge's eval_cp_context when CPKIT_BRIDGE_SRC names a checkout's
src/ (skipped otherwise). An implementation's known deviations are strict xfails.

World size 1: real MCore GPT modules (cpkit.testing.models), and process groups on torch's
fake backend (cpkit.testing.fakes.fake_group, real ProcessGroups that torch.distributed answers
for) where a CP size > 1 is needed. One thing of the environment is set for every test
(fixture `_environment`): MCore's `megatron.core.extensions.transformer_engine.TEDotProductAttention` is `TELikeAttention`
  (TE's set_context_parallel_group signature, a class-level cp_stream), so an implementation that
  finds TE attention through that class (Bridge) finds the stand-in, as it finds MCore's class
  with TE installed. Without TE, MCore puts a MagicMock there;
  test_rebinding_works_without_transformer_engine runs with that instead.

Validate a change to Bridge's module with:
    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python3 -m pytest tests/test_eval_cp_protocol.py -q -rsxX
"""

from __future__ import annotations

import copy
import importlib
import textwrap

import pytest
import torch

from cpkit.compat import new_pg_collection
from cpkit.errors import CPConfigError
from cpkit.testing.models import GPTConfig, build_gpt
from cpkit.testing import eval_cp_impls
from cpkit.testing.fakes import fake_group
from cpkit.testing.reference import single_rank_pg_collection
from cpkit.testing.te_support import TELikeAttention, assert_rebind_restored, rebind_snapshot, te_skip_reason

CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)
IMPLS = eval_cp_impls.available_impls()


def pytest_generate_tests(metafunc):
    """Parametrize every test that takes `impl` over IMPLS, with each one's skip and xfails."""
    if "impl" not in metafunc.fixturenames:
        return
    params = []
    for impl in IMPLS:
        marks = []
        if impl.skip_reason:
            marks.append(pytest.mark.skip(reason=impl.skip_reason))
        deviation = impl.deviations.get(metafunc.function.__name__)
        if deviation:
            marks.append(pytest.mark.xfail(strict=True, raises=deviation.raises,
                                           reason=f"{deviation.upstream}: {deviation.reason}"))
        params.append(pytest.param(impl, id=impl.name, marks=marks))
    metafunc.parametrize("impl", params)


_TE_EXTENSION = importlib.import_module("megatron.core.extensions.transformer_engine")
_TE_AS_INSTALLED = _TE_EXTENSION.TEDotProductAttention


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    """MCore's TE attention class is TELikeAttention."""
    monkeypatch.setattr(_TE_EXTENSION, "TEDotProductAttention", TELikeAttention)


@pytest.fixture(scope="module")
def pgc(mcore_cpu):
    return single_rank_pg_collection()


def fake_target(pgc, cp_ranks=(0, 1)):
    """An eval collection at CP = len(cp_ranks) on the model's tp and pp groups."""
    cp = fake_group(cp_ranks)
    return new_pg_collection(tp=pgc.tp, pp=pgc.pp, mp=pgc.mp, cp=cp, dp=fake_group([0]),
                             tp_cp=fake_group(cp_ranks), dp_cp=fake_group(cp_ranks), tp_dp_cp=fake_group(cp_ranks))


def assert_on(model, target):
    """Every cached collection is `target`, every cp_group its cp, every config at its CP size."""
    checked = 0
    for name, m in model.named_modules():
        attrs = vars(m)
        if attrs.get("pg_collection") is not None:
            assert attrs["pg_collection"] is target, f"{name}.pg_collection"
            checked += 1
        if "cp_group" in attrs:
            assert attrs["cp_group"] is target.cp, f"{name}.cp_group"
            checked += 1
        config = getattr(m, "config", None)
        if config is not None:
            assert config.context_parallel_size == target.cp.size(), f"{name}.config"
    return checked


def rope_cache_size(model):
    return type(model.rotary_pos_emb).forward.cache_info().currsize


# ---------------------------------------------------------------------------------------------
# The protocol


def test_every_cp_reference_is_the_target_inside_and_the_original_after(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    target = fake_target(pgc)
    before = rebind_snapshot(model)
    with impl.context(model, target, pgc):
        # GPTModel, decoder, 2 layers, 2 attentions, 2 core attentions, RoPE and the model's cp_group
        assert assert_on(model, target) >= 10
        assert model.rotary_pos_emb.cp_group is target.cp
    assert_rebind_restored(before)
    assert model.config.context_parallel_size == 1


def test_an_exception_inside_the_block_restores(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = rebind_snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with impl.context(model, fake_target(pgc), pgc):
            assert model.config.context_parallel_size == 2
            raise RuntimeError("boom")
    assert_rebind_restored(before)
    target = fake_target(pgc)
    with impl.context(model, target, pgc):  # and the model can be switched again
        assert_on(model, target)
    assert_rebind_restored(before)


def test_1000_enter_exit_cycles_leave_no_drift(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = rebind_snapshot(model)
    dicts = {name: dict(vars(m)) for name, m in model.named_modules()}
    targets = [fake_target(pgc), fake_target(pgc, cp_ranks=(0, 1, 2, 3))]
    for i in range(1000):
        with impl.context(model, targets[i % 2], pgc):
            pass
    assert_rebind_restored(before)
    for name, m in model.named_modules():
        now = vars(m)
        assert now.keys() == dicts[name].keys(), name
        assert all(now[k] is v for k, v in dicts[name].items()), name


def test_a_list_of_vpp_chunks_is_rebound_and_a_shared_config_restored(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    chunks = [model.decoder.layers[0], model.decoder.layers[1]]  # two chunks sharing model.config
    before = rebind_snapshot(model)
    target = fake_target(pgc)
    with impl.context(chunks, target, pgc):
        for chunk in chunks:
            assert_on(chunk, target)
            assert chunk.self_attention.core_attention.cp_group is target.cp
        assert model.config.context_parallel_size == 2
        assert model.pg_collection is pgc  # not part of the chunks
    assert_rebind_restored(before)


def test_two_models_in_a_list_each_get_their_config(impl, pgc):
    a, b = build_gpt(CFG, pgc), build_gpt(CFG, pgc)
    assert a.config is not b.config
    before = rebind_snapshot(a) + rebind_snapshot(b)
    with impl.context([a, b], fake_target(pgc), pgc):
        assert a.config.context_parallel_size == b.config.context_parallel_size == 2
    assert a.config.context_parallel_size == b.config.context_parallel_size == 1
    assert_rebind_restored(before)


def test_rope_cache_is_cleared_on_entry_and_on_exit(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    rope = model.rotary_pos_emb
    full = rope(CFG.seq_length)
    assert rope_cache_size(model) >= 1
    with impl.context(model, fake_target(pgc), pgc):
        assert rope_cache_size(model) == 0
        sliced = rope(CFG.seq_length)  # CP rank 0 of 2: chunks 0 and 3 of 4
        q = CFG.seq_length // 4
        torch.testing.assert_close(sliced, torch.cat([full[:q], full[3 * q:]]), rtol=0, atol=0)
        assert rope_cache_size(model) >= 1
    assert rope_cache_size(model) == 0
    torch.testing.assert_close(rope(CFG.seq_length), full, rtol=0, atol=0)


def test_cp_attention_built_without_cp_holds_none_again(impl, pgc):
    model = build_gpt(CFG, pgc, attention="cpkit")
    attention = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(a.cp_group is None and a.cp_global_ranks is None for a in attention)  # built at CP 1
    with impl.context(model, fake_target(pgc), pgc):
        assert all(a.cp_group.size() == 2 for a in attention)
    assert all(a.cp_group is None and a.cp_global_ranks is None for a in attention)


class Holder(torch.nn.Module):
    def __init__(self, pgc, *children):
        super().__init__()
        self.pg_collection = pgc
        self.children_ = torch.nn.ModuleList(children)


def test_te_like_attention_is_bound_inside_and_restored_after(impl, pgc):
    te = TELikeAttention()
    holder = Holder(pgc, te)
    target = fake_target(pgc)
    before = rebind_snapshot(holder)
    with impl.context(holder, target, pgc):
        group, ranks, stream, comm, _ = te.calls[-1]
        assert (group, ranks, comm) == (target.cp, [0, 1], "p2p")
        assert stream is TELikeAttention.cp_stream
        assert holder.pg_collection is target
    # cp_group / cp_global_ranks back to None (built at cp=1), the strategy kept, and no
    # instance cp_stream shadowing the class-level one
    assert_rebind_restored(before)


class GatedDeltaNetLike(pytest.importorskip("megatron.core.ssm.gated_delta_net").GatedDeltaNet):
    """Of MCore's GatedDeltaNet class, built without its __init__ (which needs FLA and CUDA).
    Like MCore 0.19's it keeps cp_size = pg_collection.cp.size() and derives its per-rank split
    from it in _setup_variant_attrs at build (0.19 names it feat_dim_split)."""

    def __init__(self, pgc, heads=8):
        torch.nn.Module.__init__(self)
        self.pg_collection, self.num_value_heads = pgc, heads
        self.cp_size = pgc.cp.size()
        self._setup_variant_attrs()

    def _setup_variant_attrs(self):
        self.feat_dim_split = (3 * self.num_value_heads // self.cp_size, self.num_value_heads // self.cp_size)


def test_a_cached_cp_size_follows_the_target(impl, pgc):
    gdn = GatedDeltaNetLike(pgc)
    with impl.context(Holder(pgc, gdn), fake_target(pgc, cp_ranks=(0, 1, 2, 3)), pgc):
        assert gdn.cp_size == 4
    assert gdn.cp_size == 1 and gdn.pg_collection is pgc


def test_a_cached_cp_size_rederives_what_was_built_from_it(impl, pgc):
    gdn = GatedDeltaNetLike(pgc)
    with impl.context(Holder(pgc, gdn), fake_target(pgc, cp_ranks=(0, 1, 2, 3)), pgc):
        assert gdn.feat_dim_split == (6, 2), "the split of a GatedDeltaNet built at CP 4"
    assert gdn.feat_dim_split == (24, 8)


def test_a_module_on_another_collection_gets_it_back(impl, pgc):
    """A sub-model built on another collection (same tp/pp groups, another object) holds that
    collection again after the block: after a plain exit, after an exception, after 200 cycles."""
    model = build_gpt(CFG, pgc, attention="cpkit")
    other = copy.copy(pgc)
    on_other = [m for m in model.decoder.layers[1].modules() if vars(m).get("pg_collection") is pgc]
    for m in on_other:
        m.pg_collection = other
    assert len(on_other) >= 3  # the layer, its attention and core attention
    before = rebind_snapshot(model)
    target = fake_target(pgc)
    with impl.context(model, target, pgc):
        assert all(m.pg_collection is target for m in on_other)
    assert all(m.pg_collection is other for m in on_other), "after a plain exit"
    with pytest.raises(RuntimeError, match="boom"):
        with impl.context(model, target, pgc):
            raise RuntimeError("boom")
    assert all(m.pg_collection is other for m in on_other), "after an exception"
    for _ in range(200):
        with impl.context(model, target, pgc):
            pass
    assert all(m.pg_collection is other for m in on_other), "after 200 cycles"
    assert_rebind_restored(before)


def test_rebinding_works_without_transformer_engine(impl, pgc, monkeypatch):
    """MCore's TE extension as it is without TE installed (TEDotProductAttention a MagicMock)."""
    reason = te_skip_reason()
    if reason is None:
        pytest.skip("Transformer Engine is installed: MCore's no-TE TEDotProductAttention is not there")
    monkeypatch.setattr(_TE_EXTENSION, "TEDotProductAttention", _TE_AS_INSTALLED)
    model = build_gpt(CFG, pgc, attention="cpkit")
    before = rebind_snapshot(model)
    target = fake_target(pgc)
    with impl.context(model, target, pgc):
        assert_on(model, target)
    assert_rebind_restored(before)


# ---------------------------------------------------------------------------------------------
# The implementations and their records


def test_every_recorded_deviation_names_a_protocol_test():
    tests = {name for name, fn in globals().items() if name.startswith("test_") and callable(fn)}
    for impl in IMPLS:
        stale = set(impl.deviations) - tests
        assert not stale, f"{impl.name} records deviations for tests that do not exist: {sorted(stale)}"


def test_without_a_checkout_bridge_is_skipped_with_one_line(monkeypatch):
    monkeypatch.delenv(eval_cp_impls.BRIDGE_SRC_ENV, raising=False)
    monkeypatch.setattr(eval_cp_impls.importlib.util, "find_spec", lambda name: None)
    impl = eval_cp_impls.bridge_impl()
    assert impl.context is None and "\n" not in impl.skip_reason
    assert eval_cp_impls.BRIDGE_SRC_ENV in impl.skip_reason


def test_a_bridge_src_without_the_module_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv(eval_cp_impls.BRIDGE_SRC_ENV, str(tmp_path))
    with pytest.raises(CPConfigError, match="CPKIT_BRIDGE_SRC") as info:
        eval_cp_impls.bridge_impl()
    assert str(eval_cp_impls.BRIDGE_MODULE_PATH) in str(info.value)


def test_the_bridge_adapter_loads_the_file_alone_and_passes_train_pgs(monkeypatch, tmp_path, pgc):
    """A tree shaped like Bridge's src/ whose module records its calls: the adapter loads that one
    file (no package __init__ exists) and calls eval_cp_context(model, eval_pgs, train_pgs)."""
    path = tmp_path / eval_cp_impls.BRIDGE_MODULE_PATH
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent("""
        import contextlib
        CALLS = []

        @contextlib.contextmanager
        def eval_cp_context(model, eval_pgs, train_pgs):
            CALLS.append((model, eval_pgs, train_pgs))
            yield
    """))
    monkeypatch.setenv(eval_cp_impls.BRIDGE_SRC_ENV, str(tmp_path))
    impl = eval_cp_impls.bridge_impl()
    assert impl.skip_reason is None and impl.deviations
    model, target = torch.nn.Linear(2, 2), fake_target(pgc)
    with impl.context(model, target, pgc):
        pass
    assert eval_cp_impls._load_bridge(path).CALLS == [(model, target, pgc)]


def test_a_bridge_module_that_imports_other_bridge_modules_says_how_to_load_them(monkeypatch, tmp_path):
    path = tmp_path / eval_cp_impls.BRIDGE_MODULE_PATH
    path.parent.mkdir(parents=True)
    path.write_text("from megatron.bridge.training.config import ConfigContainer\n")
    monkeypatch.setenv(eval_cp_impls.BRIDGE_SRC_ENV, str(tmp_path))
    with pytest.raises(ImportError, match="another Bridge module.*pip install -e"):
        eval_cp_impls.bridge_impl()

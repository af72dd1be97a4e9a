"""cpkit.testing.models at world size 1: builds on CPU, runs forward + backward, weights are deterministic."""

import pytest
import torch

from cpkit.testing.models import GPTConfig, build_gpt, eval_step, make_batch, named_gradients, train_step
from cpkit.testing.reference import single_rank_pg_collection

CFG = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)


@pytest.fixture(scope="module")
def pgc(mcore_cpu):
    return single_rank_pg_collection()


def test_forward_backward_on_cpu(pgc):
    model = build_gpt(CFG, pgc, attention="local")
    batch = make_batch(CFG, batch_size=2)
    loss = train_step(model, batch, pgc, lr=0.0)
    # Random weights with std 0.02 give near-uniform logits: the loss is about ln(vocab).
    assert abs(loss - torch.log(torch.tensor(float(CFG.vocab_size))).item()) < 0.5
    grads = named_gradients(model)
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


def test_weights_are_a_function_of_the_seed_only(pgc):
    a = build_gpt(CFG, pgc, attention="local")
    b = build_gpt(CFG, pgc, attention="cpkit")
    c = build_gpt(CFG.with_(seed=CFG.seed + 1), pgc, attention="local")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    params = [n for n, _ in a.named_parameters()]
    for name in params:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0)
    assert any(not torch.equal(sa[n], sc[n]) for n in params)


def test_cpkit_attention_at_cp1_matches_mcore_local_attention(pgc):
    batch = make_batch(CFG, batch_size=2)
    local = build_gpt(CFG, pgc, attention="local")
    ours = build_gpt(CFG, pgc, attention="cpkit")
    assert abs(eval_step(local, batch, pgc) - eval_step(ours, batch, pgc)) < 1e-5
    train_step(local, batch, pgc, lr=0.0)
    train_step(ours, batch, pgc, lr=0.0)
    ga, gb = named_gradients(local), named_gradients(ours)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6)


def test_unknown_attention_backend_is_rejected(pgc):
    with pytest.raises(ValueError, match="attention='flash'"):
        build_gpt(CFG, pgc, attention="flash")


def test_config_error_survives_mcore_build_module_rewrap(pgc):
    """MCore's build_module re-raises `type(e)(f"{e} when instantiating X")`: CPConfigError must
    keep its violations through that, or users get an AttributeError instead of the fix."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from cpkit.errors import CPConfigError

    class Refuses(torch.nn.Module):
        def __init__(self):
            raise CPConfigError.single("cp_comm_type", "a2a+p2p", "needs pg_collection.hcp", "pass hcp")

    with pytest.raises(CPConfigError) as info:
        build_module(ModuleSpec(module=Refuses))
    assert info.value.field == "cp_comm_type"
    assert "needs pg_collection.hcp" in str(info.value) and "when instantiating" in str(info.value)


def test_te_fused_norm_names_map_to_the_local_spec_names():
    from cpkit.testing.models import local_spec_name

    assert local_spec_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.1.input_layernorm.weight"
    assert local_spec_name("decoder.layers.0.mlp.linear_fc1.layer_norm_bias") == \
        "decoder.layers.0.pre_mlp_layernorm.bias"
    assert local_spec_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"


def test_train_step_refuses_pipeline_parallel_with_a_clear_error(pgc):
    from cpkit.compat import new_pg_collection
    from cpkit.errors import CPConfigError

    class TwoStages:
        def size(self):
            return 2

    model = build_gpt(CFG, pgc, attention="local")
    fake = new_pg_collection(**{**{k: getattr(pgc, k) for k in ("tp", "cp", "dp", "dp_cp")}, "pp": TwoStages()})
    with pytest.raises(CPConfigError, match="pp=2: train_step runs the whole model on one pipeline stage"):
        train_step(model, make_batch(CFG), fake)

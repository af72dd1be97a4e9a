"""Scenario of functional/test_eval_cp.py and `python -m cpkit.cluster eval-cp`: a GPT trained
at one CP size evaluates at another (eval_cp_context), with the training layout's loss, each
sample evaluated once, and an exact restore. Checks and tolerances: functional/test_eval_cp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpkit.compat import get_pg
from cpkit.eval_cp.context import build_eval_pg_collection, eval_cp_context, evaluate
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.process_device import device
from cpkit.sharding import shard_batch
from cpkit.testing.models import GPTConfig, build_gpt, eval_step, make_batch, train_step
from cpkit.testing.reference import single_rank_pg_collection

__all__ = ["cases", "cluster_cases", "eval_cp_scenario"]

TOL = {torch.float32: dict(loss=1e-5, train=0.0), torch.bfloat16: dict(loss=5e-3, train=5e-3)}
HEADS, KV_HEADS = 8, 4


def _case(cid, cp_train, cp_eval, *, tp=1, pp=1, iters=1, train_hcp=None, eval_hcp=None):
    return dict(id=cid, tp=tp, pp=pp, cp_train=cp_train, cp_eval=cp_eval, iters=iters,
                train_hcp=train_hcp, eval_hcp=eval_hcp)


def cases(backend: str, world_size: int):
    """The functional grid on 2 or 4 ranks (nccl adds TP2 and PP2 cases on 4)."""
    if world_size == 2:
        return [
            _case("cp1-to-cp2", 1, 2),
            _case("cp1-to-cp2-switch-every-iteration", 1, 2, iters=5),
            _case("cp2-to-cp1", 2, 1),
        ]
    cases = [
        _case("cp1-to-cp2", 1, 2),
        _case("cp1-to-cp4", 1, 4),
        _case("cp1-to-hcp[2,2]", 1, 4, eval_hcp=[2, 2]),
        _case("hcp[2,2]-to-cp1", 4, 1, train_hcp=[2, 2]),
    ]
    if backend == "nccl":
        cases += [_case("tp2-cp1-to-cp2", 1, 2, tp=2), _case("pp2-cp1-to-cp2", 1, 2, pp=2)]
    return cases


def _comm(hcp):
    return "a2a+p2p" if hcp else "p2p"


def _train_batch(cfg, pgs, dp, step, dev):
    """This rank's part of the global training batch of `step`: its dp rows, its CP shard."""
    batch = make_batch(cfg, batch_size=2 * dp, seed=100 + step)
    dp_rank = dist.get_rank(get_pg(pgs, "dp"))
    local = {k: v.chunk(dp, dim=0)[dp_rank].contiguous() for k, v in batch.items()}
    return {k: v.to(dev) for k, v in shard_batch(local, get_pg(pgs, "cp")).items()}


def _check_ownership(result, pgs, num_samples, seq):
    """Every sample evaluated by exactly one eval dp replica, and by every rank of it."""
    me = (dist.get_rank(get_pg(pgs, "dp")), list(result.samples))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    by_replica: dict[int, list] = {}
    for dp_rank, samples in everyone:
        assert by_replica.setdefault(dp_rank, samples) == samples, "ranks of one replica disagree"
    flat = [i for samples in by_replica.values() for i in samples]
    assert sorted(flat) == list(range(num_samples)), f"samples {sorted(flat)} != range({num_samples})"
    assert result.num_tokens == num_samples * seq, f"tokens {result.num_tokens} != {num_samples * seq}"


def _reference_loss(cfg, model, val, dev):
    """Single-rank evaluation of the same weights (tp = pp = 1 only)."""
    ref_pgs = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgs, attention="cpkit", device=dev)
    ref.load_state_dict(model.state_dict())
    return evaluate(ref, val, ref_pgs, micro_batch_size=2).loss


@torch.no_grad()
def _sharpen(model):
    """Scale the attention and output projections (fp32 only): with init_weights' std 0.02
    attention is nearly uniform and a wrong RoPE position or chunk order moves the loss by only
    ~1e-4; sharpened, a swap of two sequence chunks moves it by ~2e-2, 2000x the fp32 tolerance.
    bf16 runs keep the plain weights, whose bf16 error is known to fit 5e-3 (functional/test_gpt.py)."""
    if next(model.parameters()).dtype != torch.float32:
        return model
    for name, p in model.named_parameters():
        if "linear_qkv.weight" in name:
            p.mul_(8.0)
        elif name.endswith(("output_layer.weight", "linear_proj.weight", "linear_fc2.weight")):
            p.mul_(4.0)
    return model


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def eval_cp_scenario(case):
    """One case on every rank (the checks in functional/test_eval_cp.py); returns {iteration:
    (loss at the training layout, loss at the eval layout)}."""
    install_mcore_cpu_shim()
    dev = device()
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    tol = TOL[dtype]
    world = dist.get_world_size()
    seq = 64 if dev.type == "cpu" else 4096
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
                    seq_length=seq, dtype=dtype)
    layout = CPLayout(world_size=world, tp=case["tp"], pp=case["pp"], cp=case["cp_train"],
                      cp_comm_type=_comm(case["train_hcp"]),
                      hierarchical_context_parallel_sizes=case["train_hcp"], seq_length=seq,
                      num_attention_heads=HEADS, num_query_groups=KV_HEADS)
    train_pgs = build_pg_collection(layout)
    eval_pgs = build_eval_pg_collection(layout, case["cp_eval"], hierarchical_sizes=case["eval_hcp"],
                                        train_pgs=train_pgs)
    assert eval_pgs.tp is train_pgs.tp and eval_pgs.pp is train_pgs.pp
    build = dict(attention="cpkit", cp_comm_type=_comm(case["train_hcp"]),
                 hierarchical_cp_sizes=case["train_hcp"], device=dev)
    model = _sharpen(build_gpt(cfg, train_pgs, **build))
    trains = case["pp"] == 1  # cpkit.testing.models.train_step has no pipeline schedule
    control = _sharpen(build_gpt(cfg, train_pgs, **build)) if trains else None
    eval_comm = _comm(case["eval_hcp"]) if case["eval_hcp"] else None
    num_samples = 2 * world - 2  # uneven over 4 dp ranks, a partly filled micro-batch
    val = make_batch(cfg, batch_size=num_samples, seed=7)
    report = {}
    for it in range(case["iters"]):
        if trains:
            batch = _train_batch(cfg, train_pgs, layout.dp, it, dev)
            loss, closs = train_step(model, batch, train_pgs), train_step(control, batch, train_pgs)
            assert abs(loss - closs) <= tol["train"], f"iteration {it}: train loss {loss} vs never-switched {closs}"
        probe_batch = _train_batch(cfg, train_pgs, layout.dp, 1000, dev)
        probe = eval_step(model, probe_batch, train_pgs) if trains else None
        at_train = evaluate(model, val, train_pgs, micro_batch_size=2)
        with eval_cp_context(model, eval_pgs, cp_comm_type=eval_comm):
            assert model.config.context_parallel_size == case["cp_eval"]
            core = model.decoder.layers[0].self_attention.core_attention
            assert core.cp_size == case["cp_eval"]
            at_eval = evaluate(model, val, eval_pgs, micro_batch_size=2)
        assert model.config.context_parallel_size == case["cp_train"]
        delta = abs(at_eval.loss - at_train.loss)
        assert delta <= tol["loss"], f"iteration {it}: eval loss {at_eval.loss} at cp={case['cp_eval']} vs {at_train.loss}"
        if it == 0:
            _check_ownership(at_eval, eval_pgs, num_samples, seq)
            _check_ownership(at_train, train_pgs, num_samples, seq)
            if case["tp"] == 1 and case["pp"] == 1:
                ref = _reference_loss(cfg, model, val, dev)
                assert abs(at_train.loss - ref) <= tol["loss"], f"eval loss {at_train.loss} vs single rank {ref}"
            elif case["pp"] > 1:  # untrained: the seed gives the single-rank weights
                ref_pgs = single_rank_pg_collection()
                ref_model = _sharpen(build_gpt(cfg, ref_pgs, attention="cpkit", device=dev))
                ref = evaluate(ref_model, val, ref_pgs, micro_batch_size=2).loss
                assert abs(at_train.loss - ref) <= tol["loss"], f"eval loss {at_train.loss} vs single rank {ref}"
        if trains:
            assert eval_step(model, probe_batch, train_pgs) == probe, "forward after the restore changed"
        else:
            again = evaluate(model, val, train_pgs, micro_batch_size=2)
            assert again.loss == at_train.loss, "evaluation after the restore changed"
        report[it] = (at_train.loss, at_eval.loss)
    if trains:
        batch = _train_batch(cfg, train_pgs, layout.dp, case["iters"], dev)
        loss, closs = train_step(model, batch, train_pgs), train_step(control, batch, train_pgs)
        assert abs(loss - closs) <= tol["train"], f"train loss after the switches {loss} vs never-switched {closs}"
        if tol["train"] == 0.0:
            mine, theirs = _params(model), _params(control)
            for name, p in mine.items():
                assert torch.equal(p, theirs[name]), f"parameter {name} differs from the never-switched run"
    return report


def cluster_cases(backend: str, world_size: int, a2a_sizes) -> list[dict]:
    """Cases for `python -m cpkit.cluster eval-cp` on an even world size: the 4-rank grid where 4
    divides it, else the 2-rank one, without hierarchical cases whose a2a level is not in
    `a2a_sizes` (those that fit the nodes)."""
    if world_size % 2:
        return []
    grid = cases(backend, 4 if world_size % 4 == 0 else 2)
    return [c for c in grid if all((h or [1])[0] in a2a_sizes for h in (c["train_hcp"], c["eval_hcp"]))]

"""Scenario of functional/test_loss_matrix.py: the loss a user reads and every gradient, through
MCore's own training step, equal cp=1 on the same global batch.

One cell = one layout (cp, dp, pp) x one model (dense GPT, MoE GPT with the router's aux loss and
z-loss, GPT with MTP) x `calculate_per_token_loss` on or off. Both runs go through
`get_forward_backward_func` with a Megatron-LM-shaped `loss_func` (pretrain_gpt.py: the model
computes per-token losses from labels; loss_func returns (sum of masked losses, token count,
{"lm loss": [sum, count]})) and MCore's `finalize_model_grads`, the model given DDP's gradient
reduction by cpkit.loss.attach_grad_sync. The reported loss is Megatron-LM's reduction
(cpkit.loss.reduce_reported_losses); the MoE terms are MCore's aux-loss tracker, reduced as
`reduce_aux_losses_tracker_across_ranks` does and read on the last rank, as Megatron-LM logs them.

Reference: the same weights on every rank alone (every group of size 1, pp = 1), the dp x M
micro-batches of the global batch in one step, so each micro-batch's tokens and each aux loss's
batch are the same as in the layout. Its "lm loss" is also checked against a plain cross entropy.

A user's own loss function: `CPKIT_LOSS_FUNC=module:function` (see loss_func_from_env) runs every
cell with it instead of `megatron_loss_func`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from cpkit.compat import get_pg, schedule_pg_collection
from cpkit.parallel.group_info import group_size
from cpkit.parallel.groups import build_pg_collection
from cpkit.parallel.layout import CPLayout
from cpkit.loss import attach_grad_sync, reduce_group, reduce_reported_losses
from cpkit.mcore_cpu import install_mcore_cpu_shim
from cpkit.process_device import device
from cpkit.sharding import shard_batch
from cpkit.testing.models import GPTConfig, build_gpt, make_batch, named_gradients
from cpkit.testing.reference import single_rank_pg_collection

__all__ = ["CPU_SEQ_LENGTH", "CUDA_SEQ_LENGTH", "LOSS_FUNC_ENV", "TOL", "cases", "cell_layout", "dynamic_cases", "dynamic_loss_scenario", "loss_func_from_env",
           "loss_matrix_scenario", "megatron_loss_func"]

LOSS_FUNC_ENV = "CPKIT_LOSS_FUNC"
TOL = dict(loss=1e-5, rtol=1e-5, atol=1e-5)
"""fp32 on every backend: the matrix checks how MCore scales each term under CP, which fp32 shows
and bf16 hides (two bf16 runs differ by more than a missing factor of a few thousand tokens'
share: at seq 4096 in bf16 the MTP defect, 0.05%, passed). Relative above 1 on reported values."""
CPU_SEQ_LENGTH = 48
CUDA_SEQ_LENGTH = 3072
"""Sequence lengths of the dense and MoE cells (MTP cells run at CPU_SEQ_LENGTH on every
backend: its defects move one token per CP rank, visible only on short shards). Both are
divisible by 2 * cp for every cp of the grid (2, 3, 4: multiples of 24); 4096 is not (cp 3)."""
MICRO_BATCHES = 2  # per dp rank
MODELS = {
    "dense": {},
    "moe": dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1,
                moe_z_loss_coeff=0.1, moe_router_load_balancing_type="aux_loss",
                moe_token_dispatcher_type="allgather", add_bias_linear=False),
    "mtp": dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.5),
}
"""GPTConfig.extra per model: the aux and z-loss coefficients are large so that a term scaled by
the CP size moves the router's gradients well past the fp32 tolerance."""


def megatron_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's pretrain_gpt.loss_func: per-token losses [b, s] and the loss mask in, out
    (sum of masked losses, token count (int), {"lm loss": [sum, count]}). MCore's schedule
    divides by the count unless calculate_per_token_loss; finalize_model_grads divides by the
    count summed over dp x cp when it is on."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": reporting}


def loss_func_from_env() -> Callable:
    """The loss function the matrix runs: `module:function` from CPKIT_LOSS_FUNC, else
    megatron_loss_func. The function takes (loss_mask [b, s], per-token losses [b, s]) and
    returns (loss, num_tokens, {name: tensor [sum, count]}) like Megatron-LM's. Raises
    ValueError naming the variable for a value that is not `module:function` or not importable."""
    spec = os.environ.get(LOSS_FUNC_ENV, "").strip()
    if not spec:
        return megatron_loss_func
    module, sep, name = spec.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{LOSS_FUNC_ENV}={spec!r}: must be 'module:function', e.g. 'my_train.losses:loss_func'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{LOSS_FUNC_ENV}={spec!r}: cannot import it ({exc}); put its package on PYTHONPATH") from exc


def _case(backend, cp, dp, pp, model, per_token, *, masked=False):
    tag = "tok" if per_token else "mean"
    cid = f"cp{cp}-dp{dp}-pp{pp}-{model}-{tag}" + ("-masked" if masked else "")
    seq = CPU_SEQ_LENGTH if backend == "gloo" or model == "mtp" else CUDA_SEQ_LENGTH
    return dict(id=cid, cp=cp, dp=dp, pp=pp, model=model, per_token=per_token, masked=masked, seq_length=seq)


def cases(backend: str, world_size: int) -> list[dict]:
    """The cells of `world_size` ranks: a covering design, not the cross product.

    Every pair of values of (cp, dp, pp, model, calculate_per_token_loss) that fits in 4 ranks
    appears in some cell (cp 3 only at dp = pp = 1: 3 x 2 ranks is 6; MTP only at pp = 1, see
    _global_state); NCCL runs the same cells, the dense and MoE ones at CUDA_SEQ_LENGTH.
    """
    c = partial(_case, backend)
    if world_size == 2:
        return [c(2, 1, 1, "dense", True), c(2, 1, 1, "moe", False), c(2, 1, 1, "mtp", True),
                c(2, 1, 1, "dense", False, masked=True), c(2, 1, 1, "moe", True)]
    if world_size == 3:
        return [c(3, 1, 1, "dense", False), c(3, 1, 1, "moe", True), c(3, 1, 1, "mtp", False)]
    if world_size == 4:
        return [c(4, 1, 1, "dense", True), c(4, 1, 1, "moe", False), c(4, 1, 1, "mtp", True),
                c(2, 2, 1, "dense", False), c(2, 2, 1, "moe", True), c(2, 2, 1, "mtp", False),
                c(2, 1, 2, "dense", True), c(2, 1, 2, "moe", False), c(2, 1, 2, "dense", False, masked=True)]
    return []


def cell_layout(case: dict, world_size: int) -> CPLayout:
    """The CPLayout of a cell (validated by build_pg_collection before any group is built)."""
    return CPLayout(world_size=world_size, cp=case["cp"], pp=case["pp"], seq_length=case["seq_length"],
                    num_attention_heads=4, num_query_groups=2)


def _config(case) -> GPTConfig:
    extra = dict(MODELS[case["model"]], calculate_per_token_loss=case["per_token"],
                 cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                     seq_length=case["seq_length"], dtype=torch.float32, extra=extra)


def _global_batch(cfg, rows: int, masked: bool, dev) -> dict:
    batch = make_batch(cfg, batch_size=rows, seed=41)
    if masked:  # uneven loss tokens across the CP shards: the second half of row 0 is masked
        batch["loss_mask"][0, cfg.seq_length // 2:] = 0
        batch["loss_mask"][1:, : cfg.seq_length // 4] = 0
    return {k: v.to(dev) for k, v in batch.items()}


def _aux_tracker() -> dict:
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    return get_moe_layer_wise_logging_tracker()


def _clear_trackers() -> None:
    tracker = _aux_tracker()
    for entry in tracker.values():
        entry["values"].zero_()


def _reported_terms(pgc, num_microbatches: int) -> dict[str, float]:
    """MCore's aux-loss tracker as Megatron-LM logs it: reduce_aux_losses_tracker_across_ranks
    (sum over pp and the term's reduce_group, average over dp unless the group has dp, average
    over avg_group; ReduceOp.AVG spelled as a sum over the size, which gloo lacks), summed over
    layers, divided by the micro-batch count, read on the last rank and shared."""
    out = {}
    for name in sorted(_aux_tracker()):
        entry = _aux_tracker()[name]
        values = entry["values"].detach().clone().double()
        pp = get_pg(pgc, "pp")
        if group_size(pp) > 1:
            dist.all_reduce(values, group=pp)
        if entry.get("reduce_group") is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
            if not entry.get("reduce_group_has_dp", not entry.get("needs_dp_avg", True)):  # 0.16, 0.19
                dp = get_pg(pgc, "dp")
                if group_size(dp) > 1:
                    dist.all_reduce(values, group=dp)
                    values /= group_size(dp)
        if entry.get("avg_group") is not None and group_size(entry["avg_group"]) > 1:
            dist.all_reduce(values, group=entry["avg_group"])
            values /= group_size(entry["avg_group"])
        out[name] = values.sum() / num_microbatches
    names = sorted(out)
    last = torch.stack([out[n] for n in names]) if names else torch.zeros(0, dtype=torch.float64)
    last = last.to(device())
    dist.broadcast(last, src=dist.get_world_size() - 1)  # Megatron-LM logs on the last rank
    return {n: float(v) for n, v in zip(names, last.tolist())}


@contextlib.contextmanager
def _global_state(case, cp: int):
    """MCore's MTP (0.16 and 0.19) takes its groups from the global parallel_state (GPTModel
    builds MultiTokenPredictionBlock without pg_collection: the CP group of roll_tensor, the
    last pipeline stage, the dp x cp group it logs over), which cpkit's explicit process groups
    leave unset. For MTP cells, initialize it at CP size `cp` (1 for the reference, the layout's
    for the model) around the build and the step, and destroy it after. MTP cells run at pp = 1
    (a pp = 2 state would leave the reference on a first-stage rank without MTP layers)."""
    if case["model"] != "mtp":
        yield
        return
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def _train_step(model, microbatches, pgc, loss_func, cfg, dev, *, logits_loss: bool = False):
    """One Megatron-LM-shaped step through MCore's schedule: (reported losses, terms, grads).
    `logits_loss`: the model returns logits and `loss_func` gets the micro-batch and them."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from cpkit.dynamic.p2p import pipeline_communicator

    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    attach_grad_sync(model, pgc, calculate_per_token_loss=config.calculate_per_token_loss)
    model.zero_grad(set_to_none=True)
    _clear_trackers()

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        if logits_loss:
            return chunk(mb["tokens"], mb["position_ids"], None), partial(loss_func, mb)
        output = chunk(mb["tokens"], mb["position_ids"], None, labels=mb["labels"], loss_mask=mb["loss_mask"])
        return output, partial(loss_func, mb["loss_mask"])

    pp_group = get_pg(pgc, "pp")
    pp = group_size(pp_group)
    kwargs = dict(pg_collection=schedule_pg_collection(pgc))
    if pp > 1:
        kwargs["p2p_communicator"] = pipeline_communicator(pp_group, config, interleaved=False)
    stored = get_forward_backward_func(pp_size=pp, vp_size=None)(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
        num_microbatches=len(microbatches), seq_length=cfg.seq_length,  # full length: MCore divides by cp
        micro_batch_size=int(microbatches[0]["tokens"].shape[0]), forward_only=False, **kwargs)
    reported = reduce_reported_losses(stored, pgc)
    terms = _reported_terms(pgc, len(microbatches))
    return reported, terms, named_gradients(model, get_pg(pgc, "tp"))


def _plain_loss(cfg, batch, model_pgc, dev) -> float:
    """Mean cross entropy of the global batch from a fresh cp=1 model's logits (no loss_func,
    no schedule): the anchor of the reference's "lm loss"."""
    model = build_gpt(cfg.with_(extra={k: v for k, v in cfg.extra.items()
                                       if not k.startswith(("mtp_", "cross_entropy"))}), model_pgc, device=dev)
    model.eval()
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None)
        losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                   batch["labels"].reshape(-1), reduction="none")
    mask = batch["loss_mask"].reshape(-1).float()
    return float((losses * mask).sum() / mask.sum())


def _ratio(grads, ref) -> tuple[str, str]:
    """The parameter whose gradient is furthest from the reference (largest error relative to
    its largest entry), with its norm ratio |g| / |g ref| and that relative error."""
    worst, ratio, err = "", 1.0, -1.0
    for name, g in grads.items():
        r = ref[name]
        e = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30)
        if e > err:
            worst, err = name, e
            ratio = float(g.norm() / r.norm()) if float(r.norm()) > 0 else float("inf")
    return worst, f"{ratio:.4f} (max error {err:.1e} of its largest entry)"


def loss_matrix_scenario(case: dict):
    """One cell on every rank: the layout's reported loss, MoE terms and gradients against the
    single-rank step over the same global batch. Returns (reported, reference reported, terms,
    reference terms); raises AssertionError naming the quantity, the measured ratio and values."""
    install_mcore_cpu_shim()
    dev = device()
    cfg = _config(case)
    cp, dp, pp = case["cp"], case["dp"], case["pp"]
    pgc = build_pg_collection(cell_layout(case, dist.get_world_size()))
    ref_pgc = single_rank_pg_collection()
    loss_func = loss_func_from_env()
    rows = dp * MICRO_BATCHES
    batch = _global_batch(cfg, rows, case["masked"], dev)

    with _global_state(case, cp=1):  # MTP builds its layers on MCore's global groups
        ref = build_gpt(cfg, ref_pgc, device=dev)
        ref_mbs = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(rows)]
        ref_reported, ref_terms, ref_grads = _train_step(ref, ref_mbs, ref_pgc, loss_func, cfg, dev)
    if loss_func is megatron_loss_func:
        plain = _plain_loss(cfg, batch, ref_pgc, dev)
        assert abs(ref_reported["lm loss"] - plain) <= TOL["loss"], (ref_reported, plain)

    with _global_state(case, cp=cp):
        model = build_gpt(cfg, pgc, device=dev)
        dp_rank = dist.get_rank(get_pg(pgc, "dp")) if dp > 1 else 0
        cp_group = get_pg(pgc, "cp")
        mbs = [shard_batch({k: v[i:i + 1] for k, v in batch.items()}, cp_group)
               for i in range(dp_rank * MICRO_BATCHES, (dp_rank + 1) * MICRO_BATCHES)]
        reported, terms, grads = _train_step(model, mbs, pgc, loss_func, cfg, dev)
    assert reduce_group(pgc) is not None

    tol = TOL
    problems = []
    for name in sorted(set(ref_reported) | set(reported)):
        got, want = reported.get(name), ref_reported.get(name)
        if got is None or want is None or abs(got - want) > tol["loss"] * max(1.0, abs(want)):
            problems.append(f"reported {name!r}: {got} vs cp=1 {want} (ratio {_div(got, want)})")
    for name in sorted(set(ref_terms) | set(terms)):
        got, want = terms.get(name), ref_terms.get(name)
        if got is None or want is None or abs(got - want) > tol["loss"] * max(1.0, abs(want)):
            problems.append(f"term {name!r}: {got} vs cp=1 {want} (ratio {_div(got, want)})")
    want_grads = {n: ref_grads[n] for n in grads}
    bad = [n for n, g in grads.items()
           if not torch.allclose(g, want_grads[n], rtol=tol["rtol"], atol=tol["atol"])]
    if bad:
        worst, ratio = _ratio({n: grads[n] for n in bad}, want_grads)
        problems.append(f"{len(bad)} of {len(grads)} gradients differ; worst {worst}: |g| / |g cp=1| = {ratio}")
    assert not problems, f"{case['id']}: " + "; ".join(problems)
    return reported, ref_reported, terms, ref_terms


def _div(a, b):
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 4)


# --- dynamic CP: the same micro-batches at other CP sizes ----------------------------------------

DYNAMIC_LENS = (24, 12, 16, 8)
DYNAMIC_PLANS = {  # micro-batches of (positions, samples); the groupings are the same in each plan
    "cp2-then-cp1": ((((0, 1), (0,)),), (((0,), (1,)), ((1,), (2,))), (((0,), (3,)),)),
    "cp1-then-cp1": ((((0,), (0,)),), (((0,), (1,)), ((1,), (2,))), (((0,), (3,)),)),
}
"""One sample per CP group, so that the cp=1 reference runs each as a micro-batch of its own
(the router's aux loss is over a micro-batch's tokens). The last micro-batch, and the first of
"cp1-then-cp1", leave position 1 idle (cpkit's masked filler)."""
DYNAMIC_FINALIZE = "cp1-then-cp1"
"""The plan run with MCore's finalize_model_grads (the gradients divided by the token count
there); the others reduce and divide in dynamic_cp_forward_backward."""


def dynamic_cases(backend: str, world_size: int) -> list[dict]:
    """Dynamic-CP cells on 2 ranks: each model runs the plans of DYNAMIC_PLANS, which put the
    same samples in the same micro-batches at CP size 2 or 1; "gradients" cells check the loss
    and every gradient against cp=1, the "terms" cell MCore's aux-loss tracker across plans."""
    if world_size != 2:
        return []
    return [dict(id="dynamic-dense", model="dense", check="gradients"),
            dict(id="dynamic-moe", model="moe", check="gradients"),
            dict(id="dynamic-moe-terms", model="moe", check="terms")]


def _dynamic_plan(spec, lens, max_len):
    from cpkit.dynamic import CPGroupAssignment, Microbatch, Plan, cp_size_for

    mbs = tuple(Microbatch(tuple(CPGroupAssignment(tuple(r), tuple(s), len(r)) for r, s in mb)) for mb in spec)
    return Plan(microbatches=mbs, seq_lens=tuple(lens), dp_cp_size=2, max_seq_len_per_rank=max_len,
                workloads=tuple(float(n * n) for n in lens), needed_cp_sizes=tuple(cp_size_for(n, max_len) for n in lens))


def _dynamic_reference(cfg, samples, dev):
    """cp=1 reference of the dynamic cells: the same weights on this rank alone, one sample per
    micro-batch (bshd, no packing), through MCore's schedule with calculate_per_token_loss and
    finalize_model_grads. Returns ("lm loss", terms, gradients)."""
    ref_pgc = single_rank_pg_collection()
    ref = build_gpt(cfg, ref_pgc, device=dev)
    mbs = [{"tokens": s["tokens"][None], "labels": s["labels"][None], "loss_mask": s["loss_mask"][None],
            "position_ids": torch.arange(len(s["tokens"]), device=dev)[None]} for s in samples]
    reported, terms, grads = _train_step(ref, mbs, ref_pgc, _logits_loss_func, cfg, dev, logits_loss=True)
    return reported["lm loss"], terms, grads


def _logits_loss_func(mb: dict, logits: torch.Tensor):
    """megatron_loss_func on torch's fp32 cross entropy of the logits [b, s, vocab] (b = 1).
    Not MCore's fused native one: fused_cross_entropy.calculate_gradients rounds the logits'
    gradient to bf16 at every dtype; nor its unfused one: it needs MCore's global tp group."""
    losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               mb["labels"].reshape(-1), reduction="none")
    return megatron_loss_func(mb["loss_mask"], losses)


def dynamic_loss_scenario(case: dict):
    """Every plan of DYNAMIC_PLANS through cpkit.dynamic.pipeline.dynamic_cp_forward_backward
    (MCore's schedule, calculate_per_token_loss) on one model. case["check"] "gradients": the
    loss and every gradient equal the cp=1 reference (_dynamic_reference); "terms": MCore's
    aux-loss tracker, as Megatron-LM logs it, does not depend on the plan. Returns {plan: loss}."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from cpkit.dynamic import build_group_registry
    from cpkit.dynamic.pipeline import dynamic_cp_forward_backward
    from cpkit.parallel.rank_grid import rank_groups
    from cpkit.testing.reference import token_sample

    install_mcore_cpu_shim()
    dev = device()
    scale = 1 if dev.type == "cpu" else 128
    lens = [n * scale for n in DYNAMIC_LENS]
    extra = dict(MODELS[case["model"]], calculate_per_token_loss=True)  # pp = 1: fixed-length p2p not needed
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                    seq_length=2 * max(lens), dtype=torch.float32, extra=extra)
    layout = CPLayout(world_size=dist.get_world_size(), cp=1, num_attention_heads=4, num_query_groups=2)
    pgc = build_pg_collection(layout)
    registry = build_group_registry(rank_groups(layout)["dp_cp"], dist.get_rank())
    samples = [token_sample(n, 4100 + i, cfg.vocab_size, dev) for i, n in enumerate(lens)]
    gradients = case["check"] == "gradients"
    if gradients:
        ref_loss, _, ref_grads = _dynamic_reference(cfg, samples, dev)
    model = build_gpt(cfg, pgc, device=dev)
    attach_grad_sync(model, pgc, calculate_per_token_loss=True)
    results = {}
    for name, spec in DYNAMIC_PLANS.items():
        model.zero_grad(set_to_none=True)
        _clear_trackers()
        model.config.finalize_model_grads_func = finalize_model_grads if name == DYNAMIC_FINALIZE else None
        out = dynamic_cp_forward_backward(model, _dynamic_plan(spec, lens, max(lens)), registry,
                                          lambda i: samples[i], pg_collection=pgc)
        results[name] = (out.loss, _reported_terms(pgc, len(spec)), named_gradients(model))
    if gradients:
        problems = _against_reference(results, ref_loss, ref_grads, TOL)
    else:
        problems = _terms_across_plans(results, TOL)
    assert not problems, f"{case['id']}: " + "; ".join(problems)
    return {name: r[0] for name, r in results.items()}


def _against_reference(results: dict, ref_loss: float, ref_grads: dict, tol: dict) -> list[str]:
    """Each plan's (loss, terms, gradients) of `results` against the cp=1 loss and gradients."""
    problems = []
    for name, (loss, _, grads) in results.items():
        if abs(loss - ref_loss) > tol["loss"] * max(1.0, abs(ref_loss)):
            problems.append(f"loss {loss} under {name} vs cp=1 {ref_loss} (ratio {_div(loss, ref_loss)})")
        bad = [n for n, g in grads.items()
               if not torch.allclose(g, ref_grads[n], rtol=tol["rtol"], atol=tol["atol"])]
        if bad:
            worst, ratio = _ratio({n: grads[n] for n in bad}, ref_grads)
            problems.append(f"{len(bad)} of {len(grads)} gradients differ between {name} and cp=1; "
                            f"worst {worst}: |g| / |g cp=1| = {ratio}")
    return problems


def _terms_across_plans(results: dict, tol: dict) -> list[str]:
    """Each plan's aux-loss tracker terms of `results` against the first plan's."""
    (base, (_, terms0, _)), *others = results.items()
    problems = []
    for name, (_, terms, _) in others:
        for term in sorted(set(terms) | set(terms0)):
            a, b = terms.get(term), terms0.get(term)
            if a is None or b is None or abs(a - b) > tol["loss"] * max(1.0, abs(b)):
                problems.append(f"term {term!r}: {a} under {name} vs {b} under {base} (ratio {_div(a, b)})")
    return problems

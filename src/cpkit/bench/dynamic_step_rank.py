"""What every rank of `python -m cpkit.bench dynamic_step` runs (cpkit.launch.launch starts them).

1. The link table (`--link measured`, the default): cpkit.bench.link.measure_ring_exchange on
   these ranks, at cp 2 and 4, batched and unbatched; the replay and the model read its fit.
2. An MCore GPTModel (cpkit.models.build_gpt, cpkit's attention, bf16 on CUDA) of the
   given ModelDims with a small vocabulary (the embedding and output layer are not replayed),
   one DPxCP group of all ranks (dp = N, cp = 1 statically), the registry of every aligned CP
   group (cpkit.dynamic.registry) and AdamW at lr 0: the optimizer does all its work, the
   weights stay put, so every plan of a batch must give the same loss (checked by the report).
3. Rank 0 only (the others wait): the cost model calibrated from the replay's kernels on this
   GPU (cpkit.bench.replay_calibration; `--calibration FILE` instead), then per global batch the
   plans of every family (cpkit.bench.replay_plans.plans) and their predictions: replayed
   (cpkit.bench.replay.replay_plan, kernels measured here) and modeled (CostModel.step_time).
   The plans are broadcast to every rank.
4. Every rank: per plan, `warmup` + `iters` real training steps through cpkit's runtime
   (prepare_microbatch, agree_on_tokens, forward_backward_local with the per-micro-batch CP
   switch, all_reduce_gradients, optimizer step). A plan with packed=False (MCore's
   BalancedCPScheduler) runs as MCore runs it, and as the replay replays it: a group's samples
   one after another (`run_order`), and every rank waits for the others after each micro-batch
   (a DPxCP all-reduce on the stream). Times: the slowest rank's, per step (max over ranks).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from cpkit.bench.replay_plans import Batch
from cpkit.dynamic.cost import ModelDims
from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

__all__ = ["FAMILIES", "StepSpec", "run_order", "run_rank", "unrunnable"]

FAMILIES = ("cpkit", "static", "mcore", "mlm")
COLUMNS = ("step_s", "fwd_bwd_s", "prep_s", "reduce_opt_s")  # per timed step, slowest rank


@dataclass(frozen=True)
class StepSpec:
    """Everything the ranks need (picklable; built and validated by cpkit.bench.dynamic_step)."""

    dims: ModelDims
    vocab_size: int
    batches: tuple[Batch, ...]
    families: tuple[str, ...]
    warmup: int
    iters: int
    kernel_warmup: int
    kernel_iters: int
    link: str
    """"measured" (ring exchange on these ranks) or a spec for replay_timing.link_table."""
    link_bytes: tuple[int, ...]
    calibration: Optional[str]
    """A calibration file for the cost model; None: measured from the replay's kernels."""
    quick: bool
    budget_s: Optional[float]
    partial_path: Optional[str]
    seed: int = 0


def run_order(plan: Plan) -> tuple[Plan, list[list[int]], bool]:
    """(plan to run, micro-batch indices per lockstep segment, lockstep) for the runtime.

    A packed plan runs as it is, one segment, free. A plan with packed=False runs each group's
    samples one after another: micro-batch m becomes max(len(samples)) runtime micro-batches
    (the j-th sample of every group in the j-th), and they form segment m, after which every
    rank waits for the others (lockstep)."""
    if plan.packed:
        return plan, [list(range(len(plan.microbatches)))], False
    mbs: list[Microbatch] = []
    segments = []
    for mb in plan.microbatches:
        seg = []
        for j in range(max((len(g.samples) for g in mb.groups), default=0)):
            seg.append(len(mbs))
            mbs.append(Microbatch(tuple(CPGroupAssignment(g.ranks, (g.samples[j],), g.cp_size)
                                        for g in mb.groups if len(g.samples) > j)))
        segments.append(seg)
    return dataclasses.replace(plan, microbatches=tuple(mbs), packed=True), segments, True


def unrunnable(plan: Plan, sizes: tuple[int, ...]) -> Optional[str]:
    """Why the registry (aligned blocks of `sizes`) cannot run `plan`, or None when it can."""
    for m, mb in enumerate(plan.microbatches):
        for g in mb.groups:
            first, c = g.ranks[0], g.cp_size
            if c not in sizes or len(g.ranks) != c or g.ranks != tuple(range(first, first + c)) \
                    or first % c:
                return (f"micro-batch {m}: group of ranks {list(g.ranks)} (cp {c}) is not an "
                        f"aligned block of size {sorted(sizes)}")
    return None


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _samples(batch: Batch, vocab: int, seed: int, device) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for L in batch.seq_lens:
        seq = torch.randint(0, vocab, (L + 1,), generator=gen)
        out.append({"tokens": seq[:-1].to(device), "labels": seq[1:].to(device),
                    "loss_mask": torch.ones(L, device=device)})
    return out


def _step(model, opt, order, registry, pgc, group, samples, device) -> tuple[list[float], float]:
    """One training step of `order` (run_order's); ([step, fwd_bwd, prep, reduce_opt] seconds of
    this rank, the step's loss)."""
    from cpkit.dynamic.runtime import (agree_on_tokens, dp_cp_position, forward_backward_local,
                                       prepare_microbatch)
    from cpkit.loss import all_reduce_gradients

    plan, segments, lockstep = order
    _sync(device)
    dist.barrier(group)
    t0 = time.perf_counter()
    model.zero_grad(set_to_none=False)
    pos = dp_cp_position(registry)
    local = [prepare_microbatch(plan, m, registry, pos, samples.__getitem__, device=device)
             for m in range(len(plan.microbatches))]
    total = agree_on_tokens(sum(mb.num_tokens for mb in local if mb is not None), None, group,
                            device, "dynamic_step")
    _sync(device)
    t1 = time.perf_counter()
    shares = []
    tick = torch.zeros(1, device=device)
    for seg in segments:
        shares += forward_backward_local(model, [local[m] for m in seg], total_tokens=total,
                                         pg_collection=pgc)
        if lockstep:  # MCore's schedule waits for the DPxCP group after every micro-batch
            dist.all_reduce(tick, group=group)
    _sync(device)
    t2 = time.perf_counter()
    all_reduce_gradients(model, group)
    opt.step()
    _sync(device)
    t3 = time.perf_counter()
    loss = torch.stack(shares).sum() if shares else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(loss, group=group)
    return [t3 - t0, t2 - t1, t1 - t0, t3 - t2], loss.item()


def _time_plan(model, opt, plan, spec, registry, pgc, group, samples, device) -> dict:
    order = run_order(plan)
    rows, losses = [], []
    for i in range(spec.warmup + spec.iters):
        times, loss = _step(model, opt, order, registry, pgc, group, samples, device)
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        if i >= spec.warmup:
            rows.append(slowest.tolist())
            losses.append(loss)
    out = {k: [r[j] for r in rows] for j, k in enumerate(COLUMNS)}
    out["loss"] = losses[0]
    out["runtime_microbatches"] = len(order[0].microbatches)
    out["lockstep"] = order[2]
    return out


class _Predictor:
    """Rank 0's side: the cost model, the plans and the replay (module docstring, step 3)."""

    def __init__(self, spec: StepSpec, link, device, dev_name: str):
        from cpkit.bench.common import source_commit
        from cpkit.bench.replay_calibration import calibration_from_timer
        from cpkit.bench.replay_kernels import KernelTimer
        from cpkit.dynamic.cost import Calibration, CostModel, load_calibration

        self.spec, self.link = spec, link
        self.timer = KernelTimer(spec.dims, device, warmup=spec.kernel_warmup, iters=spec.kernel_iters)
        t0 = time.perf_counter()
        if spec.calibration:  # its rates, with this run's link table (the replay's)
            cal = dataclasses.replace(load_calibration(spec.calibration), link=tuple(
                (b, link.time(b)) for b in (1 << 20, 1 << 26)))
        else:
            cal = Calibration.from_dict(calibration_from_timer(
                self.timer, spec.dims, link, device=dev_name, quick=spec.quick,
                origin=f"python -m cpkit.bench dynamic_step, commit {source_commit()}"))
        self.calibration_s = time.perf_counter() - t0
        self.calibration_source = cal.source
        self.model = CostModel(dims=spec.dims, calibration=cal)

    def plans(self, batch: Batch) -> dict[str, object]:
        from cpkit.bench.replay_plans import plans
        from cpkit.dynamic.mlm import skip_reason

        made = plans(batch, self.model, "free", 1)
        out = {}
        for fam in self.spec.families:
            plan = made.get(fam)
            if plan is None:  # only mlm is ever absent: no checkout
                plan = f"skipped: {skip_reason() or 'cpkit.dynamic.mlm is unavailable'}"
            out[fam] = plan
        return out

    def predict(self, plan: Plan) -> dict:
        from cpkit.bench.replay import replay_plan

        r = replay_plan(plan, self.timer, self.link, self.spec.dims, "free", 1)
        return {"replayed_s": r["step_s"], "replayed_comm_s": r["comm_s"], "busy_s": r["busy_s"],
                "modeled_s": self.model.step_time(plan, "free", 1)}


def _link(spec: StepSpec, device):
    from cpkit.bench.common import source_commit
    from cpkit.bench.link import link_table_data, measure_ring_exchange
    from cpkit.bench.replay_timing import LinkTable, link_table

    if spec.link != "measured":
        return link_table(spec.link), None
    cps = [c for c in (2, 4) if c <= dist.get_world_size()]
    meas = measure_ring_exchange(spec.link_bytes, cps, 1 if spec.quick else 3,
                                 3 if spec.quick else 10, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    table = link_table_data(meas, device=f"{dist.get_world_size()} x {name}",
                            origin=f"python -m cpkit.bench dynamic_step, commit {source_commit()}")
    return LinkTable("measured", table["latency_s"], table["bandwidth_GBps"] * 1e9,
                     table["source"]), table


def _build(spec: StepSpec, device):
    from cpkit.dynamic.registry import build_group_registry
    from cpkit.groups import build_pg_collection
    from cpkit.layout import CPLayout
    from cpkit.models import GPTConfig, build_gpt

    d, world = spec.dims, dist.get_world_size()
    longest = max(max(b.seq_lens) for b in spec.batches)
    cfg = GPTConfig(num_layers=d.num_layers, hidden_size=d.hidden_size,
                    num_attention_heads=d.num_heads, num_query_groups=d.num_kv_heads,
                    ffn_hidden_size=d.ffn_hidden_size, vocab_size=spec.vocab_size,
                    seq_length=longest + 2 * world,
                    dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                    extra=dict(kv_channels=d.head_dim, gated_linear_unit=d.gated_linear_unit,
                               activation_func=torch.nn.functional.silu if d.gated_linear_unit
                               else torch.nn.functional.gelu))
    layout = CPLayout(world_size=world, tp=1, cp=1, cp_comm_type="p2p",
                      num_attention_heads=d.num_heads, num_query_groups=d.num_kv_heads)
    pgc = build_pg_collection(layout)
    registry = build_group_registry([list(range(world))], dist.get_rank())
    model = build_gpt(cfg, pgc, attention="cpkit", device=device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return model, opt, pgc, registry


def run_rank(spec: StepSpec) -> Optional[dict]:
    """The whole run on this rank (module docstring); rank 0 returns the results, others None."""
    from cpkit.compat import get_pg
    from cpkit.launch import device as launcher_device

    device = launcher_device()
    if device.type == "cpu":
        from cpkit.models import prepare_cpu

        prepare_cpu()
    start = time.perf_counter()
    rank = dist.get_rank()
    phases = {}
    link, link_data = _link(spec, device)
    phases["link_s"] = time.perf_counter() - start
    model, opt, pgc, registry = _build(spec, device)
    phases["build_s"] = time.perf_counter() - start - phases["link_s"]
    group = get_pg(pgc, "dp_cp")
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    predictor = _Predictor(spec, link, device, dev_name) if rank == 0 else None
    results, skipped = [], []
    for bi, batch in enumerate(spec.batches):
        payload = [None]
        if rank == 0:
            if spec.budget_s is not None and time.perf_counter() - start > spec.budget_s:
                payload = [None]
            else:
                t_pred = time.perf_counter()
                made = predictor.plans(batch)
                entry = {"set": batch.set, "label": batch.label, "dp_cp_size": batch.dp_cp_size,
                         "max_seq_len_per_rank": batch.max_seq_len_per_rank,
                         "sequences": len(batch.seq_lens), "tokens": sum(batch.seq_lens), "impl": {}}
                runnable = {}
                for fam, plan in made.items():
                    if isinstance(plan, str):
                        entry["impl"][fam] = {"error": plan}
                        continue
                    info = predictor.predict(plan)
                    info["cp_sizes"] = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
                    info["microbatches"] = len(plan.microbatches)
                    info["packed"] = plan.packed
                    why = unrunnable(plan, registry.sizes)
                    if why:
                        info["error"] = f"not runnable: {why}"
                    else:
                        runnable[fam] = plan
                    entry["impl"][fam] = info
                entry["predict_wall_s"] = time.perf_counter() - t_pred
                payload = [(entry, runnable)]
        dist.broadcast_object_list(payload, src=0, group=group)
        if payload[0] is None:
            skipped = [b.label for b in spec.batches[bi:]]
            break
        entry, runnable = payload[0]
        t_steps = time.perf_counter()
        samples = _samples(batch, spec.vocab_size, spec.seed + bi, device)
        for fam, plan in runnable.items():
            entry["impl"][fam].update(_time_plan(model, opt, plan, spec, registry, pgc, group,
                                                 samples, device))
        if rank == 0:
            entry["steps_wall_s"] = time.perf_counter() - t_steps
            results.append(entry)
            print(f"  {entry['label']}: " + ", ".join(
                f"{k} {sorted(v['step_s'])[len(v['step_s']) // 2] * 1e3:.0f} ms"
                for k, v in entry["impl"].items() if "step_s" in v), flush=True)
            if spec.partial_path:
                Path(spec.partial_path).parent.mkdir(parents=True, exist_ok=True)
                Path(spec.partial_path).write_text(json.dumps({"results": results}, default=str))
    if rank != 0:
        return None
    return {"results": results, "skipped": skipped, "device": dev_name,
            "link": link.to_dict(), "link_table": link_data,
            "calibration_s": predictor.calibration_s, "phases": phases,
            "calibration": predictor.calibration_source,
            "shapes_measured": predictor.timer.measured, "wall_s": time.perf_counter() - start}

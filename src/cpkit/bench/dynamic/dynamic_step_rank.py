"""What every rank of `python -m cpkit.bench dynamic_step` runs (cpkit.harness.launch.launch starts them).

1. Rank 0 starts Megatron-LM's scheduler worker in a thread (CPKIT_MLM_SRC), so no batch waits
   for it to load.
2. The calibration: read from its cache file when it exists (`StepSpec.calibration`), else
   measured here from micro-benchmarks only (cpkit.bench.dynamic.dynamic_step_calibrate: the link table
   of the ring on these ranks, the kernels spread over the ranks, op counts and micro-batches of
   this model on real CP groups) and written there.
3. An MCore GPTModel (cpkit.attention.gpt.build_gpt, cpkit's attention, bf16 on CUDA) of the
   given ModelDims with a small vocabulary, one DPxCP group of all ranks (dp = N, cp = 1
   statically), the registry of every aligned CP group (cpkit.dynamic.registry), AdamW at lr 0
   (the optimizer does all its work, the weights stay put: every plan of a batch gives the same
   loss); one tiny micro-batch per CP size sets up every communicator before anything is timed.
4. Rank 0, per global batch: the plans of every family and their predictions
   (cpkit.bench.dynamic.dynamic_step_predict), broadcast to every rank.
5. Every rank: per distinct plan, `warmup` + `iters` real training steps through cpkit's runtime
   (prepare_microbatch, agree_on_tokens, forward_backward_local with the per-micro-batch CP
   switch, all_reduce_gradients, optimizer step), the plans' steps interleaved round by round
   (`_time_plans`); a plan with packed=False (MCore's) runs as
   MCore runs it (`run_order`). Times per rank and per step; the columns are the slowest rank's.
   A family whose plan equals one already run reuses its times (`same_plan_as`).
6. Every rank: one more step of each plan with every micro-batch marked (host times and, on
   CUDA, stream events, no sync added: cpkit.dynamic.microbatch_timeline), its own "timeline"
   beside the plan's predicted per-micro-batch times, so the timed columns above are unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from cpkit.bench.dynamic.replay_plans import Batch
from cpkit.dynamic.cost import ModelDims
from cpkit.dynamic.plan import Plan

__all__ = ["FAMILIES", "StepSpec", "host_pace", "run_order", "run_rank", "unrunnable"]

FAMILIES = ("cpkit", "static", "mcore", "mlm")
COLUMNS = ("step_s", "fwd_bwd_s", "prep_s", "reduce_opt_s")  # per timed step, slowest rank


@dataclass(frozen=True)
class StepSpec:
    """Everything the ranks need (picklable; built and validated by cpkit.bench.dynamic.dynamic_step)."""

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
    calibration: str
    """The calibration file: read when it exists (unless `recalibrate`), else measured and written;
    "": cpkit.bench.dynamic.dynamic_step_calibrate.cache_path under `calibration_dir`."""
    quick: bool
    budget_s: Optional[float]
    partial_path: Optional[str]
    seed: int = 0
    calibration_dir: str = "bench-results/dynamic_step-calibration"
    recalibrate: bool = False
    replay: bool = False
    """Also the replay's prediction (rank 0 times every plan's kernels: slow)."""


def run_order(plan: Plan) -> tuple[Plan, list[list[int]], bool]:
    """(plan to run, micro-batch indices per lockstep segment, lockstep) for the runtime, from
    cpkit.dynamic.step_model.runtime_segments (the step model runs the same order): a packed plan
    as it is, one segment, free; packed=False: each group's samples one after another, every
    rank waiting for the others after each of the plan's micro-batches (lockstep)."""
    from cpkit.dynamic.step_model import runtime_segments

    if plan.packed:
        return plan, [list(range(len(plan.microbatches)))], False
    segments, lockstep = runtime_segments(plan)
    mbs, index = [], []
    for seg in segments:
        index.append(list(range(len(mbs), len(mbs) + len(seg))))
        mbs += seg
    return dataclasses.replace(plan, microbatches=tuple(mbs), packed=True), index, lockstep


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


def _step(model, opt, order, registry, pgc, group, samples, device,
          recorder=None) -> tuple[list[float], float]:
    """One training step of `order` (run_order's); ([step, fwd_bwd, prep, reduce_opt] seconds of
    this rank, the step's loss). `recorder`: a MicrobatchTimeline marking forward + backward and
    each micro-batch (no sync added)."""
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
    if recorder is not None:
        recorder.open()
    for seg in segments:
        shares += forward_backward_local(model, [local[m] for m in seg], total_tokens=total,
                                         pg_collection=pgc, recorder=recorder)
        if lockstep:  # MCore's schedule waits for the DPxCP group after every micro-batch
            dist.all_reduce(tick, group=group)
    if recorder is not None:
        recorder.close()
    _sync(device)
    t2 = time.perf_counter()
    all_reduce_gradients(model, group)
    opt.step()
    _sync(device)
    t3 = time.perf_counter()
    loss = torch.stack(shares).sum() if shares else torch.zeros((), dtype=torch.float64, device=device)
    dist.all_reduce(loss, group=group)
    return [t3 - t0, t2 - t1, t1 - t0, t3 - t2], loss.item()


def _time_plans(model, opt, plans: dict, spec, registry, pgc, group, samples, device,
                step=None, pace=None) -> tuple[dict, list[float]]:
    """({family: its timed steps} of every plan of one batch, the host pace probe's seconds per
    timed round): the plans' steps interleaved (round after round, each plan once a round): the
    host of a host-bound step drifts by several percent over seconds (up to 8% between runs of
    one plan on 2x H200), and a plan timed in a later window than the others would take that
    drift as its own. `pace`: cpkit.bench.dynamic.dynamic_step_calibrate.pace_probe's callable,
    timed at the start of every round (None: no probe). `step`: _step (a stand-in in the unit
    tests)."""
    step = step or _step
    orders = {fam: run_order(plan) for fam, plan in plans.items()}
    world = dist.get_world_size(group)
    per_step = {fam: [] for fam in plans}  # [step][rank][column]
    losses = {fam: [] for fam in plans}
    paces = []
    for i in range(spec.warmup + spec.iters):
        probe_s = pace() if pace is not None else None
        if i >= spec.warmup and probe_s is not None:
            paces.append(probe_s)
        for fam, order in orders.items():
            times, loss = step(model, opt, order, registry, pgc, group, samples, device)
            mine = torch.tensor(times, dtype=torch.float64, device=device)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=group)
            if i >= spec.warmup:
                per_step[fam].append([t.tolist() for t in every])
                losses[fam].append(loss)
    out = {}
    for fam, order in orders.items():
        rows = per_step[fam]
        res = {k: [max(r[j] for r in row) for row in rows] for j, k in enumerate(COLUMNS)}
        res["per_rank"] = {k: [statistics.median(row[r][j] for row in rows) for r in range(world)]
                           for j, k in enumerate(COLUMNS)}
        res["loss"] = losses[fam][0]
        res["runtime_microbatches"] = len(order[0].microbatches)
        res["lockstep"] = order[2]
        out[fam] = res
    for fam, order in orders.items():  # after every timed step, so their columns stay as they were
        out[fam]["timeline"] = _timeline_step(model, opt, order, registry, pgc, group, samples, device)
    return out, paces


def host_pace(paces: list[float], calibration: dict) -> dict:
    """The batch's host pace against the calibration's: {"probe_s": the probe's median over the
    batch's rounds, "probe_samples_s", "calibration_probe_s": its median beside the calibration
    points (None for a calibration measured before the probe existed), "pace": their ratio or
    None}."""
    cal = calibration.get("step", {}).get("source", {}).get("pace_s")
    now = statistics.median(paces) if paces else None
    return {"probe_s": now, "probe_samples_s": list(paces), "calibration_probe_s": cal,
            "pace": now / cal if now and cal else None}


def _timeline_step(model, opt, order, registry, pgc, group, samples, device) -> dict:
    """One more step, after the timed ones so their columns stay as they were, with every
    micro-batch marked (cpkit.dynamic.microbatch_timeline); read after the step's final sync and
    gathered from every rank: {"what", "per_rank": [{step columns, "microbatches", "tail_s",
    "span_s"}]}."""
    from cpkit.dynamic.microbatch_timeline import MicrobatchTimeline

    timeline = MicrobatchTimeline(device)
    times, _ = _step(model, opt, order, registry, pgc, group, samples, device, recorder=timeline)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, {**dict(zip(COLUMNS, times)), **timeline.records()}, group=group)
    return {"what": "one extra step after the timed ones, every micro-batch the runtime ran marked "
                    "on the host and (CUDA) by stream events; per rank", "per_rank": every}


def _link(spec: StepSpec, device):
    from cpkit.bench.dynamic.dynamic_step_report import cpkit_commit
    from cpkit.bench.dynamic.link import link_table_data, measure_ring_exchange
    from cpkit.bench.dynamic.replay_timing import LinkTable, link_table

    if spec.link != "measured":
        return link_table(spec.link), None
    cps = [c for c in (2, 4) if c <= dist.get_world_size()]
    meas = measure_ring_exchange(spec.link_bytes, cps, 1 if spec.quick else 3,
                                 3 if spec.quick else 10, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    table = link_table_data(meas, device=f"{dist.get_world_size()} x {name}",
                            origin=f"python -m cpkit.bench dynamic_step, cpkit {cpkit_commit()}")
    return LinkTable("measured", table["latency_s"], table["bandwidth_GBps"] * 1e9,
                     table["source"]), table


def shallow_layers(layers: int) -> int:
    """Layers of the calibration's second model: a quarter, so its ops per micro-batch differ
    enough from the bench model's to tell the per-op host cost from a per-micro-batch residual."""
    return max(1, layers // 4)


def _model(spec: StepSpec, device, pgc, layers: Optional[int] = None):
    """The bench's MCore GPTModel on `pgc` (`layers`: its layer count, default the spec's)."""
    from cpkit.attention.gpt import GPTConfig, build_gpt

    d, world = spec.dims, dist.get_world_size()
    longest = max(max(b.seq_lens) for b in spec.batches)
    cfg = GPTConfig(num_layers=layers or d.num_layers, hidden_size=d.hidden_size,
                    num_attention_heads=d.num_heads, num_query_groups=d.num_kv_heads,
                    ffn_hidden_size=d.ffn_hidden_size, vocab_size=spec.vocab_size,
                    seq_length=longest + 2 * world,
                    dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                    extra=dict(kv_channels=d.head_dim, gated_linear_unit=d.gated_linear_unit,
                               activation_func=torch.nn.functional.silu if d.gated_linear_unit
                               else torch.nn.functional.gelu))
    return build_gpt(cfg, pgc, attention="cpkit", device=device)


def _build(spec: StepSpec, device):
    from cpkit.dynamic.registry import build_group_registry
    from cpkit.parallel.groups import build_pg_collection
    from cpkit.parallel.layout import CPLayout

    d, world = spec.dims, dist.get_world_size()
    layout = CPLayout(world_size=world, tp=1, cp=1, cp_comm_type="p2p",
                      num_attention_heads=d.num_heads, num_query_groups=d.num_kv_heads)
    pgc = build_pg_collection(layout)
    registry = build_group_registry([list(range(world))], dist.get_rank())
    model = _model(spec, device, pgc)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return model, opt, pgc, registry


def _calibrate(spec: StepSpec, device, dev_name, link, link_data, model, opt, pgc, registry, group, probe) -> dict:
    """Measure the calibration on every rank (module docstring, step 2); rank 0's dict. `probe`:
    the run's host pace probe (cpkit.bench.dynamic.dynamic_step_calibrate.pace_probe)."""
    from cpkit.bench.common import machine_info
    from cpkit.bench.dynamic.dynamic_step_calibrate import measure_step_costs, share_kernel_timing
    from cpkit.bench.dynamic.dynamic_step_report import cpkit_commit
    from cpkit.bench.dynamic.replay_kernels import KernelTimer
    from cpkit.dynamic.cost import Calibration, CostModel

    t0 = time.perf_counter()
    longest = max(max(b.seq_lens) for b in spec.batches)
    per_rank = max(b.max_seq_len_per_rank for b in spec.batches)
    timer = KernelTimer(spec.dims, device, warmup=spec.kernel_warmup, iters=spec.kernel_iters)
    cal = share_kernel_timing(timer, spec.dims, link, group, device_name=dev_name, quick=spec.quick,
                              origin=f"python -m cpkit.bench dynamic_step, cpkit {cpkit_commit()}",
                              max_tokens=2 * per_rank)
    kernels_s = time.perf_counter() - t0
    kernel_model = CostModel(spec.dims, Calibration.from_dict(cal))
    few = shallow_layers(spec.dims.num_layers)
    shallow = (_model(spec, device, pgc, few), few) if few < spec.dims.num_layers else None
    cal["step"] = measure_step_costs(model, opt, registry, pgc, group, spec.vocab_size, device,
                                     longest=longest, quick=spec.quick, kernel_model=kernel_model,
                                     pace=probe, shallow=shallow)
    del shallow
    cal["machine"] = machine_info()
    cal["software"] = (f"torch {cal['machine']['torch']}, megatron-core {cal['machine'].get('megatron_core')}, "
                       f"{dist.get_world_size()} ranks")
    cal["link_table"] = link_data
    cal["link_name"] = link.to_dict()
    cal["measured_s"] = {"kernels": kernels_s, "total": time.perf_counter() - t0}
    return cal


def run_rank(spec: StepSpec) -> Optional[dict]:
    """The whole run on this rank (module docstring); rank 0 returns the results, others None."""
    from cpkit.bench.dynamic.dynamic_step_calibrate import pace_probe, warm_groups
    from cpkit.bench.dynamic.dynamic_step_predict import Predictor, plan_key, plan_record, start_mlm_worker
    from cpkit.bench.dynamic.replay_timing import LinkTable
    from cpkit.compat import get_pg
    from cpkit.dynamic.cost import Calibration
    from cpkit.dynamic.step_model import StepModel
    from cpkit.process_device import device as launcher_device

    device = launcher_device()
    if device.type == "cpu":
        from cpkit.attention.gpt import prepare_cpu

        prepare_cpu()
    start = time.perf_counter()
    rank = dist.get_rank()
    if rank == 0:
        start_mlm_worker()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run)"
    cached = [None, None]
    if rank == 0:
        from cpkit.bench.dynamic.dynamic_step_calibrate import cache_path

        where = Path(spec.calibration) if spec.calibration else cache_path(
            spec.calibration_dir, dev_name.split(" (")[0], dist.get_world_size(), spec.dims, spec.vocab_size)
        cached = [str(where), json.loads(where.read_text()) if where.is_file() and not spec.recalibrate
                  else None]
    dist.broadcast_object_list(cached, src=0)
    cal_path, cal = Path(cached[0]), cached[1]
    if cal is not None and cal.get("dims") != vars(spec.dims):
        cal = None  # another model's calibration: measure this one's
    phases = {}
    if cal is None:
        link, link_data = _link(spec, device)
    else:
        ln = cal["link_name"]
        link, link_data = LinkTable(ln["name"], ln["latency_s"], ln["bandwidth_GBps"] * 1e9,
                                    ln["source"]), cal.get("link_table")
    phases["link_s"] = time.perf_counter() - start
    model, opt, pgc, registry = _build(spec, device)
    group = get_pg(pgc, "dp_cp")
    warm_groups(model, registry, pgc, group, spec.vocab_size, device)
    probe = pace_probe(model, registry, pgc, group, spec.vocab_size, device)
    phases["build_s"] = time.perf_counter() - start - phases["link_s"]
    calibrated_here = cal is None
    if cal is None:
        cal = _calibrate(spec, device, dev_name, link, link_data, model, opt, pgc, registry, group, probe)
        if rank == 0:
            cal_path.parent.mkdir(parents=True, exist_ok=True)
            cal_path.write_text(json.dumps(cal, indent=1) + "\n")
    phases["calibration_s"] = time.perf_counter() - start - phases["link_s"] - phases["build_s"]
    # what measuring it cost: the link table too (measured before the model was built)
    phases["calibration_total_s"] = phases["calibration_s"] + (phases["link_s"] if calibrated_here else 0.0)
    predictor = None
    if rank == 0:
        timer = None
        if spec.replay:
            from cpkit.bench.dynamic.replay_kernels import KernelTimer

            timer = KernelTimer(spec.dims, device, warmup=spec.kernel_warmup, iters=spec.kernel_iters)
        predictor = Predictor(spec, StepModel(spec.dims, Calibration.from_dict(cal)),
                              lambda p: unrunnable(p, registry.sizes), timer, link)
    results, skipped = [], []
    for bi, batch in enumerate(spec.batches):
        payload = [None]
        if rank == 0 and not (spec.budget_s is not None and time.perf_counter() - start > spec.budget_s):
            t_pred = time.perf_counter()
            entry = {"set": batch.set, "label": batch.label, "dp_cp_size": batch.dp_cp_size,
                     "max_seq_len_per_rank": batch.max_seq_len_per_rank, "seq_lens": list(batch.seq_lens),
                     "sequences": len(batch.seq_lens), "tokens": sum(batch.seq_lens), "impl": {}}
            runnable, seen = {}, {}
            fam_plans = predictor.plans(batch)
            for fam, plan in fam_plans.items():
                if isinstance(plan, str):
                    entry["impl"][fam] = {"error": plan}
                    continue
                info = predictor.predict(plan)
                info["cp_sizes"] = sorted({g.cp_size for mb in plan.microbatches for g in mb.groups})
                info["microbatches"] = len(plan.microbatches)
                info["packed"] = plan.packed
                info["plan"] = plan_record(plan)
                why = unrunnable(plan, registry.sizes)
                if why:
                    info["error"] = f"not runnable: {why}"
                elif plan_key(plan) in seen:
                    info["same_plan_as"] = seen[plan_key(plan)]
                else:
                    seen[plan_key(plan)] = fam
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
        timed_plans, paces = _time_plans(model, opt, runnable, spec, registry, pgc, group, samples, device,
                                         pace=probe)
        for fam, timed in timed_plans.items():
            entry["impl"][fam].update(timed)
        for fam, info in entry["impl"].items():
            if "same_plan_as" in info:
                src = entry["impl"][info["same_plan_as"]]
                info.update({k: src[k] for k in (*COLUMNS, "per_rank", "loss", "runtime_microbatches",
                                                  "lockstep", "timeline") if k in src})
        if rank == 0:
            entry["host_pace"] = host_pace(paces, cal)
            for fam, info in entry["impl"].items():
                if "predicted_step_s" in info and entry["host_pace"]["pace"]:
                    info.update(predictor.predict_at_pace(fam_plans[fam], entry["host_pace"]["pace"]))
            entry["steps_wall_s"] = time.perf_counter() - t_steps
            results.append(entry)
            print(f"  {entry['label']}: " + ", ".join(
                f"{k} {statistics.median(v['step_s']) * 1e3:.0f} ms"
                for k, v in entry["impl"].items() if "step_s" in v)
                + f" ({time.perf_counter() - start:.0f} s)", flush=True)
            if spec.partial_path:
                Path(spec.partial_path).parent.mkdir(parents=True, exist_ok=True)
                Path(spec.partial_path).write_text(json.dumps({"results": results}, default=str))
    if rank != 0:
        return None
    return {"results": results, "skipped": skipped, "device": dev_name, "link": link.to_dict(),
            "link_table": link_data, "phases": phases, "calibration": cal,
            "calibration_path": str(cal_path), "calibrated_here": calibrated_here,
            "wall_s": time.perf_counter() - start}

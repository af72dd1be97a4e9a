"""The step model's calibration, measured on the bench's ranks from micro-benchmarks only.

Run on every rank of `python -m cpkit.bench dynamic_step` (cpkit.bench.dynamic.dynamic_step_rank) when
no cached calibration exists; never from a plan's step (the bench validates the model on those).
1. Kernels (cpkit.bench.dynamic.replay_calibration's GEMM and attention shapes): spread over the ranks,
   each times its share with cpkit.bench.dynamic.replay_kernels.KernelTimer, then all share them.
2. Ops and syncs (`count_ops`): dispatched aten ops and host syncs of one micro-batch forward +
   backward of the bench's own model through cpkit's runtime, per CP size c of the registry and
   n = 1 and 3 packed samples (all ranks at once, real groups), fitted linear in n.
3. Micro-batches (cpkit.dynamic.step_fit.MicrobatchPoint): the same forward + backward at
   several local token counts and sample counts, at c = 1 (every rank alone) and on the real
   c = 2 and c = 4 groups, timed as a step runs them (`per_microbatch`): one call of
   BACK_TO_BACK micro-batches between two syncs, as cpkit.dynamic.runtime.forward_backward_local
   runs a step's, against a call of one; a point's seconds are what one more micro-batch adds,
   and the rest of the one-micro-batch call is the call's once-only gap (StepCosts.call_gap_s).
   Seconds of the slowest rank, median of `iters`. The c = 1 points run on a second, shallower
   model too (`shallow`: fewer layers, so fewer ops per micro-batch): the only points that tell
   the per-op host cost from a per-micro-batch residual. Also timed: a host sync, an idle slot's
   zero-loss backward (back to back too), the batch preparation and the gradient all-reduce with
   the optimizer step.
4. cpkit.dynamic.step_fit.fit_costs turns them into cpkit.dynamic.step_model.StepCosts.
The result is one JSON (CostModel's calibration plus a "step" section), cached by GPU, ranks,
torch, MCore and model shape (`cache_path`).
"""

from __future__ import annotations

import hashlib
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cpkit.dynamic.plan import CPGroupAssignment, Microbatch, Plan

__all__ = ["BACK_TO_BACK", "PACE_TOKENS", "cache_path", "count_ops", "measure_step_costs", "pace_probe",
           "share_kernel_timing", "warm_groups"]

BACK_TO_BACK = 4
"""Micro-batches per timed call (`per_microbatch`): a real step runs its micro-batches back to back
with no sync between them; timing each alone between a barrier and a sync charged every one the
call's start and final wait (over-predicting 4-rank steps by up to 16%, 2026-11-27)."""

_ATEN = torch.ops.aten
_SYNC_OPS = {_ATEN._local_scalar_dense.default, _ATEN.nonzero.default, _ATEN.is_nonzero.default}


class _OpCounter(TorchDispatchMode):
    """Counts every dispatched aten op, and those that block the host on the device."""

    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func in _SYNC_OPS:
            self.syncs += 1
        elif func in (_ATEN._to_copy.default, _ATEN.copy_.default) and args:
            src = args[1] if func is _ATEN.copy_.default else args[0]
            dst = args[0].device if func is _ATEN.copy_.default else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                    and torch.device(dst).type == "cpu":
                self.syncs += 1  # a device-to-host copy (.tolist(), .cpu())
        return func(*args, **kwargs)


def count_ops(fn) -> tuple[int, int]:
    """(dispatched aten ops, host syncs) while `fn()` runs on this thread (the autograd engine
    carries the mode into backward)."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.ops, counter.syncs


def cache_path(root: str, device_name: str, world: int, dims, vocab: int) -> Path:
    """Where the calibration of this GPU, rank count, torch, MCore and model shape is kept."""
    from cpkit.bench.common import machine_info

    info = machine_info()
    shape = hashlib.sha256(repr((sorted(vars(dims).items()), vocab)).encode()).hexdigest()[:10]
    name = f"{device_name}-{world}r-torch{info['torch']}-mcore{info.get('megatron_core')}-{shape}"
    return Path(root) / (re.sub(r"[^A-Za-z0-9.+-]+", "_", name) + ".json")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _point_plan(cp: int, lens: list[int], world: int, max_len: int) -> Plan:
    """One micro-batch: every aligned block of `cp` ranks runs its own samples of `lens`."""
    n = len(lens)
    groups = tuple(CPGroupAssignment(tuple(range(f, f + cp)), tuple(range(g * n, (g + 1) * n)), cp)
                   for g, f in enumerate(range(0, world, cp)))
    all_lens = tuple(lens) * len(groups)
    return Plan(microbatches=(Microbatch(groups),), seq_lens=all_lens, dp_cp_size=world,
                max_seq_len_per_rank=max_len, workloads=tuple(float(L) for L in all_lens),
                needed_cp_sizes=(cp,) * len(all_lens), packed=True)


class _Runner:
    """Runs one micro-batch of a point plan on this rank through cpkit's runtime."""

    def __init__(self, model, registry, pgc, group, vocab, device):
        self.model, self.registry, self.pgc, self.group = model, registry, pgc, group
        self.vocab, self.device = vocab, device

    def samples(self, plan: Plan) -> list[dict]:
        """The plan's samples on the device (as the bench holds its batch: preparing them does
        no host-to-device copy)."""
        gen = torch.Generator().manual_seed(0)
        out = []
        for L in plan.seq_lens:
            seq = torch.randint(0, self.vocab, (L + 1,), generator=gen)
            out.append({"tokens": seq[:-1].to(self.device), "labels": seq[1:].to(self.device),
                        "loss_mask": torch.ones(L, device=self.device)})
        return out

    def prepare(self, plan: Plan, samples: list[dict] | None = None):
        """This rank's micro-batch 0 of `plan` (cpkit.dynamic.runtime.prepare_microbatch)."""
        from cpkit.dynamic.runtime import dp_cp_position, prepare_microbatch

        samples = samples if samples is not None else self.samples(plan)
        return prepare_microbatch(plan, 0, self.registry, dp_cp_position(self.registry), samples.__getitem__,
                                  device=self.device)

    def fwd_bwd(self, local, total: float, times: int = 1) -> None:
        """One forward_backward_local call of `local` (None: an idle slot) `times` times back to back."""
        from cpkit.dynamic.runtime import forward_backward_local

        forward_backward_local(self.model, [local] * times, total_tokens=total, pg_collection=self.pgc)

    def per_microbatch(self, local, total: float, warmup: int, iters: int) -> tuple[float, float]:
        """(seconds one more micro-batch adds in a call, the call's once-only gap): a call of
        BACK_TO_BACK micro-batches against a call of one, in alternating rounds, both timed like a
        step's forward and backward (module docstring, step 3)."""
        # the two calls alternate, so that a drifting host shifts both alike (their difference is
        # what is kept), and the medians are of each round's pair
        pairs = [(self._once(lambda: self.fwd_bwd(local, total)),
                  self._once(lambda: self.fwd_bwd(local, total, BACK_TO_BACK)))
                 for _ in range(warmup + iters)][warmup:]
        one = statistics.median(a for a, _ in pairs)
        many = statistics.median(b for _, b in pairs)
        per = statistics.median((b - a) / (BACK_TO_BACK - 1) for a, b in pairs)
        if per <= 0:  # timing noise on a tiny micro-batch: the long call's mean, no gap
            return many / BACK_TO_BACK, 0.0
        return per, max(0.0, one - per)

    def _once(self, fn) -> float:
        """The slowest rank's seconds of one `fn()` between a barrier and a sync (every rank runs it)."""
        _sync(self.device)
        dist.barrier(self.group)
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=self.group)
        return dt.item()

    def timed(self, fn, warmup: int, iters: int) -> float:
        """Median over `iters` of the slowest rank's seconds of `fn()` (every rank runs it)."""
        rows = [self._once(fn) for _ in range(warmup + iters)]
        return statistics.median(rows[warmup:])


PACE_TOKENS = 64


def pace_probe(model, registry, pgc, group, vocab, device):
    """A callable that times the host's pace now: BACK_TO_BACK micro-batches of one PACE_TOKENS
    sample at cp 1 on every rank (host-bound: launches, no real GPU work), between a barrier and
    a sync, the slowest rank's seconds. Timed beside every calibration point and in every round
    of a batch's steps, its ratio is the host's pace then against the calibration's
    (cpkit.dynamic.step_model.StepCosts.at_pace)."""
    run = _Runner(model, registry, pgc, group, vocab, device)
    local = run.prepare(_point_plan(1, [PACE_TOKENS], dist.get_world_size(group), 1 << 20))
    return lambda: run._once(lambda: run.fwd_bwd(local, float(PACE_TOKENS), BACK_TO_BACK))


def warm_groups(model, registry, pgc, group, vocab, device) -> None:
    """One tiny micro-batch on every CP size of the registry: NCCL communicators (collectives
    and the ring's point-to-point) and kernels are set up before anything is timed."""
    run = _Runner(model, registry, pgc, group, vocab, device)
    world = dist.get_world_size(group)
    for cp in registry.sizes:
        if cp <= world:
            local = run.prepare(_point_plan(cp, [16 * cp], world, 1 << 20))
            run.fwd_bwd(local, 1.0)
    model.zero_grad(set_to_none=False)
    _sync(device)


def _grid(sizes, longest: int, quick: bool) -> list[tuple[int, list[int]]]:
    """(cp, sample lengths) of the micro-benchmark points (module docstring, step 3): at cp 1,
    one sample from tiny to the batches' scale (host-bound to GPU-bound), four of a quarter of
    the largest, and four and eight tiny ones (the per-sample host cost); at cp > 1, a tiny
    and a large sample and four of a quarter (the residual's median)."""
    top = max(256, min(8192, longest))
    locals_ = [64, 256] if quick else [64, 1024, top // 2, top]
    out = []
    for cp in sizes:
        tokens = locals_ if cp == 1 else [locals_[0], locals_[-1]]
        out += [(cp, [min(longest, T * cp)]) for T in tokens]
        out.append((cp, [min(longest, locals_[-1] * cp // 4)] * 4))
        out.append((cp, [16 * cp] * 4))
        if cp == 1:
            out.append((cp, [16] * 8))
    return out


def _count(run, cp: int, world: int):
    """(ops base, ops per sample, syncs base, syncs per sample) of one micro-batch at `cp` on
    `run`'s model (n = 1 and 3 samples of a few tokens, fitted linear in n), or the error."""
    from cpkit.dynamic.step_fit import fit_linear

    rows = []
    for n in (1, 3):
        local = run.prepare(_point_plan(cp, [32 * cp] * n, world, 1 << 20))
        try:  # every rank runs the same code: a failure under the mode is on all of them
            rows.append((n, *count_ops(lambda: run.fwd_bwd(local, 1.0))))
        except Exception as err:  # noqa: BLE001 - the caller falls back and says why
            run.fwd_bwd(run.prepare(_point_plan(cp, [32 * cp] * n, world, 1 << 20)), 1.0)
            return f"{type(err).__name__}: {err}"
    ob, op = fit_linear([r[0] for r in rows], [r[1] for r in rows])
    sb, sp = fit_linear([r[0] for r in rows], [r[2] for r in rows])
    return ob, op, sb, sp


def measure_step_costs(model, opt, registry, pgc, group, vocab, device, *, longest: int,
                       quick: bool, kernel_model, pace, shallow=None) -> dict:
    """The "step" section of the calibration (module docstring, steps 2 to 4), on every rank;
    `kernel_model`: a cpkit.dynamic.cost.CostModel of the kernels (step 1's); `pace`: the run's
    `pace_probe` callable (the same one times the batches' rounds), timed beside every point;
    `shallow`: (model, its layers), the bench's model with fewer layers (None: the residual at cp
    1 is held at 0, cpkit.dynamic.step_fit)."""
    from dataclasses import replace

    from cpkit.dynamic.step_fit import MicrobatchPoint, fit_costs, fit_linear
    from cpkit.dynamic.step_model import OpCounts, StepCosts
    from cpkit.loss import all_reduce_gradients

    t_start = time.perf_counter()
    run = _Runner(model, registry, pgc, group, vocab, device)
    world = dist.get_world_size(group)
    sizes = [c for c in registry.sizes if c <= world]
    warmup, iters = (1, 2) if quick else (1, 3)
    counted, failed = {}, None
    for cp in sizes:  # ops and syncs, n = 1 and 3 samples of a few tokens
        row = _count(run, cp, world)
        if isinstance(row, str):
            failed = row
        else:
            counted[cp] = row
    low = None  # the shallow model: its runner and its counts at cp 1
    if shallow is not None and not failed:
        low_run = _Runner(shallow[0], registry, pgc, group, vocab, device)
        row = _count(low_run, 1, world)
        low = None if isinstance(row, str) else (low_run, shallow[1], OpCounts({1: row}))
    from cpkit.bench.common import machine_info

    info = machine_info()
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    where = (f"counted on {dev_name} (torch {info['torch']}, megatron-core {info.get('megatron_core')}): "
             "aten ops of one micro-batch forward + backward of the bench's model")
    if failed or not counted:  # 4 layers on CPU, MCore 0.19.2 (the 0f7f3d4 reading), per layer
        scale = kernel_model.dims.num_layers / 4
        counted = {c: (v * scale, 300 * scale, 17.0, 0.0) for c, v in ((1, 589), (2, 989), (4, 1373))
                   if c in sizes}
        where = f"NOT COUNTED ({failed}): 0f7f3d4's CPU reading, scaled by layers"
    ops = OpCounts(counted, where)
    layers = kernel_model.dims.num_layers
    points, prep, gaps, paces, point_paces = [], [], [], [], []
    pace()  # its shapes warmed before it is timed
    for cp, lens in _grid(sizes, longest, quick):
        paces.append(pace())
        done = len(points)
        plan = _point_plan(cp, lens, world, 1 << 20)
        holder, samples = {}, run.samples(plan)

        def prepare():
            holder["local"] = run.prepare(plan, samples)

        prep.append((len(lens), run.timed(prepare, warmup, iters)))
        seconds, gap = run.per_microbatch(holder["local"], float(sum(lens)), warmup, iters)
        gaps.append(gap)
        fixed = ops.ops(cp, 0)
        points.append(MicrobatchPoint(cp, tuple(lens), fixed, ops.ops(cp, len(lens)) - fixed,
                                      ops.syncs(cp, len(lens)), seconds, layers))
        if cp == 1 and low is not None:  # the same micro-batch on the shallow model
            low_run, low_layers, low_ops = low
            seconds, _ = low_run.per_microbatch(low_run.prepare(plan, samples), float(sum(lens)),
                                                warmup, iters)
            fixed = low_ops.ops(1, 0)
            points.append(MicrobatchPoint(1, tuple(lens), fixed, low_ops.ops(1, len(lens)) - fixed,
                                          low_ops.syncs(1, len(lens)), seconds, low_layers))
        point_paces += [paces[-1]] * (len(points) - done)
    # each point read at the host's pace beside it, against the calibration's median pace
    median_pace = statistics.median(paces)
    points = [replace(p, pace=t / median_pace) for p, t in zip(points, point_paces)]
    x = torch.zeros(1, device=device)

    def syncs():
        for _ in range(20):
            x.add_(1)
            x.item()

    sync_s = run.timed(syncs, warmup, iters) / 20
    idle_s, _ = run.per_microbatch(None, 1.0, warmup, iters)

    def reduce_opt():
        all_reduce_gradients(model, group)
        opt.step()

    reduce_opt_s = run.timed(reduce_opt, warmup, iters)
    model.zero_grad(set_to_none=False)
    if low is not None:
        low[0].model.zero_grad(set_to_none=False)
    prep_mb, prep_sample = fit_linear([n for n, _ in prep], [t for _, t in prep])
    # CostModel's kernel time is layers x one layer's: a shallow point's is scaled down
    fitted = fit_costs(points, lambda p: kernel_model.group_time(p.seq_lens, p.cp) * (p.layers or layers) / layers,
                       layers, sync_s)
    costs = StepCosts(ops=ops, host_op_s=fitted["host_op_s"], sync_s=sync_s,
                      mem_s_per_token=fitted["mem_s_per_token"], overlap_loss=fitted["overlap_loss"],
                      sample_op_s=fitted["sample_op_s"],
                      residual_s=fitted["residual_s"], idle_s=idle_s, prep_mb_s=max(0.0, prep_mb),
                      prep_sample_s=max(0.0, prep_sample), reduce_opt_s=reduce_opt_s,
                      call_gap_s=statistics.median(gaps),
                      source={"points": [[p.cp, list(p.seq_lens), p.ops, p.sample_ops, p.syncs, p.seconds,
                                          p.layers, p.pace] for p in points],
                              "call_gaps_s": gaps, "back_to_back": BACK_TO_BACK,
                              "pace_s": median_pace, "pace_samples_s": paces,
                              "residual_identified": fitted["residual_identified"],
                              "shallow_layers": low[1] if low is not None else None,
                              "fit_errors": {str(c): v for c, v in fitted["errors"].items()},
                              "seconds": time.perf_counter() - t_start,
                              "what": "micro-benchmarks on these ranks (cpkit.bench.dynamic.dynamic_step_calibrate)"})
    return costs.to_dict()


def share_kernel_timing(timer, dims, link, group, *, device_name: str, origin: str, quick: bool,
                        max_tokens: int | None = None) -> dict:
    """cpkit.bench.dynamic.replay_calibration.calibration_from_timer with the kernel shapes spread over
    the ranks of `group`: each rank times its share, all share the results (module docstring,
    step 1). Every rank returns the same calibration dict."""
    from cpkit.bench.dynamic.replay_calibration import calibration_from_timer
    from cpkit.bench.dynamic.replay_kernels import KernelTimer
    from cpkit.bench.dynamic.replay_work import AttnCall

    class _Recorder(KernelTimer):  # asks for the shapes without running them
        def __init__(self):
            super().__init__(dims, torch.device("cpu"))
            self.keys = []

        def _gemm_at(self, tokens):
            self.keys.append(("gemm", tokens))
            return 1.0

        def call(self, call):
            self.keys.append(("call", (call.kind, tuple(sorted(call.chunks)))))
            return 1.0, 1.0

    rec = _Recorder()
    calibration_from_timer(rec, dims, link, device=device_name, origin=origin, quick=quick,
                           max_tokens=max_tokens)
    keys = sorted(set(rec.keys), key=lambda k: (-(k[1] if k[0] == "gemm" else sum(k[1][1]) * 4), str(k)))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {"gemm": {}, "call": {}}
    for kind, key in keys[rank::world]:
        if kind == "gemm":
            mine["gemm"][key] = timer._gemm_at(key)
        else:
            mine["call"][key] = timer.call(AttnCall(key[0], key[1]))
    shared = [None] * world
    dist.all_gather_object(shared, mine, group=group)
    for part in shared:
        timer._gemm.update(part["gemm"])
        timer._calls.update(part["call"])
    return calibration_from_timer(timer, dims, link, device=device_name, origin=origin, quick=quick,
                                  max_tokens=max_tokens)

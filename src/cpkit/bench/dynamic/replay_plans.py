"""The replay's global batches and the plans every implementation makes of them.

Batches (`batches`):
- "mix": the scheduler bench's two mixes (cpkit.bench.dynamic.scheduler.sample_lengths, lognormal and
  long-tail), 8 sequences per rank, N in {8, 16, 32} DPxCP ranks, M in {4096, 8192} tokens per
  rank (4K-8K per rank), lengths capped at min(N, 64) * M;
- "mixlong": the same two mixes at M in {16384, 32768} (16K-32K per rank);
- "long": long context, M in {16384, 32768} (16K-32K per rank), 2 sequences per rank, lengths
  lognormal with median M and sigma 1.0, capped at N * M;
- a file (`--seq-lens-file`): one global batch per line, lengths separated by commas or blanks
  (or a JSON list of lists), run at the given N and M.

Plans (`plans`): cpkit (cpkit.dynamic.schedule with the replay's cost model and step rule),
static CP with packing (cpkit.dynamic.static.static_cp_plan), MCore's BalancedCPScheduler
(cpkit.dynamic.mcore) and Megatron-LM's DefaultDynamicCPScheduler (`cpkit.dynamic.mlm.mlm_schedule`)
when CPKIT_MLM_SRC is set and that module exists. A scheduler that crashes or is missing gives
an error string instead of a plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

from cpkit.bench.dynamic.scheduler import sample_lengths
from cpkit.dynamic import schedule
from cpkit.dynamic.cost import CostModel
from cpkit.dynamic.scheduler import needed_cp_sizes
from cpkit.dynamic.static import static_cp_plan
from cpkit.errors import CPConfigError

__all__ = ["Batch", "batches", "plans", "read_seq_lens_file"]

MIX_SIZES, MIX_M = (8, 16, 32), (4096, 8192)
LONG_SIZES, LONG_M = (8, 16, 32), (16384, 32768)


@dataclass(frozen=True)
class Batch:
    """One global batch to replay: its set, label, lengths, N and M."""

    set: str
    label: str
    seq_lens: tuple[int, ...]
    dp_cp_size: int
    max_seq_len_per_rank: int


def _long_lengths(count: int, median: int, cap: int, rng: random.Random) -> list[int]:
    return [max(1, min(int(rng.lognormvariate(math.log(median), 1.0)), cap)) for _ in range(count)]


def batches(sets: list[str], per_cell: int, seed: int = 0, quick: bool = False,
            sizes: tuple[int, ...] | None = None, shrink: int = 1) -> list[Batch]:
    """The built-in batches of `sets` ("mix", "long"), `per_cell` per (mix, N, M) cell;
    `shrink` divides every length and M (CPU smoke runs of a tiny model)."""
    if shrink > 1:
        return [dataclasses.replace(b, seq_lens=tuple(max(1, L // shrink) for L in b.seq_lens),
                                    max_seq_len_per_rank=b.max_seq_len_per_rank // shrink)
                for b in batches(sets, per_cell, seed, quick, sizes)]
    out = []
    mix_sizes = sizes or ((8,) if quick else MIX_SIZES)
    long_sizes = sizes or ((8,) if quick else LONG_SIZES)
    for b in range(per_cell):
        for name, ms in (("mix", MIX_M), ("mixlong", LONG_M)):  # the bench's mixes at two M ranges
            if name not in sets:
                continue
            for mix in ("lognormal", "long-tail"):
                for n in mix_sizes:
                    for M in ms:
                        rng = random.Random(seed + 1000 * b + 7 * n + M)
                        lens = sample_lengths(mix, 8 * n, min(n, 64) * M, rng)
                        out.append(Batch(name, f"{mix} N={n} M={M // 1024}K #{b}", tuple(lens), n, M))
        if "long" in sets:
            for n in long_sizes:
                for M in LONG_M:
                    rng = random.Random(seed + 1000 * b + 11 * n + M)
                    lens = _long_lengths(2 * n, M, n * M, rng)
                    out.append(Batch("long", f"long N={n} M={M // 1024}K #{b}", tuple(lens), n, M))
    return out


def read_seq_lens_file(path: str, dp_cp_size: int, max_seq_len_per_rank: int) -> list[Batch]:
    """Batches from `path`: a JSON list of lists of lengths, or one batch per line."""
    fix = "write one batch per line: 4096, 913, 12000, ..."
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise CPConfigError.single("seq_lens_file", path, f"cannot be read ({err.strerror})",
                                   fix) from None
    try:
        rows = json.loads(text)
        if rows and not isinstance(rows[0], list):
            rows = [rows]
    except json.JSONDecodeError:
        try:
            rows = [[int(x) for x in line.replace(",", " ").split()] for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
        except ValueError as err:
            raise CPConfigError.single("seq_lens_file", path, f"holds a non-integer length ({err})",
                                       fix) from None
    if not rows or not all(rows):
        raise CPConfigError.single("seq_lens_file", path, "holds no batch of lengths", fix)
    return [Batch("file", f"{Path(path).name} #{i}", tuple(int(x) for x in r), dp_cp_size,
                  max_seq_len_per_rank) for i, r in enumerate(rows)]


def _mlm():
    """Megatron-LM's scheduler behind cpkit's plan type, when CPKIT_MLM_SRC names a checkout and
    cpkit.dynamic.mlm exists; else None."""
    if not os.environ.get("CPKIT_MLM_SRC"):
        return None
    try:
        from cpkit.dynamic.mlm import mlm_schedule
    except ImportError:
        return None
    return mlm_schedule


def plans(batch: Batch, model: CostModel, rule: str, pp_size: int,
          timeout_s: float = 120.0, with_cpkit: bool = True) -> dict[str, object]:
    """{implementation: Plan or an error string} for one batch (`with_cpkit=False`: all but
    cpkit's, for a caller that schedules with the others as references)."""
    lens, n, M = list(batch.seq_lens), batch.dp_cp_size, batch.max_seq_len_per_rank
    out: dict[str, object] = {}
    if with_cpkit:
        out["cpkit"] = schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M, cost_model=model,
                                step_rule=rule, pp_size=pp_size)
    needs = needed_cp_sizes(lens, dp_cp_size=n, max_seq_len_per_rank=M)
    out["static"] = static_cp_plan(lens, needs, dp_cp_size=n, max_seq_len_per_rank=M,
                                   cost_model=model)
    try:
        from cpkit.dynamic.mcore import SchedulerCrash, mcore_schedule

        try:
            out["mcore"] = mcore_schedule(lens, dp_cp_size=n, max_seq_len_per_rank=M,
                                          timeout_s=timeout_s)
        except SchedulerCrash as err:
            out["mcore"] = f"crash: {err.detail}"
    except ImportError as err:
        out["mcore"] = f"unavailable: {err}"
    mlm = _mlm()
    if mlm is not None:
        try:
            out["mlm"] = mlm(lens, n, M, timeout_s=timeout_s)
        except Exception as err:  # noqa: BLE001 - any failure of upstream code is reported
            out["mlm"] = f"crash: {type(err).__name__}: {err}"
    return out

"""Probes of a Megatron-LM checkout's scheduling internals, run in its worker process
(cpkit.dynamic.mlm.mlm_call): each takes the loaded upstream modules first and returns JSON.

They reach code the public entry point hides (nested functions, intermediate lists) so that the
tests in tests/test_dynamic_mlm.py can check the findings of the dynamic-CP review against the
checkout itself. Nothing of upstream is copied: nested functions are rebuilt from the
checkout's own code objects.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

__all__ = ["balanced_cp_rank_lists", "balanced_cp_rank_lists_alias", "exit_worker",
           "fill_empty_reads_index_minus_one", "packing_aware_rank_lists_alias",
           "sleep_with_the_alarm_blocked", "truncated_assert_messages"]


class _StandInGroup:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _nested_code(code: types.CodeType, name: str) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            found = _nested_code(const, name)
            if found is not None:
                return found
    return None


class _NegativeIndexRecorder(list):
    """A rank list that records reads at negative indices and answers them with `answer`."""

    def __init__(self, items, answer):
        super().__init__(items)
        self.negative_reads: list[int] = []
        self.answer = answer

    def __getitem__(self, index):
        if isinstance(index, int) and index < 0:
            self.negative_reads.append(index)
            if self.answer is not None:
                return self.answer
        return super().__getitem__(index)


def fill_empty_reads_index_minus_one(modules, sample_id_group):
    """Run align_sample_id_groups' nested `fill_empty` on `sample_id_group` twice: once with
    reads at negative indices answered normally, once answered with a list holding every
    sample id. Returns {"negative_reads": [...], "plain": result, "poisoned": result}."""
    code = _nested_code(modules["data_schedule_utils"].align_sample_id_groups.__code__,
                        "fill_empty")
    if code is None or code.co_freevars:
        raise LookupError("align_sample_id_groups has no self-contained nested fill_empty")
    fill_empty = types.FunctionType(code, vars(modules["data_schedule_utils"]))
    every_id = sorted({s for rank in sample_id_group for s in rank})
    plain = _NegativeIndexRecorder([list(r) for r in sample_id_group], None)
    poisoned = _NegativeIndexRecorder([list(r) for r in sample_id_group], every_id)
    plain_result = [list(r) for r in fill_empty(plain)]
    # The poisoned list only changes reads at index -1 inside the scan loop; the slice
    # assignments fill_empty does use slices, which the recorder leaves alone.
    poisoned_result = [list(r) for r in fill_empty(poisoned)]
    return {"negative_reads": plain.negative_reads, "plain": plain_result,
            "poisoned": poisoned_result}


def _balanced_cp_groups(modules, seq_lens, dp_cp_size, max_seq_len_per_rank):
    scheduler = modules["hybrid_cp_schedule"].BalancedCPScheduler(
        max_seq_len_per_rank, _StandInGroup(dp_cp_size))
    return scheduler.get_groups_and_subsamples(list(enumerate(seq_lens)), None)[1]


def balanced_cp_rank_lists(modules, seq_lens, dp_cp_size, max_seq_len_per_rank):
    """The checkout's BalancedCPScheduler (hybrid_cp_schedule, still on dev): per micro-batch,
    each rank's sample ids."""
    return [[list(rank) for rank in mb]
            for mb in _balanced_cp_groups(modules, seq_lens, dp_cp_size, max_seq_len_per_rank)]


def balanced_cp_rank_lists_alias(modules, seq_lens, dp_cp_size, max_seq_len_per_rank):
    """Per micro-batch of the checkout's BalancedCPScheduler: whether two different ranks got
    the very same sample-id list object."""
    groups = _balanced_cp_groups(modules, seq_lens, dp_cp_size, max_seq_len_per_rank)
    return [len({id(rank) for rank in mb}) < len(mb) for mb in groups]


def packing_aware_rank_lists_alias(modules, seq_lens, dp_cp_size, max_seq_len_per_rank):
    """The same question for dev's next_hdp_group_packing_aware, one micro-batch."""
    _, _, _, per_rank = modules["data_schedule_utils"].next_hdp_group_packing_aware(
        sorted(enumerate(seq_lens), key=lambda x: x[1], reverse=True), dp_cp_size,
        max_seq_len_per_rank)
    return len({id(rank) for rank in per_rank}) < len(per_rank)


def truncated_assert_messages(modules, module_key):
    """Asserts in one checkout module whose message is followed by a bare string statement
    (implicit concatenation broken by the parentheses): [[function, kept, dropped]]."""
    path = Path(modules[module_key].__file__)
    tree = ast.parse(path.read_text())
    found: dict[int, list] = {}  # by line: an inner function, walked later, names it
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            for field in ("body", "orelse", "finalbody"):
                body = getattr(node, field, None)
                if not isinstance(body, list):
                    continue
                for stmt, after in zip(body, body[1:]):
                    if isinstance(stmt, ast.Assert) and isinstance(after, ast.Expr) \
                            and isinstance(after.value, ast.Constant) \
                            and isinstance(after.value.value, str):
                        kept = stmt.msg.value if isinstance(stmt.msg, ast.Constant) else None
                        found[after.lineno] = [function.name, kept, after.value.value]
    return [found[line] for line in sorted(found)]


def sleep_with_the_alarm_blocked(modules, seconds):
    """Stand-in for a loop the worker's alarm cannot end (one inside C code)."""
    import signal
    import time

    from cpkit.dynamic.mlm_worker import ALARM

    signal.pthread_sigmask(signal.SIG_BLOCK, {ALARM})
    time.sleep(seconds)
    return seconds


def exit_worker(modules, code):
    """Stand-in for upstream code that kills its process."""
    import os

    os._exit(code)

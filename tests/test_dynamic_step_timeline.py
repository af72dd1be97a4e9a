"""Where a real step's time goes, so a step the model under-predicts shows which term misses:
the micro-batch marks of one step (cpkit.dynamic.microbatch_timeline) through the runtime's
loop, their stream and host seconds, and the bench's breakdown of a step into the model's terms
(cpkit.bench.dynamic.dynamic_step_breakdown) on a synthetic result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cpkit.dynamic.microbatch_timeline import MicrobatchTimeline


class _Clock:
    """A stream clock the test moves by hand; events read it when recorded."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def elapsed_time(self, later):  # ms, as torch.cuda.Event's
                return (later.at - self.at) * 1e3

        return Event()


def _mb(cp, lens, local):
    return SimpleNamespace(assignment=SimpleNamespace(cp_size=cp, samples=tuple(range(len(lens)))),
                           packed=SimpleNamespace(seq_lens=tuple(lens)),
                           batch={"tokens": torch.zeros(1, local, dtype=torch.long)})


def test_stream_events_time_each_microbatch_and_the_gaps_between():
    clock = _Clock()
    tl = MicrobatchTimeline("cpu", event_factory=clock.event)
    tl.open()
    clock.now = 0.002  # the first micro-batch starts 2 ms after forward + backward began
    tl.start(_mb(2, [100, 60], 84))
    clock.now = 0.012
    tl.stop()
    clock.now = 0.013
    tl.start(None)  # idle: the zero-loss backward
    clock.now = 0.016
    tl.stop()
    clock.now = 0.020  # a lockstep wait after the last
    tl.close()
    rec = tl.records()
    first, idle = rec["microbatches"]
    assert {k: first[k] for k in ("cp", "samples", "tokens", "local_tokens")} == \
        {"cp": 2, "samples": 2, "tokens": 160, "local_tokens": 84}
    assert first["gpu_s"] == pytest.approx(0.010) and first["gap_s"] == pytest.approx(0.002)
    assert idle == {**idle, "cp": None, "samples": 0, "tokens": 0, "local_tokens": 0}
    assert idle["gpu_s"] == pytest.approx(0.003) and idle["gap_s"] == pytest.approx(0.001)
    assert rec["tail_s"] == pytest.approx(0.004) and rec["span_s"] == pytest.approx(0.020)
    assert all(m["host_s"] >= 0 for m in rec["microbatches"])  # the host's own clock
    # the stream's span is the micro-batches, the gaps and the tail: nothing is counted twice
    assert rec["span_s"] == pytest.approx(sum(m["gpu_s"] + m["gap_s"] for m in rec["microbatches"])
                                          + rec["tail_s"])


def test_the_runtime_marks_every_microbatch_on_cpu_with_host_times_only():
    from cpkit.dynamic.runtime import forward_backward_local

    model = torch.nn.Linear(4, 4)
    tl = MicrobatchTimeline("cpu")
    tl.open()
    shares = forward_backward_local(model, [None, None, None], total_tokens=1.0, pg_collection=None,
                                    recorder=tl)
    tl.close()
    rec = tl.records()
    assert len(shares) == len(rec["microbatches"]) == 3
    for m in rec["microbatches"]:
        assert m["cp"] is None and m["gpu_s"] is None and m["host_s"] > 0 and m["gap_s"] >= 0
    assert rec["span_s"] == pytest.approx(sum(m["host_s"] + m["gap_s"] for m in rec["microbatches"])
                                          + rec["tail_s"])
    # without a recorder the loop is the same loop
    assert len(forward_backward_local(model, [None], total_tokens=1.0, pg_collection=None)) == 1


def test_a_mark_out_of_order_is_an_error_not_a_wrong_time():
    tl = MicrobatchTimeline("cpu")
    with pytest.raises(RuntimeError, match="without a start"):
        tl.stop()
    tl.start(None)
    with pytest.raises(RuntimeError, match="never stopped"):
        tl.records()
    tl.stop()
    assert tl.records()["microbatches"][0]["gap_s"] is None  # never opened: no first gap
    assert tl.records()["tail_s"] is None


def _mark(cp, gpu, gap, host=0.001):
    return {"cp": cp, "samples": 0 if cp is None else 1, "tokens": 0, "local_tokens": 0,
            "host_s": host, "gpu_s": gpu, "gap_s": gap}


def _family(per_rank, pred_mb, pred_fb, step=0.1):
    return {"step_s": [step] * 3, "fwd_bwd_s": [0.07] * 3, "prep_s": [0.01] * 3, "reduce_opt_s": [0.02] * 3,
            "loss": 2.0, "predicted_step_s": 0.09, "predicted_fwd_bwd_s": max(pred_fb),
            "predicted_prep_s": 0.008, "predicted_reduce_opt_s": 0.021, "predicted_per_rank_fwd_bwd_s": pred_fb,
            "predicted_per_rank_microbatch_s": pred_mb, "kernels_only_s": 0.05, "cp_sizes": [1, 2],
            "microbatches": 2, "plan": {"mean_token_fill": 0.9},
            "timeline": {"what": "test", "per_rank": per_rank}}


def _rank(fb, mbs, tail, prep=0.01, ro=0.02):
    return {"step_s": prep + fb + ro, "fwd_bwd_s": fb, "prep_s": prep, "reduce_opt_s": ro,
            "microbatches": mbs, "tail_s": tail, "span_s": None}


def test_the_breakdown_takes_the_slowest_rank_and_names_the_term_that_misses():
    from cpkit.bench.dynamic.dynamic_step_breakdown import breakdown_table
    from cpkit.bench.dynamic.dynamic_step_report import summarize

    # rank 1 is slowest: micro-batches 0.030 + 0.025 on the stream, gaps 0.004 + 0.006, tail 0.002,
    # and 0.003 of its 0.070 forward + backward off the stream; the model gives it 0.020 + 0.021
    # in its micro-batches and 0.004 of waiting: the micro-batches miss by 0.014
    fast = _rank(0.050, [_mark(2, 0.020, 0.001), _mark(None, 0.002, 0.001)], 0.001)
    slow = _rank(0.070, [_mark(2, 0.030, 0.004, host=0.012), _mark(1, 0.025, 0.006, host=0.009)], 0.002)
    res = [{"label": "lognormal a", "tokens": 1000,
            "impl": {"mcore": _family([fast, slow], [[0.020, 0.004], [0.020, 0.021]], [0.030, 0.045])}}]
    summarize(res)
    b = res[0]["impl"]["mcore"]["timeline_breakdown"]
    assert b["rank"] == 1 and b["microbatches"] == 2 and b["idle"] == 0 and b["clock"] == "gpu"
    assert b["mb_s"] == pytest.approx(0.055) and b["host_mb_s"] == pytest.approx(0.021)
    assert b["between_s"] == pytest.approx(0.012) and b["other_s"] == pytest.approx(0.003)
    assert b["pred_mb_s"] == pytest.approx(0.041) and b["pred_between_s"] == pytest.approx(0.004)
    assert b["misses"] == pytest.approx({"mb": -0.014, "between": -0.008, "other": -0.003,
                                         "prep": -0.002, "r+o": 0.001})
    # the terms add up: predicted - measured step of that rank
    assert sum(b["misses"].values()) == pytest.approx(b["pred_step_s"] - b["step_s"])
    text = breakdown_table(res)
    assert text.startswith("where the step's time goes")
    row = next(line for line in text.splitlines() if line.startswith("lognormal a mcore"))
    assert row.split() == ["lognormal", "a", "mcore", "1", "2", "(0)", "41.0", "55.0", "21.0", "4.0", "12.0",
                           "3.0", "8.0", "10.0", "21.0", "20.0", "74.0", "100.0", "mb", "-14.0"]


def test_the_breakdown_on_cpu_uses_host_times_and_says_when_the_counts_differ():
    from cpkit.bench.dynamic.dynamic_step_breakdown import breakdown, breakdown_table

    cpu = _rank(0.030, [_mark(1, None, 0.001, host=0.010), _mark(None, None, 0.002, host=0.005)], 0.001)
    info = _family([cpu], [[0.010]], [0.012])  # the model counts one micro-batch, two ran
    b = breakdown(info)
    assert b["clock"] == "host" and b["idle"] == 1 and b["mb_s"] == pytest.approx(0.015)
    assert "misses" not in b and b["mismatch"] == "the model counts 1 micro-batches on rank 0, 2 ran"
    text = breakdown_table([{"label": "x", "tokens": 10, "impl": {"cpkit": info}}])
    assert "15.0 host" in text and "x cpkit: the model counts 1 micro-batches" in text
    assert breakdown({"step_s": [1.0]}) is None  # no marked step (an older result)
    assert breakdown_table([{"label": "x", "tokens": 10, "impl": {"cpkit": {"step_s": [1.0]}}}]) == ""

"""GPU claims (cpkit.harness.gpu_claim) and the xdist groups of GPU tests: the parts of the parallel GPU
tier that run without a GPU. Lock files live in tmp_path (flock conflicts between two open()s
of one file in one process too, so one process can play several launches)."""

import threading
import time

import pytest

from cpkit.harness.gpu_claim import LOCK_DIR_ENV, SLOTS_ENV, claim_gpus, gpu_slots, visible_gpu_ids
from cpkit.testing.pytest_plugin import xdist_group_of

GPUS = ["0", "1", "2", "3"]


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(SLOTS_ENV, raising=False)  # one slot unless a test says otherwise


def test_two_pair_claims_get_disjoint_aligned_pairs():
    with claim_gpus(2, GPUS) as a, claim_gpus(2, GPUS) as b:
        assert sorted([a, b]) == [["0", "1"], ["2", "3"]]
        with pytest.raises(TimeoutError, match=r"no 2 free GPUs.*gpu-0.lock: pid \d+"):
            with claim_gpus(2, GPUS, timeout_s=0.3):
                pass
    with claim_gpus(2, GPUS) as again:  # reclaimed on exit
        assert again == ["0", "1"]


def test_a_waiting_whole_host_claim_holds_back_new_pairs_and_gets_every_gpu():
    first = claim_gpus(2, GPUS)
    assert first.__enter__() == ["0", "1"]
    got = []
    whole = claim_gpus(4, GPUS, poll_s=0.02)
    t = threading.Thread(target=lambda: got.extend(whole.__enter__()))
    t.start()
    time.sleep(0.3)
    assert not got  # waiting for GPUs 0 and 1
    # 2 and 3 are free, but a new pair would starve the whole-host claim: it waits too.
    with pytest.raises(TimeoutError):
        with claim_gpus(2, GPUS, timeout_s=0.3):
            pass
    first.__exit__(None, None, None)
    t.join(10)
    assert got == GPUS
    whole.__exit__(None, None, None)
    with claim_gpus(2, GPUS, timeout_s=1) as pair:  # everything reclaimed
        assert pair == ["0", "1"]


def test_too_few_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="a launch of 4 NCCL ranks needs 4 GPUs, found 2"):
        with claim_gpus(4, ["0", "1"]):
            pass


def test_visible_ids_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_ids(2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6,GPU-ab12")
    assert visible_gpu_ids(3) == ["4", "6", "GPU-ab12"]


def test_nccl_launch_without_gpus_fails_before_starting_ranks(monkeypatch):
    from cpkit.harness.launch import launch

    monkeypatch.setattr("cpkit.harness.launch.cuda_device_count", lambda: 0)
    with pytest.raises(ValueError, match="needs 2 GPUs, found 0"):
        launch(print, 2, backend="nccl", timeout=5)


def test_xdist_groups_put_every_nccl_test_with_the_worker_that_owns_the_pools():
    assert xdist_group_of("functional/test_gpt.py::test_x[gloo2-a]", []) == "functional/test_gpt.py"
    assert xdist_group_of("functional/test_gpt.py::test_x[nccl2-a]", ["gpu2"]) == "nccl"
    assert xdist_group_of("functional/test_attention.py::test_y[nccl4-a]", ["gpu4"]) == "nccl"
    assert xdist_group_of("functional/test_kernels_gpu.py::test_k", ["gpu1"]) == "gpu1"


def test_timing_table_lines(tmp_path, monkeypatch):
    import json

    from cpkit.harness.launch import CaseResult
    from cpkit.harness.launch_times import TIMES_ENV, record_grid_times

    path = tmp_path / "times.jsonl"
    monkeypatch.setenv(TIMES_ENV, str(path))
    results = {"a": CaseResult("a", seconds=1.5), "b": CaseResult("b", errors={0: "x"}, seconds=0.5)}
    record_grid_times(test_timing_table_lines, "nccl", 2, results, 0.0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("case") for line in lines] == ["a", "b", None]
    assert lines[1]["ok"] is False and lines[2]["cases_s"] == 2.0 and lines[2]["wall_s"] > 0
    assert lines[0]["grid"].endswith("test_gpu_claim.test_timing_table_lines")


def test_an_unwritable_timing_log_warns_and_never_fails_the_run(tmp_path, monkeypatch):
    from cpkit.harness.launch_times import TIMES_ENV, record_times

    monkeypatch.setenv(TIMES_ENV, str(tmp_path / "missing-dir" / "times.jsonl"))
    with pytest.warns(UserWarning, match="cannot be written"):
        record_times([{"case": "x", "seconds": 1.0}])


def test_slots_let_that_many_whole_host_claims_run_side_by_side():
    """On a 2-GPU host every 2-rank launch needs the whole host: with one slot the proof's launch
    workers ran one after another; with S slots S of them run at once, and one more waits."""
    gpus = ["0", "1"]
    with claim_gpus(2, gpus, slots=2, timeout_s=1) as a, claim_gpus(2, gpus, slots=2, timeout_s=1) as b:
        assert a == b == gpus
        with pytest.raises(TimeoutError, match=r"no 2 free GPUs.*gpu-0.lock: pid \d+.*gpu-0.slot1.lock: pid \d+"):
            with claim_gpus(2, gpus, slots=2, timeout_s=0.3):
                pass
    with claim_gpus(2, gpus, slots=1, timeout_s=1) as one:  # reclaimed on exit
        assert one == gpus
        with pytest.raises(TimeoutError):
            with claim_gpus(2, gpus, slots=1, timeout_s=0.3):
                pass


def test_with_slots_pairs_fill_every_slot_and_a_whole_host_claim_takes_a_free_slot_at_once():
    pairs = [claim_gpus(2, GPUS, slots=2, timeout_s=1) for _ in range(3)]
    assert [p.__enter__() for p in pairs] == [["0", "1"], ["2", "3"], ["0", "1"]]
    with claim_gpus(2, GPUS, slots=2, timeout_s=1) as fourth:  # the last free pair: slot 1's GPUs 2 and 3
        assert fourth == ["2", "3"]
    for p in pairs[1:]:
        p.__exit__(None, None, None)
    # slot 0 still has a pair on GPUs 0 and 1; slot 1 is free: the whole host there, without waiting
    with claim_gpus(4, GPUS, slots=2, timeout_s=1) as whole:
        assert whole == GPUS
    pairs[0].__exit__(None, None, None)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_slot_count_is_a_clear_error_whose_fix_passes(value, monkeypatch):
    monkeypatch.setenv(SLOTS_ENV, value)
    with pytest.raises(ValueError, match=rf"CPKIT_GPU_SLOTS='{value}': must be an integer >= 1.*fix: CPKIT_GPU_SLOTS=1"):
        gpu_slots()
    monkeypatch.setenv(SLOTS_ENV, "1")
    assert gpu_slots() == 1
    monkeypatch.delenv(SLOTS_ENV)
    assert gpu_slots() == 1
    with pytest.raises(ValueError, match="slots=0: must be >= 1"):
        with claim_gpus(2, GPUS, slots=0, timeout_s=1):
            pass

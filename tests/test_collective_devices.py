"""A tensor handed to a collective lives on its group's device, even where it is made from data that
is empty on this rank (cpkit.parallel.group_info.group_device).

An NCCL group refuses CPU tensors and gloo accepts them, so the gloo tier cannot show a device taken
from the wrong place. Here an NCCL-like group (a fake backend serving CUDA tensors only,
cpkit.testing.fakes.fake_group(device_type="cuda")) stands in, and group_device is pointed at a
device a CPU-only torch can allocate on, so the test sees which device the collective got.
"""

import pytest
import torch
import torch.distributed as dist

import cpkit.eval_cp.loop
import cpkit.loss
from cpkit.compat import new_pg_collection
from cpkit.parallel.group_info import group_device
from cpkit.testing.fakes import fake_group

MARKER = torch.device("meta")  # what the patched group_device hands out for the NCCL-like group


def test_an_nccl_like_group_refuses_cpu_tensors_as_nccl_does():
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        fake_group([0, 1], device_type="cuda").allreduce([torch.zeros(2)])  # the backend's own call


def test_group_device_is_the_current_cuda_device_for_a_cuda_backend_and_cpu_otherwise(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert group_device(fake_group([0, 1], device_type="cuda")) == torch.device("cuda", 3)
    assert group_device([fake_group([0, 1], device_type="cuda"), None]) == torch.device("cuda", 3)
    assert group_device(fake_group([0, 1])) == torch.device("cpu")
    if not dist.is_initialized():
        assert group_device(None) == torch.device("cpu")


class _Stop(Exception):
    pass


@pytest.fixture
def nccl_like(monkeypatch):
    """An NCCL-like group of 2; group_device maps it to MARKER; all_reduce records its tensor's
    device and stops the function there (the result of a fake collective means nothing)."""
    group = fake_group([0, 1], rank=0, device_type="cuda")
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        raise _Stop

    def mapped(g):
        return MARKER if g is group else torch.device("cpu")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=None, group=None: objs.__setitem__(0, ["lm loss"]))
    for module in (cpkit.loss, cpkit.eval_cp.loop):
        monkeypatch.setattr(module, "group_device", mapped, raising=False)
    return group, seen


def test_reported_losses_on_a_stage_without_losses_reduce_on_the_pp_groups_device(nccl_like):
    # the first of 2 pipeline stages: MCore's schedule returned no losses here
    pp, seen = nccl_like
    with pytest.raises(_Stop):
        cpkit.loss.reduce_reported_losses([], new_pg_collection(pp=pp))
    assert seen == [MARKER]


def test_reported_losses_on_the_last_stage_reduce_on_the_pp_groups_device(nccl_like):
    pp, seen = nccl_like
    with pytest.raises(_Stop):
        cpkit.loss.reduce_reported_losses([{"lm loss": torch.tensor([3.0, 2.0])}], new_pg_collection(pp=pp))
    assert seen == [MARKER]


def test_eval_loss_reduces_on_the_groups_device_whatever_the_callers_sums_are_on(nccl_like):
    dp_cp, seen = nccl_like
    with pytest.raises(_Stop):
        cpkit.eval_cp.loop.reduce_eval_loss(torch.zeros((), dtype=torch.float64), torch.zeros(()),
                                         new_pg_collection(dp_cp=dp_cp))
    assert seen == [MARKER]


def test_a_gloo_group_takes_cpu_tensors_although_gloo_also_serves_cuda(world1):
    assert {d.type for d in world1._device_types} >= {"cpu"}
    assert group_device(world1) == torch.device("cpu")
    assert group_device(dist.new_group([0])) == torch.device("cpu")

"""The loss matrix's hook for a user's own loss function (CPKIT_LOSS_FUNC) and its default,
Megatron-LM's loss_func shape."""

import pytest
import torch

from cpkit.testing.scenarios.loss_matrix import LOSS_FUNC_ENV, loss_func_from_env, megatron_loss_func


def test_default_is_megatron_shaped(monkeypatch):
    monkeypatch.delenv(LOSS_FUNC_ENV, raising=False)
    assert loss_func_from_env() is megatron_loss_func
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    loss, count, reported = megatron_loss_func(mask, losses)
    assert loss.item() == 8.0 and count.item() == 3 and count.dtype == torch.int
    assert reported["lm loss"].tolist() == [8.0, 3.0]


def test_module_function_is_loaded(monkeypatch):
    monkeypatch.setenv(LOSS_FUNC_ENV, "cpkit.testing.scenarios.loss_matrix:megatron_loss_func")
    assert loss_func_from_env() is megatron_loss_func


@pytest.mark.parametrize("spec", ["no_colon", "cpkit.nope:f", "cpkit.testing.scenarios.loss_matrix:nope", ":f"])
def test_bad_values_name_the_variable(monkeypatch, spec):
    monkeypatch.setenv(LOSS_FUNC_ENV, spec)
    with pytest.raises(ValueError, match=LOSS_FUNC_ENV):
        loss_func_from_env()

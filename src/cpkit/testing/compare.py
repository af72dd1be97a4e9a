"""Comparisons of a CP run with its single-rank reference, shared by the functional tests."""

from __future__ import annotations

import torch

__all__ = ["assert_close_scaled", "assert_grads_close", "first_layer_name", "max_rel_diff"]


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float,
                        name: str) -> None:
    """assert_close of `actual` and `expected` divided by the reference's largest entry (floored at
    1e-6), so rtol/atol are fractions of the tensor's scale, not of each element (what bf16 allows).

    Raises AssertionError naming `name`.
    """
    scale = expected.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def assert_grads_close(got: dict, want: dict, *, rtol: float, atol: float, scaled: bool = True,
                       what: str = "gradient") -> None:
    """Every gradient of `got` (name -> full tensor) equals `want`'s of the same name: relative to the
    reference gradient's largest entry when `scaled` (bf16), element by element otherwise (fp32).

    Raises AssertionError when the names differ or a gradient is off, naming `what` and the parameter.
    """
    assert sorted(got) == sorted(want), f"{what}: parameter names differ: {sorted(set(got) ^ set(want))}"
    for name, g in got.items():
        label = f"{what} of {name}"
        if scaled:
            assert_close_scaled(g, want[name], rtol=rtol, atol=atol, name=label)
        else:
            torch.testing.assert_close(g, want[name], rtol=rtol, atol=atol, msg=lambda m, n=label: f"{n}: {m}")


def max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |a - ref| as a fraction of ref's largest entry (floored at 1e-12)."""
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def first_layer_name(names, suffix: str) -> str:
    """The one parameter name of the first transformer layer (`.layers.0.`) ending in `suffix`."""
    found = [n for n in names if n.endswith(suffix) and ".layers.0." in n]
    assert len(found) == 1, f"expected one first-layer {suffix}, found {found}"
    return found[0]

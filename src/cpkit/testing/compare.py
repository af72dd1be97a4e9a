"""Comparisons of a CP run with its single-rank reference, shared by the functional tests.

Tolerances per dtype:

| dtype | reference | bound on the CP run |
|---|---|---|
| fp32 (gloo, and correctness on CUDA) | the fp32 cp=1 run | rtol = atol = 1e-5 element by element (`assert_grads_close(scaled=False)`) |
| bf16 (CUDA) | the fp32 cp=1 run on the same (bf16-representable) weights, and the bf16 cp=1 run | per tensor, max abs(bf16 CP - fp32) <= BF16_ERROR_FACTOR x max abs(bf16 cp=1 - fp32) + BF16_FLOOR x max abs(fp32) (`assert_bf16_against_fp32`) |

Why bf16 is held to the fp32 reference by the bf16 reference's own error: two bf16 runs held to
each other (the earlier check: 2% of the largest entry) prove little, each can be 10-20% of the
largest entry off fp32 on a layer-norm gradient that sums about 1800 tokens with cancellation
(4x H100, functional/test_dynamic_pipeline.py pp2, decoder.layers.0.input_layernorm.weight:
measured 9.5% between the two bf16 runs, 20% between the bf16 reference and fp32). The bf16 CP
run sums the same terms in another order, so its error is of the size of the bf16 reference's:
BF16_ERROR_FACTOR = 2 allows for that, and BF16_FLOOR (one bf16 ulp at the tensor's scale, 2**-7)
for a tensor the bf16 reference happens to get exact. A missing or doubled factor in the CP path
moves whole tensors by 50-100%, far outside.
"""

from __future__ import annotations

import torch

__all__ = ["BF16_ERROR_FACTOR", "BF16_FLOOR", "assert_bf16_against_fp32", "assert_close_scaled",
           "assert_grads_close", "bf16_bound", "first_layer_name", "max_rel_diff"]

BF16_ERROR_FACTOR = 2.0
"""The bf16 CP run may be off fp32 by this many times the bf16 reference's own largest error."""
BF16_FLOOR = 2.0 ** -7
"""...plus this fraction of the fp32 reference's largest entry (one bf16 ulp at that scale)."""


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


def bf16_bound(ref_bf16: torch.Tensor, ref_fp32: torch.Tensor) -> float:
    """The largest abs(x - ref_fp32) a bf16 x may have: BF16_ERROR_FACTOR x the bf16 reference's
    largest error + BF16_FLOOR x the fp32 reference's largest entry (see the module docstring)."""
    ref_fp32 = ref_fp32.double()
    err = (ref_bf16.double() - ref_fp32).abs().max().item() if ref_fp32.numel() else 0.0
    scale = ref_fp32.abs().max().item() if ref_fp32.numel() else 0.0
    return BF16_ERROR_FACTOR * err + BF16_FLOOR * scale


def assert_bf16_against_fp32(got: dict, ref_fp32: dict, ref_bf16: dict, *, what: str = "gradient") -> None:
    """Every tensor of `got` (bf16 CP run; name -> tensor or float) within bf16_bound of the fp32
    reference, the bound taken from the bf16 reference of the same name. Raises AssertionError
    naming `what`, the entry, the error and the bound."""
    assert sorted(got) == sorted(ref_fp32) == sorted(ref_bf16), \
        f"{what}: names differ: {sorted(set(got) ^ set(ref_fp32) | set(got) ^ set(ref_bf16))}"
    for name, g in got.items():
        want, ref = torch.as_tensor(ref_fp32[name]), torch.as_tensor(ref_bf16[name])
        bound = bf16_bound(ref, want)
        err = (torch.as_tensor(g).double() - want.double()).abs().max().item()
        assert err <= bound, (f"{what} of {name}: bf16 CP run off the fp32 reference by {err:.3g}, more than "
                              f"{bound:.3g} ({BF16_ERROR_FACTOR:g} x the bf16 reference's "
                              f"{(ref.double() - want.double()).abs().max().item():.3g} + {BF16_FLOOR:g} x "
                              f"{want.abs().max().item():.3g})")

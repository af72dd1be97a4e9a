"""cpkit.testing.compare's bf16 check: a bf16 run against the fp32 reference, within the bf16
reference's own error (plus a floor); the fp32 check stays element-wise at 1e-5."""

import pytest
import torch

from cpkit.testing.compare import BF16_FLOOR, assert_bf16_against_fp32, assert_grads_close, bf16_bound


def _sums(n=1800, seed=0):
    """A layer-norm-like gradient entry: the sum of n terms with cancellation, fp32 vs bf16 terms
    summed in two orders (the cp=1 reference's and a CP run's)."""
    gen = torch.Generator().manual_seed(seed)
    terms = torch.randn(n, 8, generator=gen) * 0.05
    fp32 = terms.sum(0)
    bf = terms.to(torch.bfloat16)
    ref_bf16 = bf.float().cumsum(0).to(torch.bfloat16)[-1].float()  # rounded as it accumulates
    perm = torch.randperm(n, generator=gen)
    cp_bf16 = bf[perm].float().cumsum(0).to(torch.bfloat16)[-1].float()
    return fp32, ref_bf16, cp_bf16


def test_a_bf16_run_passes_within_the_bf16_references_own_error():
    fp32, ref, cp = _sums()
    assert_bf16_against_fp32({"g": cp}, {"g": fp32}, {"g": ref})


def test_a_missing_factor_fails():
    fp32, ref, cp = _sums()
    with pytest.raises(AssertionError, match="bf16 CP run off the fp32 reference"):
        assert_bf16_against_fp32({"g": cp * 0.5}, {"g": fp32}, {"g": ref})


def test_an_exact_bf16_reference_still_allows_one_ulp():
    fp32 = torch.tensor([1.0, -2.0, 0.5])
    assert bf16_bound(fp32.clone(), fp32) == pytest.approx(BF16_FLOOR * 2.0)
    assert_bf16_against_fp32({"g": fp32 + 0.01}, {"g": fp32}, {"g": fp32.clone()})
    with pytest.raises(AssertionError):
        assert_bf16_against_fp32({"g": fp32 + 0.05}, {"g": fp32}, {"g": fp32.clone()})


def test_fp32_stays_strict_element_by_element():
    want = {"g": torch.tensor([1.0, 1e-3])}
    with pytest.raises(AssertionError):
        assert_grads_close({"g": torch.tensor([1.0, 1.2e-3])}, want, rtol=1e-5, atol=1e-5, scaled=False)

"""MCore's own torch-native gated delta rule (`torch_chunk_gated_delta_rule`, the kernel of its
deterministic mode) against cpkit's float64 token-by-token reference
(src/cpkit/testing/recurrent_reference.py, which shares no code with either chunked form).

Run on: the installed megatron-core (megatron/core/ssm/gated_delta_net.py) in this process, and
Megatron-LM dev's (megatron/core/ssm/gated_delta_net/gdn.py, from CPKIT_MLM_SRC) in a fresh
process (its modules cannot share a process with the installed ones). Compared: the output, the
final state and the gradients of q, k, v, beta, g (and of the initial state when given), with
and without an initial state, lengths that fill the chunks (32 at chunk 16) and that do not (23).

Its argument order is (q, k, v, g, beta) with [B, T, H, D] and g, beta [B, T, H]; it computes in
float32 whatever the input (its output comes back in the input's dtype, its state in float32).
q and k are L2-normalized before the call (what MCore's GatedDeltaNet does in deterministic mode,
use_qk_l2norm_in_kernel=False); the in-kernel normalization is fla's l2norm (a test below).

Tolerance: float32 computation against float64, atol = rtol = 1e-5 (about 100 float32 ulps; the
measured error is about 1e-7).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from cpkit.testing.mlm_hybrid import gdn_skip_reason, mlm_commit
from cpkit.testing.recurrent_reference import gated_delta_rule_reference

TOL = dict(atol=1e-5, rtol=1e-5)
CASES = [(32, False), (32, True), (23, False), (23, True)]  # (length, with an initial state)
IDS = [f"T{t}-{'state' if s else 'zero'}" for t, s in CASES]
HAVE_FLA = importlib.util.find_spec("fla") is not None
needs_dev = pytest.mark.skipif(gdn_skip_reason(need_fla=False) is not None,
                               reason=gdn_skip_reason(need_fla=False) or "")


def _inputs(length: int, with_state: bool, batch: int = 2, heads: int = 2, dk: int = 4, dv: int = 3):
    gen = torch.Generator().manual_seed(17 + length)
    q = F.normalize(torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(batch, length, heads, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, length, heads, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(batch, length, heads, generator=gen, dtype=torch.float64))
    state = torch.randn(batch, heads, dk, dv, generator=gen, dtype=torch.float64) if with_state else None
    w_o = torch.randn(batch, length, heads, dv, generator=gen, dtype=torch.float64)
    w_s = torch.randn(batch, heads, dk, dv, generator=gen, dtype=torch.float64)
    return (q, k, v, beta, g, state), (w_o, w_s)


def compare(rule, length: int, with_state: bool) -> dict[str, float]:
    """{quantity: max abs error beyond TOL's rtol part, 0 when within} of `rule` against the reference."""
    tensors, (w_o, w_s) = _inputs(length, with_state)
    names = ["q", "k", "v", "beta", "g"] + (["initial_state"] if with_state else [])
    got, want = {}, {}
    for side, out in (("got", got), ("want", want)):
        leaves = [t.clone().requires_grad_(True) if t is not None else None for t in tensors]
        q, k, v, beta, g, state = leaves
        if side == "got":
            o, s = rule(q, k, v, g, beta, chunk_size=16, initial_state=state, output_final_state=True)
        else:  # one sequence per call: the batch is a loop
            pairs = [gated_delta_rule_reference(q[b], k[b], v[b], beta[b], g[b],
                                                initial_state=None if state is None else state[b])
                     for b in range(q.shape[0])]
            o, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        ((o.double() * w_o).sum() + (s.double() * w_s).sum()).backward()
        out.update(output=o.detach().double(), final_state=s.detach().double())
        out.update({f"d{n}": leaf.grad for n, leaf in zip(names, [x for x in leaves if x is not None])})
    return {name: float(((got[name] - want[name]).abs() - TOL["rtol"] * want[name].abs()).clamp(min=0).max())
            for name in want}


def _installed_rule():
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule


def _bad(errors: dict[str, float]) -> dict[str, float]:
    return {name: err for name, err in errors.items() if err > TOL["atol"]}


@pytest.mark.parametrize("length,with_state", CASES, ids=IDS)
def test_installed_mcore_torch_chunk_rule_equals_the_float64_reference(length, with_state):
    assert _bad(compare(_installed_rule(), length, with_state)) == {}


def _dev_case(cases) -> dict:
    from cpkit.testing.mlm_hybrid import load_mlm_modules

    gdn = load_mlm_modules(["megatron.core.ssm.gated_delta_net.gdn"])["megatron.core.ssm.gated_delta_net.gdn"]
    return {f"{length}-{with_state}": compare(gdn.torch_chunk_gated_delta_rule, length, with_state)
            for length, with_state in cases}


@functools.lru_cache(maxsize=1)
def _dev_errors() -> dict:
    from cpkit.testing import launch

    return launch(_dev_case, 1, backend="gloo", timeout=300, args=(CASES,))[0]


@needs_dev
@pytest.mark.parametrize("length,with_state", CASES, ids=IDS)
def test_dev_torch_chunk_rule_equals_the_float64_reference(length, with_state):
    errors = _dev_errors()[f"{length}-{with_state}"]
    assert _bad(errors) == {}, f"Megatron-LM {mlm_commit()}: {errors}"


def test_the_comparison_sees_a_wrong_rule():
    """A rule that drops the decay of the last token of each chunk fails the comparison."""
    rule = _installed_rule()

    def planted(q, k, v, g, beta, **kw):
        g = g.clone()
        g[:, 15::16] = 0.0
        return rule(q, k, v, g, beta, **kw)

    bad = _bad(compare(planted, 32, True))
    assert {"output", "final_state", "dg"} <= set(bad), bad


def _l2norm_in_kernel(rule) -> None:
    tensors, _ = _inputs(4, False, batch=1)
    q, k, v, beta, g, _ = tensors
    rule(q, k, v, g, beta, chunk_size=16, use_qk_l2norm_in_kernel=True)


def _dev_l2norm_case() -> dict | None:
    from cpkit.testing.mlm_hybrid import load_mlm_modules

    gdn = load_mlm_modules(["megatron.core.ssm.gated_delta_net.gdn"])["megatron.core.ssm.gated_delta_net.gdn"]
    try:
        _l2norm_in_kernel(gdn.torch_chunk_gated_delta_rule)
    except Exception as err:  # noqa: BLE001 - reported to the test, which re-raises it
        return {"type": type(err).__name__, "message": str(err)}
    return None


NO_FLA = "checks the torch-native path without fla (with fla, l2norm is fla's Triton kernel: GPU only)"


@pytest.mark.skipif(HAVE_FLA, reason=NO_FLA)
@pytest.mark.xfail(strict=True, raises=NameError, reason=(
    "megatron/core/ssm/gated_delta_net.py::torch_chunk_gated_delta_rule (megatron-core 0.16.1): the "
    "torch-native rule with use_qk_l2norm_in_kernel=True calls fla's l2norm, unbound without fla: smallest "
    "counterexample B=1, T=4, H=2, K=4 raises NameError \"name 'l2norm' is not defined\""))
def test_installed_torch_rule_normalizes_in_kernel_without_fla():
    _l2norm_in_kernel(_installed_rule())


@needs_dev
@pytest.mark.skipif(HAVE_FLA, reason=NO_FLA)
@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "megatron/core/ssm/gated_delta_net/gdn.py::torch_chunk_gated_delta_rule (Megatron-LM dev d48bd6be0a85): "
    "use_qk_l2norm_in_kernel=True calls common.l2norm, None without fla: smallest counterexample B=1, T=4, "
    "H=2, K=4 raises TypeError \"'NoneType' object is not callable\""))
def test_dev_torch_rule_normalizes_in_kernel_without_fla():
    from cpkit.testing import launch

    found = launch(_dev_l2norm_case, 1, backend="gloo", timeout=300)[0]
    if found:
        if found["type"] != "TypeError":
            pytest.fail(f"dev's rule failed otherwise: {found}")
        raise TypeError(found["message"])

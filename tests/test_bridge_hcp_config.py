"""Megatron-Bridge's hierarchical-CP configuration checks beside `CPLayout.validate` (what
`cpkit layout check` runs), on the configurations of `cpkit.testing.bridge_hcp.CONFIGS`.

Bridge's checks run from the checkout named by CPKIT_BRIDGE_SRC (loaded by file path:
`cpkit.upstream.bridge`); without it those tests skip with the reason, and cpkit's side still
runs. Where the two disagree:
- Bridge accepts a configuration that cannot train correctly: a strict xfail naming Bridge's
  check, next to the passing test of cpkit refusing the same configuration;
- the two differ by design (Bridge's decentralized path has no hierarchical groups; cpkit refuses
  sizes that no layer uses): a plain test asserting both verdicts.

See the table with:
    CPKIT_BRIDGE_SRC=<Megatron-Bridge>/src python -m cpkit.testing.bridge_hcp
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkit.parallel.layout import CP_COMM_TYPES
from cpkit.testing.bridge_hcp import (
    BRIDGE_CONFIG_CHECK,
    BRIDGE_DECENTRALIZED_CHECK,
    BRIDGE_FINALIZE,
    CONFIGS,
    BridgeHCPConfig,
    bridge_modules,
    bridge_verdict,
    cpkit_verdict,
)

BY_ID = {c.id: c for c in CONFIGS}

# Both accept.
AGREE_ACCEPT = ("a2a+p2p-[2,2]", "a2a+p2p-[4,1]", "a2a+p2p-[1,4]", "per-layer-list", "decentralized-a2a")
# Both refuse; the Bridge check that refuses.
AGREE_REFUSE = {
    "a2a+p2p-no-sizes": BRIDGE_CONFIG_CHECK,
    "product-mismatch": BRIDGE_CONFIG_CHECK,
    "per-layer-list-length": BRIDGE_FINALIZE,  # MCore's TransformerConfig.__post_init__
}
# Bridge accepts, cpkit refuses, and Bridge is wrong: config id -> (why, the fields cpkit names).
BRIDGE_ACCEPTS_WRONGLY = {
    "kv-heads-not-divisible": (
        "no check that the KV heads per TP rank divide over the a2a level; the all-to-all fails at "
        "the first attention call, after the job has launched",
        ["num_attention_heads", "num_query_groups"]),
    "a2a-kv-heads-not-divisible": (
        "no check that the KV heads per TP rank divide over cp for a2a; the all-to-all fails at "
        "the first attention call", ["num_attention_heads", "num_query_groups"]),
    "three-levels": (
        "only the product of the sizes is checked; a2a+p2p has two levels (a2a, p2p), so a third "
        "level of size 2 is CP ranks that never exchange keys and values with each other",
        ["hierarchical_context_parallel_sizes"]),
    "negative-sizes": (
        "only the product of the sizes is checked, so [-1, -2] passes at cp=2",
        ["hierarchical_context_parallel_sizes"]),
    "misspelled-comm-type": (
        "cp_comm_type is only checked to be a str; 'a2a_p2p' fails at the first attention call",
        ["cp_comm_type"]),
    "per-layer-list-misspelled": (
        "the entries of a per-layer cp_comm_type list are not checked; 'ring' fails at the first "
        "attention call", ["cp_comm_type"]),
}


@pytest.fixture(scope="module")
def bridge():
    try:
        return bridge_modules()
    except ImportError as err:
        pytest.skip(str(err))


def test_the_table_is_classified_whole():
    """Every configuration has an expectation here (a new one gets a verdict on both sides)."""
    classified = (set(AGREE_ACCEPT) | set(AGREE_REFUSE) | set(BRIDGE_ACCEPTS_WRONGLY)
                  | {"sizes-without-a2a+p2p", "decentralized-with-sizes"})
    assert classified == set(BY_ID)


# ---------------------------------------------------------------------------------------------
# Where the two agree


@pytest.mark.parametrize("config_id", AGREE_ACCEPT)
def test_cpkit_accepts(config_id):
    assert cpkit_verdict(BY_ID[config_id]).accepted


@pytest.mark.parametrize("config_id", AGREE_ACCEPT)
def test_bridge_accepts(bridge, config_id):
    verdict = bridge_verdict(BY_ID[config_id], bridge)
    assert verdict.accepted, verdict


@pytest.mark.parametrize("config_id", sorted(AGREE_REFUSE))
def test_cpkit_refuses(config_id):
    verdict = cpkit_verdict(BY_ID[config_id])
    assert not verdict.accepted
    assert verdict.fields, verdict


@pytest.mark.parametrize("config_id", sorted(AGREE_REFUSE))
def test_bridge_refuses(bridge, config_id):
    verdict = bridge_verdict(BY_ID[config_id], bridge)
    assert (verdict.accepted, verdict.stage) == (False, AGREE_REFUSE[config_id]), verdict


def test_bridge_refuses_a2a_p2p_without_sizes_with_the_silent_mode_named(bridge):
    """The pitfall Bridge's card names (CP silently local) is refused, saying so."""
    verdict = bridge_verdict(BY_ID["a2a+p2p-no-sizes"], bridge)
    assert "hierarchical_context_parallel_sizes must be set" in verdict.error
    assert "silently disabled" in verdict.error


# ---------------------------------------------------------------------------------------------
# Bridge accepts what cannot train correctly; cpkit refuses it


@pytest.mark.parametrize("config_id", sorted(BRIDGE_ACCEPTS_WRONGLY))
def test_cpkit_refuses_what_bridge_accepts(config_id):
    """cpkit's side of each strict xfail below: refused, naming the fields, before any group."""
    verdict = cpkit_verdict(BY_ID[config_id])
    assert not verdict.accepted
    assert verdict.fields == BRIDGE_ACCEPTS_WRONGLY[config_id][1], verdict


@pytest.mark.parametrize("config_id", [
    pytest.param(config_id, marks=pytest.mark.xfail(
        strict=True, raises=AssertionError, reason=f"{BRIDGE_CONFIG_CHECK}: {why}"))
    for config_id, (why, _) in sorted(BRIDGE_ACCEPTS_WRONGLY.items())
])
def test_bridge_refuses_a_config_that_cannot_train(bridge, config_id):
    """Each config is the smallest of its kind (cp 1 or 2, one head, one misspelled entry)."""
    verdict = bridge_verdict(BY_ID[config_id], bridge)
    assert not verdict.accepted, f"Bridge accepts {BY_ID[config_id]}"


# ---------------------------------------------------------------------------------------------
# Different by design


def test_sizes_without_a2a_p2p_bridge_accepts_cpkit_refuses(bridge):
    """Sizes with cp_comm_type "p2p": Bridge accepts (MCore builds hierarchical groups that no
    layer uses; training is correct, but HCP is not active, Bridge's pitfall "only
    CONTEXT_PARALLEL_GROUP in the logs"); cpkit refuses, so the belief that HCP is on fails early."""
    config = BY_ID["sizes-without-a2a+p2p"]
    assert bridge_verdict(config, bridge).accepted
    verdict = cpkit_verdict(config)
    assert (verdict.accepted, verdict.fields) == (False, ["hierarchical_context_parallel_sizes"])


def test_decentralized_path_with_sizes_is_refused_with_bridges_message(bridge):
    """Bridge's card, follow-up 2: use_decentralized_pg=True with hierarchical sizes is refused by
    _create_pg_collection's first statement, before any process group (none exists here), and
    the message says what to do instead."""
    verdict = bridge_verdict(BY_ID["decentralized-with-sizes"], bridge)
    assert (verdict.accepted, verdict.stage) == (False, BRIDGE_DECENTRALIZED_CHECK)
    assert verdict.error.startswith("NotImplementedError: Decentralized process groups "
                                    "(use_decentralized_pg=True) do not support hierarchical_context_parallel_sizes")
    assert "use_decentralized_pg=False to use the MPU path which supports 'a2a+p2p'" in verdict.error


def test_decentralized_path_with_sizes_is_a_cpkit_layout():
    """cpkit's decentralized groups (cpkit.parallel.groups.build_pg_collection) carry hcp, so the same
    configuration is a valid cpkit layout (functional/test_hierarchical.py trains it)."""
    assert cpkit_verdict(BY_ID["decentralized-with-sizes"]).accepted


def test_the_table_command_prints_every_config(bridge, capsys):
    from cpkit.testing.bridge_hcp import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert bridge.commit in out
    assert all(c.id in out for c in CONFIGS)


# ---------------------------------------------------------------------------------------------
# Over generated configurations (MPU path): cpkit is the stricter check, never the looser one

PROPERTY = settings(max_examples=150, derandomize=True, deadline=None, database=None)


@st.composite
def hcp_configs(draw):
    """Small Bridge configurations with CP on (at cp=1 the comm settings are inert): cp 2 to 8,
    a comm type (or a per-layer pair, or a misspelling), sizes of 1 to 3 levels from -1 to 8 (or
    none), heads with KV heads dividing them."""
    comm = st.sampled_from(CP_COMM_TYPES + ("a2a_p2p",))
    cp = draw(st.sampled_from([2, 4, 8]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    return BridgeHCPConfig(
        id="generated", context_parallel_size=cp,
        cp_comm_type=draw(st.one_of(comm, st.lists(comm, min_size=2, max_size=2))),
        hierarchical_context_parallel_sizes=draw(st.one_of(
            st.none(), st.lists(st.integers(-1, 8), min_size=1, max_size=3))),
        num_attention_heads=heads, num_query_groups=kv, seq_length=16 * cp)


@PROPERTY
@given(config=hcp_configs())
def test_what_cpkit_accepts_bridge_accepts(bridge, config):
    """cpkit refuses nothing on the MPU path that Bridge would train: its extra rules only refuse."""
    if cpkit_verdict(config).accepted:
        assert bridge_verdict(config, bridge).accepted, config


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason=f"{BRIDGE_CONFIG_CHECK}: accepts configurations that cannot train (see the table above)")
@PROPERTY
@given(config=hcp_configs())
def test_what_bridge_accepts_cpkit_accepts(bridge, config):
    """Hypothesis finds a configuration Bridge accepts and cpkit refuses; it shrinks to
    "a2a-kv-heads-not-divisible" of the table (cp=2, a2a, one KV head), whose neighbours there
    are the smallest cases of the other kinds (BRIDGE_ACCEPTS_WRONGLY)."""
    if bridge_verdict(config, bridge).accepted:
        assert cpkit_verdict(config).accepted, config


def test_no_bridge_or_mcore_code_logs_the_line_bridges_skill_looks_for(bridge):
    """Bridge's skill says to verify HCP by HIERARCHICAL_CONTEXT_PARALLEL_GROUPS in the logs; the
    name occurs in no Bridge file and in MCore only as parallel_state's private global
    (_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS), which nothing prints. cpkit.parallel.groups.log_groups logs it
    (functional/test_bridge_hcp.py checks the example's line)."""
    import re

    import megatron.core

    name = re.compile(r"(?<![\w])HIERARCHICAL_CONTEXT_PARALLEL_GROUPS")
    roots = [bridge.src / "megatron" / "bridge", Path(megatron.core.__file__).parent]
    found = [str(p) for root in roots for p in root.rglob("*.py") if name.search(p.read_text(errors="replace"))]
    assert found == []


@pytest.mark.parametrize("config_id", sorted(BY_ID))
def test_cpkit_layout_check_gives_the_same_verdict(config_id, capsys):
    """`cpkit layout check` on each configuration exits 0 exactly where CPLayout.validate accepts."""
    from cpkit.cli import main

    config = BY_ID[config_id]
    code = main(config.layout_check_args())
    capsys.readouterr()
    assert (code == 0) == cpkit_verdict(config).accepted, (code, config.layout_check_args())

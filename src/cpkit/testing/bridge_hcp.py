"""Megatron-Bridge's hierarchical-CP configuration checks beside cpkit's, on the same configs.

Bridge's checks, run from its checkout (`cpkit.upstream.bridge`), in the order a Bridge run
meets them:
1. `megatron/bridge/models/transformer_config.py::TransformerConfig.finalize` (runs MCore's
   `TransformerConfig.__post_init__`);
2. `megatron/bridge/training/config.py::ConfigContainer._validate_cp_comm_type` (called from
   `ConfigContainer.validate`);
3. with `dist.use_decentralized_pg=True`:
   `megatron/bridge/training/initialize.py::_create_pg_collection`, whose first statement refuses
   `hierarchical_context_parallel_sizes` (before any group is created).

cpkit's check is `CPLayout.validate` (what `cpkit layout check` runs). `python -m
cpkit.testing.bridge_hcp` prints the two verdicts side by side for `CONFIGS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from cpkit.upstream.bridge import DistInit, bridge_model_config, bridge_modules
from cpkit.errors import CPConfigError
from cpkit.parallel.layout import CPLayout

__all__ = [
    "BRIDGE_CONFIG_CHECK",
    "BRIDGE_DECENTRALIZED_CHECK",
    "BRIDGE_FINALIZE",
    "BridgeHCPConfig",
    "DistInit",
    "bridge_model_config",
    "CONFIGS",
    "Verdict",
    "bridge_modules",
    "bridge_verdict",
    "cpkit_verdict",
    "main",
]

BRIDGE_FINALIZE = "megatron/bridge/models/transformer_config.py::TransformerConfig.finalize"
BRIDGE_CONFIG_CHECK = "megatron/bridge/training/config.py::ConfigContainer._validate_cp_comm_type"
BRIDGE_DECENTRALIZED_CHECK = "megatron/bridge/training/initialize.py::_create_pg_collection"


@dataclass(frozen=True)
class BridgeHCPConfig:
    """One configuration in Bridge's terms (cfg.model.*, cfg.dist.use_decentralized_pg)."""

    id: str
    context_parallel_size: int
    cp_comm_type: Union[str, list, None]
    hierarchical_context_parallel_sizes: Optional[list] = None
    num_attention_heads: int = 8
    num_query_groups: int = 4
    num_layers: int = 2
    seq_length: int = 64
    use_decentralized_pg: bool = False
    note: str = ""
    """Why the config is in the table (one line)."""

    def model_kwargs(self) -> dict:
        """Bridge/MCore TransformerConfig keyword arguments (hidden size 64, tp = pp = 1)."""
        return dict(num_layers=self.num_layers, hidden_size=64, num_attention_heads=self.num_attention_heads,
                    num_query_groups=self.num_query_groups, context_parallel_size=self.context_parallel_size,
                    cp_comm_type=self.cp_comm_type,
                    hierarchical_context_parallel_sizes=self.hierarchical_context_parallel_sizes)

    def layout(self) -> CPLayout:
        """The same configuration as a cpkit layout (world size = cp)."""
        return CPLayout(world_size=self.context_parallel_size, cp=self.context_parallel_size,
                        cp_comm_type=self.cp_comm_type if self.cp_comm_type is not None else "p2p",
                        hierarchical_context_parallel_sizes=self.hierarchical_context_parallel_sizes,
                        seq_length=self.seq_length, num_layers=self.num_layers,
                        num_attention_heads=self.num_attention_heads, num_query_groups=self.num_query_groups)

    def layout_check_args(self) -> list[str]:
        """The same configuration as `cpkit layout check` arguments."""
        comm = self.cp_comm_type if isinstance(self.cp_comm_type, str) else ",".join(self.cp_comm_type)
        args = ["layout", "check", "--world-size", str(self.context_parallel_size),
                "--cp", str(self.context_parallel_size), "--cp-comm-type", comm,
                "--seq-length", str(self.seq_length), "--num-layers", str(self.num_layers),
                "--num-heads", str(self.num_attention_heads), "--num-kv-heads", str(self.num_query_groups)]
        if self.hierarchical_context_parallel_sizes is not None:
            sizes = ",".join(str(v) for v in self.hierarchical_context_parallel_sizes)
            args.append(f"--hierarchical-cp-sizes={sizes}")  # '=' keeps a leading '-' a value
        return args


CONFIGS: tuple[BridgeHCPConfig, ...] = (
    BridgeHCPConfig("a2a+p2p-[2,2]", 4, "a2a+p2p", [2, 2], note="the recommended path of Bridge's card"),
    BridgeHCPConfig("a2a+p2p-[4,1]", 4, "a2a+p2p", [4, 1], note="a2a level over the whole CP group"),
    BridgeHCPConfig("a2a+p2p-[1,4]", 4, "a2a+p2p", [1, 4], note="p2p level over the whole CP group"),
    BridgeHCPConfig("a2a+p2p-no-sizes", 4, "a2a+p2p", None, note="older stacks silently skipped CP"),
    BridgeHCPConfig("product-mismatch", 4, "a2a+p2p", [2, 4], note="prod(sizes) != cp"),
    BridgeHCPConfig("kv-heads-not-divisible", 2, "a2a+p2p", [2, 1], num_attention_heads=1, num_query_groups=1,
                    note="a2a scatters heads: 1 KV head over an a2a level of 2"),
    BridgeHCPConfig("a2a-kv-heads-not-divisible", 2, "a2a", None, num_attention_heads=1, num_query_groups=1,
                    note="plain a2a: 1 KV head over cp=2"),
    BridgeHCPConfig("three-levels", 2, "a2a+p2p", [1, 1, 2],
                    note="a2a+p2p uses two levels; the third (size 2) gets no communication"),
    BridgeHCPConfig("negative-sizes", 2, "a2a+p2p", [-1, -2], note="product 2 == cp, sizes not >= 1"),
    BridgeHCPConfig("misspelled-comm-type", 2, "a2a_p2p", None, note="not a CP comm type MCore or TE know"),
    BridgeHCPConfig("sizes-without-a2a+p2p", 4, "p2p", [2, 2],
                    note="sizes no layer uses: HCP believed on, not active"),
    BridgeHCPConfig("per-layer-list", 4, ["a2a+p2p", "p2p"], [2, 2], note="one comm type per layer"),
    BridgeHCPConfig("per-layer-list-length", 4, ["a2a+p2p", "p2p", "p2p"], [2, 2],
                    note="3 entries for 2 layers"),
    BridgeHCPConfig("per-layer-list-misspelled", 2, ["p2p", "ring"], None,
                    note="a per-layer entry that is not a comm type"),
    BridgeHCPConfig("decentralized-with-sizes", 4, "a2a+p2p", [2, 2], use_decentralized_pg=True,
                    note="Bridge's decentralized process groups have no hcp"),
    BridgeHCPConfig("decentralized-a2a", 4, "a2a", None, use_decentralized_pg=True,
                    note="flat CP on the decentralized path"),
)
"""The table: good and bad hierarchical-CP configurations, the bad ones as small as they go with
CP on (cp >= 2)."""


@dataclass
class Verdict:
    """What one checker said about one configuration."""

    accepted: bool
    stage: str = ""
    """Where it was refused (the check's symbol), empty when accepted."""
    error: str = ""
    """The exception type and its first line, empty when accepted."""
    fields: list = field(default_factory=list)
    """For cpkit: the fields its violations name."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def bridge_verdict(cfg: BridgeHCPConfig, bridge: types.SimpleNamespace) -> Verdict:
    """Run Bridge's checks (module docstring) on `cfg`; the first that raises refuses it."""
    model = bridge.TransformerConfig(**cfg.model_kwargs())
    stages = [
        (BRIDGE_FINALIZE, model.finalize),
        (BRIDGE_CONFIG_CHECK, lambda: bridge.validate_cp_comm_type(types.SimpleNamespace(model=model))),
    ]
    if cfg.use_decentralized_pg and cfg.hierarchical_context_parallel_sizes is not None:
        # Its first statement refuses the sizes; without them it would go on to build groups.
        stages.append((BRIDGE_DECENTRALIZED_CHECK,
                       lambda: bridge.create_pg_collection(model, 1, world_size=cfg.context_parallel_size)))
    for stage, run in stages:
        try:
            run()
        except Exception as err:  # noqa: BLE001 - Bridge refuses with assert, TypeError, ...
            return Verdict(False, stage, _first_line(err))
    return Verdict(True)


def cpkit_verdict(cfg: BridgeHCPConfig) -> Verdict:
    """CPLayout.validate on the same configuration (what `cpkit layout check` runs)."""
    try:
        cfg.layout().validate()
    except CPConfigError as err:
        return Verdict(False, "src/cpkit/parallel/layout.py::CPLayout.validate", _first_line(err),
                       sorted({v.field for v in err.violations}))
    return Verdict(True)


def _table(rows: list[dict]) -> str:
    head = ("config", "Bridge", "cpkit", "note")
    cells = [(r["id"], _cell(r["bridge"]), _cell(r["cpkit"]), r["note"]) for r in rows]
    widths = [max(len(str(c[i])) for c in cells + [head]) for i in range(4)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(verdict: dict) -> str:
    if verdict["accepted"]:
        return "accepts"
    where = verdict["stage"].split("::")[-1]
    return f"refuses ({where}: {verdict['error'].split(':')[0]})"


def main(argv: Optional[list[str]] = None) -> int:
    """Print Bridge's and cpkit's verdicts on CONFIGS side by side (`--json` for the records)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m cpkit.testing.bridge_hcp", description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    args = parser.parse_args(argv)
    try:
        bridge = bridge_modules()
    except ImportError as err:
        print(f"skipped: {err}", file=sys.stderr)
        return 0
    rows = [dict(id=c.id, note=c.note, bridge=asdict(bridge_verdict(c, bridge)), cpkit=asdict(cpkit_verdict(c)))
            for c in CONFIGS]
    if args.json:
        print(json.dumps(dict(bridge_commit=bridge.commit, rows=rows), indent=1))
    else:
        print(f"Megatron-Bridge {bridge.commit} at {bridge.src}\n")
        print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

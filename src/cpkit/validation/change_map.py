"""Which tests cover which code: the one map from changed paths to the unit and functional test
files that `cpkit validate --changed` runs, and the table the validating skill shows (generated
from this map, checked by `cpkit skills check`).

A row's `changed` entries are repository paths: a file, a folder ending in `/` (everything under
it) or a glob; where several rows name a path, the most specific wins. A path that no row names
selects only the text check when it is documentation or evidence, its own file when it is a
test, and every test when it is code or configuration (an unmapped module could be imported by
anything): add a row for a new module. Any change also selects the text check (ALWAYS), any
module change the import-graph check (ANY_MODULE).

A changed module also selects every test file that imports it, directly or through the cpkit
modules it imports (`src/cpkit/validation/import_graph.py::importing_tests`, read with `ast`), so a row
cannot miss a test that reaches the module; rows add what imports do not show (the tests a
scenario or a command runs). For a core module (layout, sharding) that is most of the suite:
they are what most tests run. That is `cpkit validate --changed --wide`.

The default, narrow selection (`select_tests(..., narrow=True)`) takes for a changed module the
tests that use one of its changed functions or classes, directly or through its own package and
the functional scenarios (`src/cpkit/validation/symbol_graph.py::affected_tests`), plus the row's tests
that imports do not show; tests that reach the change only through other features' modules
(a model builder, the dynamic runtime) are left to --wide.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from cpkit.validation.import_graph import importing_tests
from cpkit.validation.symbol_graph import MODULE, affected_tests, symbols_at_lines

__all__ = [
    "Row",
    "CHANGE_MAP",
    "ALWAYS",
    "ANY_MODULE",
    "EVERYTHING",
    "DOC_PATHS",
    "Selection",
    "select_tests",
    "matches",
    "skill_table",
    "SKILL_TABLE_BEGIN",
    "SKILL_TABLE_END",
    "UPSTREAM_LOOKUPS",
    "needs_upstream",
]

#: Stands for "all of tests/ and functional/" in a row.
EVERYTHING = ("tests/", "functional/")


@dataclass(frozen=True)
class Row:
    """Changed paths and the test files that cover them; `kinds` says which markers matter."""

    changed: tuple[str, ...]
    unit: tuple[str, ...]
    functional: tuple[str, ...]
    kinds: str


CHANGE_MAP: tuple[Row, ...] = (
    Row(("src/cpkit/parallel/__init__.py", "src/cpkit/parallel/layout.py", "src/cpkit/parallel/rank_grid.py", "src/cpkit/hierarchical/layout_fixes.py", "src/cpkit/hierarchical/head_rules.py"),
        ("tests/test_layout.py", "tests/test_layout_cli.py", "tests/test_layout_fixes.py", "tests/test_groups.py"),
        ("functional/test_groups.py",), "unit, dist"),
    Row(("src/cpkit/hierarchical/__init__.py", "src/cpkit/hierarchical/topology.py"), ("tests/test_topology.py", "tests/test_layout_cli.py"), ("functional/test_cluster.py",),
        "unit, dist"),
    Row(("src/cpkit/cluster/",), ("tests/test_cluster_runner.py", "tests/test_skills.py"), ("functional/test_cluster.py",),
        "unit, dist; on a cluster, README 'On a cluster'"),
    Row(("src/cpkit/parallel/groups.py", "src/cpkit/parallel/group_info.py", "src/cpkit/testing/groups.py"),
        ("tests/test_groups.py", "tests/test_collective_devices.py"),
        ("functional/test_groups.py", "functional/test_hierarchical.py", "functional/test_eval_cp.py"),
        "unit, dist, gpu4"),
    Row(("src/cpkit/sharding.py",), ("tests/test_sharding.py", "tests/test_attention_unit.py"),
        ("functional/test_attention_module.py", "functional/test_attention.py", "functional/test_gpt.py",
         "functional/test_device.py"), "unit, dist, gpu1, gpu2"),
    Row(("src/cpkit/attention/",),
        ("tests/test_attention_module.py", "tests/test_attention_unit.py", "tests/test_attention_features.py",
         "tests/test_band.py", "tests/test_flex_band.py", "tests/test_ring_threads.py", "tests/test_cudnn_fe.py"),
        ("functional/test_attention_module.py", "functional/test_attention.py", "functional/test_attention_features.py",
         "functional/test_hierarchical.py", "functional/test_gpt.py", "functional/test_gpt_features.py",
         "functional/test_te_backend.py", "functional/test_te_backend_window.py", "functional/test_device.py",
         "functional/test_kernels_gpu.py", "functional/test_kernel_conformance.py"),
        "unit, dist, gpu1, gpu2, gpu4; for a2a and a2a+p2p also "
        "`functional/test_attention.py::test_a2a_head_chunks_match_full_attention`, "
        "`functional/test_hierarchical.py::test_hierarchical_gpt_trains_like_cp1` and "
        "`functional/test_te_backend.py::test_te_hierarchical_cp`"),
    Row(("src/cpkit/eval_cp/__init__.py", "src/cpkit/eval_cp/context.py", "src/cpkit/eval_cp/rebind.py", "src/cpkit/eval_cp/loop.py", "src/cpkit/eval_cp/plan.py",
         "src/cpkit/testing/eval_cp_impls.py", "src/cpkit/commands/plan.py"),
        ("tests/test_eval_cp.py", "tests/test_eval_cp_protocol.py", "tests/test_eval_plan.py"),
        ("functional/test_eval_cp.py",), "unit, dist, gpu2, gpu4"),
    Row(("src/cpkit/hybrid/", "src/cpkit/testing/recurrent_reference.py"),
        ("tests/test_hybrid_layout.py", "tests/test_hybrid_delta_rule.py", "tests/test_hybrid_ssd.py",
         "tests/test_hybrid_mamba.py"),
        ("functional/test_hybrid_layout.py", "functional/test_hybrid_gdn.py", "functional/test_hybrid_mamba.py",
         "functional/test_hybrid_model.py", "functional/test_hybrid_fla.py"),
        "unit, dist, gpu2, gpu4"),
    Row(("src/cpkit/hybrid/", "src/cpkit/testing/mlm_hybrid.py", "src/cpkit/testing/recurrent_reference.py"),
        ("tests/test_mcore_gdn_reference.py",),
        ("functional/test_mlm_hybrid_layout.py", "functional/test_mlm_gdn_cp.py"),
        "unit, dist, gpu2, gpu4 (Megatron-LM dev's hybrid CP: need CPKIT_MLM_SRC; "
        "`functional/test_mlm_gdn_cp.py` is gpu2 only and needs fla)"),
    Row(("src/cpkit/dynamic/", "src/cpkit/commands/schedule.py"),
        ("tests/test_dynamic_scheduler.py", "tests/test_dynamic_cost.py", "tests/test_dynamic_mcore.py",
         "tests/test_dynamic_registry.py", "tests/test_schedule_cli.py", "tests/test_dynamic_runtime.py",
         "tests/test_dynamic_pipeline.py", "tests/test_replay.py", "tests/test_dynamic_mlm.py",
         "tests/test_dynamic_search.py", "tests/test_mixed_cp_plan.py"),
        ("functional/test_dynamic_cp.py", "functional/test_replay_gpu.py", "functional/test_dynamic_failures.py",
         "functional/test_dynamic_pipeline.py", "functional/test_dynamic_p2p_shapes.py",
         "functional/test_mcore_hybrid_cp.py", "functional/test_mlm_data_path.py",
         "functional/test_loss_matrix_dynamic.py"),
        "unit, dist, gpu2, gpu4 (`functional/test_mcore_hybrid_cp.py` is gpu4 only; "
        "`tests/test_dynamic_mlm.py` and `functional/test_mlm_data_path.py` need CPKIT_MLM_SRC)"),
    Row(("src/cpkit/attention/gpt.py", "src/cpkit/testing/models.py", "src/cpkit/loss.py"),
        ("tests/test_models.py", "tests/test_eval_cp.py", "tests/test_dynamic_runtime.py", "tests/test_loss_hook.py",
         "tests/test_collective_devices.py"),
        ("functional/test_gpt.py", "functional/test_hierarchical.py", "functional/test_eval_cp.py",
         "functional/test_dynamic_cp.py", "functional/test_te_backend.py", "functional/test_loss_matrix.py",
         "functional/test_loss_matrix_dynamic.py", "functional/test_mcore_hybrid_model.py"),
        "unit, dist, gpu2, gpu4 (`functional/test_mcore_hybrid_model.py` needs megatron-core 0.19+)"),
    Row(("src/cpkit/testing/scenarios/",),
        ("tests/test_loss_hook.py", "tests/test_loss_matrix_cells.py"), ("functional/test_groups.py", "functional/test_attention.py", "functional/test_hierarchical.py",
             "functional/test_eval_cp.py", "functional/test_dynamic_cp.py", "functional/test_cluster.py",
             "functional/test_loss_matrix.py", "functional/test_loss_matrix_dynamic.py"),
        "dist, gpu2, gpu4: the functional tests and the cluster runner (`src/cpkit/cluster/`) run these scenarios"),
    Row(("src/cpkit/attention/cudnn_fe.py",), ("tests/test_cudnn_fe.py", "tests/test_band.py", "tests/test_attention_unit.py",
                                                "tests/test_bench_window.py"),
        ("functional/test_kernels_gpu.py", "functional/test_device.py", "functional/test_attention.py"),
        "unit, gpu1 (with nvidia-cudnn-frontend installed: README 'Kernels'); numbers: `python -m cpkit.bench window`"),
    Row(("src/cpkit/bench/",), ("tests/test_attention_module.py", "tests/test_eval_plan.py", "tests/test_dynamic_cost.py",
                                "tests/test_bench_window.py", "tests/test_replay.py", "tests/test_dynamic_step.py",
                                "tests/test_dynamic_step_timeline.py", "tests/test_dynamic_step_order.py",
                                "tests/test_command_lines.py", "tests/test_readme.py",
                                "tests/test_bench_attention_table.py", "tests/test_changed_recall.py",
                                "tests/test_changed_samples.py"),
        ("functional/test_bench.py", "functional/test_replay_gpu.py", "functional/test_dynamic_step.py"),
        "unit, dist, gpu1; 4 GPUs: `python -m cpkit.bench dynamic_step`"),
    Row(("src/cpkit/commands/layout.py",), ("tests/test_layout_cli.py",), (), "unit"),
    Row(("src/cpkit/testing/compare.py", "src/cpkit/testing/upstream_xfail.py", "src/cpkit/testing/plans.py",
         "src/cpkit/testing/fakes.py"),
        ("tests/test_compare_bf16.py", "tests/test_upstream_xfail.py", "tests/test_strict_xfails.py",
         "tests/test_mixed_cp_plan.py", "tests/test_collective_devices.py", "tests/test_loss_matrix_cells.py"),
        ("functional/test_dynamic_pipeline.py", "functional/test_loss_matrix.py", "functional/test_loss_matrix_dynamic.py",
         "functional/test_te_backend.py"),
        "unit, dist, gpu2, gpu4 (also selected with the harness: src/cpkit/testing/)"),
    Row(("src/cpkit/tools/",), ("tests/test_fatbin_prune.py",), (),
        "unit; the bundle it prunes: `bash scripts/te-install.sh` on a GPU machine, then `import transformer_engine.pytorch`"),
    Row(("scripts/host-wheels.sh", "scripts/kernels-wheel.sh"), ("tests/test_host_wheels.py",), (),
        "unit; the download itself: `bash scripts/host-wheels.sh` on a machine with network"),
    Row(("scripts/gpu-proof.sh", "scripts/gpu-ci-prepare.sh", "scripts/setup.sh", "scripts/upstream-pack.sh",
         "scripts/upstream-unpack.sh", "scripts/upstream-pins.txt", "scripts/te-bundle.sh", "scripts/te-ext-build.sh",
         "scripts/te-install.sh", "scripts/GPU_CI.md", ".github/"),
        ("tests/test_gpu_ci.py", "tests/test_upstream_archives.py", "tests/test_te_bundle_needs.py",
         "tests/test_required_parts.py"), (),
        "unit; the GPU half: `bash scripts/gpu-proof.sh` on a 2-GPU host (scripts/GPU_CI.md)"),
    Row(("src/cpkit/upstream/__init__.py", "src/cpkit/upstream/checkouts.py"), ("tests/test_checkouts.py", "tests/test_bridge_hcp_config.py",
                                      "tests/test_bridge_src.py", "tests/test_eval_cp_protocol.py"),
        ("functional/test_bridge_hcp.py", "functional/test_examples.py"),
        "unit; on GPUs its identities land in every bench JSON and proof's env.txt"),
    Row(("src/cpkit/upstream/bridge.py", "src/cpkit/testing/bridge_hcp.py", "src/cpkit/testing/scenarios/bridge_hcp.py"),
        ("tests/test_bridge_src.py", "tests/test_bridge_hcp_config.py", "tests/test_eval_cp_protocol.py",
         "tests/test_checkouts.py"),
        ("functional/test_bridge_hcp.py", "functional/test_examples.py"),
        "unit, dist, gpu4; with CPKIT_BRIDGE_SRC set the Bridge side runs, else it skips with the reason"),
    Row(("src/cpkit/devices.py",), ("tests/test_devices.py", "tests/test_cards.py"), ("functional/test_examples.py",),
        "unit, dist, gpu2, gpu4: the examples start their ranks with it (NCCL on GPUs under torchrun)"),
    Row(("examples/",), ("tests/test_skills.py",), ("functional/test_examples.py", "functional/test_example_faults.py"),
        "dist, gpu2, gpu4: each example under torchrun at every size it names, and failing on a fault planted in "
        "the path its skill names (a changed module selects both when an example imports it)"),
    Row(("src/cpkit/testing/thread_ring.py",), ("tests/test_ring_threads.py",), (), "unit"),
    Row(("src/cpkit/testing/mlm_probes.py",), ("tests/test_dynamic_mlm.py",), (),
        "unit (with CPKIT_MLM_SRC set: the probes run in a Megatron-LM checkout's worker)"),
    Row(("src/cpkit/validation/", "src/cpkit/cards/", "src/cpkit/skills/", "src/cpkit/cli.py",
         "src/cpkit/commands/__init__.py", "src/cpkit/commands/cards.py", "src/cpkit/commands/skills.py",
         "src/cpkit/commands/validate.py", "src/cpkit/testing/mutation.py", "cards/", "skills/"),
        ("tests/test_proof_report.py", "tests/test_cards.py", "tests/test_cards_upstream.py", "tests/test_cards_results.py", "tests/test_cards_evidence.py", "tests/test_cards_claims.py", "tests/test_skills.py", "tests/test_repo_cards_skills.py", "tests/test_validate.py",
         "tests/test_change_map.py", "tests/test_symbol_graph.py", "tests/test_cli_output.py", "tests/test_mutation.py",
         "tests/test_command_lines.py", "tests/test_coverage_map.py", "tests/test_changed_nodes.py",
         "tests/test_coverage_map_fresh.py", "tests/test_claim_scope.py", "tests/test_stoppable.py"), (), "unit"),
    Row(("skills/", "src/cpkit/attention/a2a.py", "src/cpkit/attention/band.py", "src/cpkit/parallel/groups.py",
         "src/cpkit/eval_cp/loop.py", "src/cpkit/dynamic/runtime.py", "src/cpkit/hybrid/recurrent_cp.py", "src/cpkit/hybrid/mamba.py",
         "src/cpkit/hybrid/layout.py"), (), ("functional/test_skill_faults.py",),
        "dist: each skill's Verify commands, run as written, fail on a fault planted in its feature's path"),
    Row(("src/cpkit/testing/", "src/cpkit/harness/", "src/cpkit/process_device.py", "src/cpkit/mcore_cpu.py",
         "src/cpkit/compat.py", "src/cpkit/errors.py", "src/cpkit/__init__.py", "src/cpkit/notices.py", "tests/conftest.py", "functional/__init__.py", "pyproject.toml", ".ci/"),
        EVERYTHING[:1], EVERYTHING[1:], "everything: the harness, MCore compatibility and errors reach every test"),
)

#: Selected with any change: the checks that read every tracked text file or every module.
ALWAYS = ("tests/test_repo_text.py",)
#: Selected with any change under src/cpkit/: each layer imports only the layers below, and the
#: library imports no test support.
ANY_MODULE = ("tests/test_import_graph.py",)

#: Changes to these select no test (documentation, evidence, scripts run on GPU machines).
DOC_PATHS = ("*.md", "evidence/*", "scripts/*", ".gitignore", "LICENSE*", "docs/*")


def matches(pattern: str, path: str) -> bool:
    """True when repository `path` is `pattern`, lies under the folder `pattern/`, or matches
    the glob."""
    if pattern.endswith("/"):
        return path.startswith(pattern)
    return path == pattern or fnmatch.fnmatch(path, pattern)


@dataclass
class Selection:
    """What a set of changed paths asks for: the test files (or whole folders) to run, why each
    path selected what it did, and whether every test is selected."""

    files: list[str]
    reasons: dict[str, str]
    everything: bool

    def to_dict(self) -> dict:
        return {"files": self.files, "reasons": self.reasons, "everything": self.everything}


def _specificity(pattern: str) -> int:
    """Longer patterns name less: a file beats its folder, a folder its parent."""
    return len(pattern.rstrip("*"))


#: The checkout this module lives in, when it is one (an editable install); the default root.
_CHECKOUT = Path(__file__).resolve().parents[3]


def _rows_of(path: str) -> list[Row]:
    """The rows that decide for `path`: those naming it with the most specific pattern."""
    scored = [(max(_specificity(p) for p in row.changed if matches(p, path)), row)
              for row in CHANGE_MAP if any(matches(p, path) for p in row.changed)]
    best = max((score for score, _ in scored), default=None)
    return [row for score, row in scored if score == best]


def importing_module(path: str, root: Path | None) -> Path | None:
    """The checkout (`root`, default: this module's, if it is one) when `path` is one of its
    cpkit modules that exists, else None."""
    if root is None:
        root = _CHECKOUT if (_CHECKOUT / "tests").is_dir() else None
    if root is None or not path.startswith("src/cpkit/") or not path.endswith(".py") or not (root / path).is_file():
        return None
    return root


def _importing(path: str, root: Path | None) -> list[str]:
    """Test files importing the changed module `path` (none for other paths or a deleted file)."""
    found = importing_module(path, root)
    return importing_tests(path, found) if found is not None else []


def _feature(module: str) -> Callable[[str], bool]:
    """The modules a narrow selection follows uses through: the changed module's own package
    (the module alone at the top level) and the functional tests' scenarios."""
    package = module.rsplit(".", 1)[0] if module.count(".") > 1 else module
    return lambda m: m == package or m.startswith((package + ".", _SCENARIOS))


_SCENARIOS = "cpkit.testing.scenarios."


def _narrow(path: str, root: Path, lines: set[int] | None, row_files: list[str]) -> list[str]:
    """The narrow selection of changed module `path`: the tests that use one of its changed
    symbols (those covering `lines`, all when None) through its own package, plus the row's
    tests that imports do not show (a scenario run by name)."""
    importing = set(importing_tests(path, root))
    symbols = {MODULE} if lines is None else symbols_at_lines(path, lines, root)
    module = ".".join(PurePosixPath(path).with_suffix("").parts[1:])
    module = module.removesuffix(".__init__")
    using = affected_tests({path: symbols}, root, through=_feature(module))
    unseen = [f for f in row_files if f not in importing]
    return unseen + [f for f in using if f not in unseen]


def select_tests(changed: list[str], root: Path | None = None, *, narrow: bool = False,
                 lines: dict[str, set[int] | None] | None = None) -> Selection:
    """Test files covering the `changed` repository paths, per the rules in the module docstring.
    Where several rows name a path, the most specific pattern wins (`src/cpkit/testing/models.py`
    over `src/cpkit/testing/`); a changed module adds the test files importing it, read from
    the checkout at `root` (default: the one this module is in, if any).

    `narrow`: for a changed module that exists, instead of its row and its importing tests, the
    tests that use one of its changed symbols through its own package and the functional
    scenarios (src/cpkit/validation/symbol_graph.py::affected_tests), plus the row's tests that imports do
    not show; `lines` gives the changed line numbers of such a module (None or missing: every
    symbol changed). Rows that select everything still do."""
    files: dict[str, None] = {}
    reasons: dict[str, str] = {}
    everything = False
    for path in changed:
        rows = _rows_of(path)
        is_test = path.startswith(("tests/", "functional/")) and PurePosixPath(path).name.startswith("test_")
        importing = _importing(path, root)
        if rows:
            picked = [f for row in rows for f in (*row.unit, *row.functional)]
            if any(f in EVERYTHING for f in picked):
                everything = True
                reasons[path] = "everything"
            elif narrow and (checkout := importing_module(path, root)) is not None:
                picked = _narrow(path, checkout, (lines or {}).get(path), picked)
                reasons[path] = ", ".join(dict.fromkeys(picked)) or "no test uses the changed symbols"
                files.update(dict.fromkeys(picked))
            else:
                picked += [f for f in importing if f not in picked]
                reasons[path] = ", ".join(dict.fromkeys(picked))
                files.update(dict.fromkeys(picked))
        elif is_test:
            files[path] = None
            reasons[path] = "its own file"
        elif path.startswith("tests/fixtures/"):
            reasons[path] = "tests/test_cards.py, tests/test_skills.py"
            files.update(dict.fromkeys(("tests/test_cards.py", "tests/test_skills.py")))
        elif any(fnmatch.fnmatch(path, p) for p in DOC_PATHS):
            reasons[path] = "the text check only (documentation or evidence)"
        else:
            everything = True
            reasons[path] = "everything (no row of src/cpkit/validation/change_map.py::CHANGE_MAP names it)"
        if path.startswith("src/cpkit/"):
            files.update(dict.fromkeys(ANY_MODULE))
    if everything:
        return Selection(list(EVERYTHING), reasons, True)
    if changed:
        files.update(dict.fromkeys(ALWAYS))
    return Selection(sorted(files), reasons, False)


SKILL_TABLE_BEGIN = "<!-- generated from src/cpkit/validation/change_map.py::CHANGE_MAP; do not edit -->"
SKILL_TABLE_END = "<!-- end of generated table -->"


#: Functions that find an upstream checkout, by the variable that names it: a test that reaches
#: one has parts that run only with the variable set (they skip with the reason without it).
UPSTREAM_LOOKUPS = {
    "CPKIT_MLM_SRC": ("src/cpkit/dynamic/mlm.py", "mlm_src"),
    "CPKIT_BRIDGE_SRC": ("src/cpkit/upstream/bridge.py", "bridge_src"),
}


def needs_upstream(root: Path | None = None) -> dict[str, list[str]]:
    """Test file -> the UPSTREAM_LOOKUPS variables whose checkout parts of it need, for the
    checkout at `root` (default: this module's)."""
    root = root or _CHECKOUT
    out: dict[str, list[str]] = {}
    for variable, (path, function) in UPSTREAM_LOOKUPS.items():
        for test in affected_tests({path: {function}}, root):
            out.setdefault(test, []).append(variable)
    return out


def _row_selection(row: Row, root: Path) -> tuple[str, ...]:
    """What changing any one file the row decides for selects (--wide), less ALWAYS and
    ANY_MODULE: the row's files and every test importing one of its modules."""
    picked = dict.fromkeys((*row.unit, *row.functional))
    for pattern in row.changed:
        base = root / pattern.rstrip("/")
        found = sorted(base.rglob("*")) if pattern.endswith("/") else [base]
        for file in found:
            path = file.relative_to(root).as_posix()
            if file.is_file() and row in _rows_of(path):
                picked.update(dict.fromkeys(_importing(path, root)))
    return tuple(f for f in picked if f not in ALWAYS and f not in ANY_MODULE)


def skill_table() -> str:
    """The validating skill's "you changed / unit / functional / kinds" table, as markdown: per
    row what `cpkit validate --changed --wide` selects for a change to one of its files (the
    row's test files and every test file importing one of its modules), with the upstream
    checkout each test partly needs. Read from this module's checkout."""
    needs = needs_upstream(_CHECKOUT)

    def cell(paths: tuple[str, ...]) -> str:
        if paths in (EVERYTHING[:1], EVERYTHING[1:]):
            return f"all of `{paths[0]}`"
        return ", ".join(f"`{p}`" + "".join(f" ({v})" for v in needs.get(p, ())) for p in paths) or "-"

    lines = ["| you changed | unit tests (CPU, fast) | functional tests | kinds that matter |",
             "|---|---|---|---|"]
    for r in CHANGE_MAP:
        everything = any(f in EVERYTHING for f in (*r.unit, *r.functional))
        picked = (*r.unit, *r.functional) if everything else _row_selection(r, _CHECKOUT)
        unit = tuple(f for f in picked if f.startswith("tests/"))
        functional = tuple(f for f in picked if not f.startswith("tests/"))
        lines.append(f"| {cell(r.changed)} | {cell(unit)} | {cell(functional)} | {r.kinds} |")
    lines += ["", "The table is `cpkit validate --changed --wide`: a row's own test files, then every test file "
              "importing one of its modules, directly or through the cpkit modules it imports "
              "(`src/cpkit/validation/import_graph.py::importing_tests`). `cpkit validate --changed` runs fewer for a "
              "module: the tests that use a changed function or class through its own package "
              "(`src/cpkit/validation/symbol_graph.py::affected_tests`). "
              + "; ".join(f"({v}): parts of the test run only with {v} set (they skip with the reason without it)"
                          for v in UPSTREAM_LOOKUPS) + "."]
    return "\n".join([SKILL_TABLE_BEGIN, *lines, SKILL_TABLE_END])


if __name__ == "__main__":
    try:
        print(skill_table())
    except BrokenPipeError:  # `python -m cpkit.validation.change_map | head`
        from cpkit.notices import quiet_closed_stdout

        quiet_closed_stdout()

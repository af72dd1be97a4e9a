"""The change map (src/cpkit/validation/change_map.py): what `cpkit validate --changed` selects for fixture
diffs, that the map names every module and only existing tests, and that the validating skill's
table cannot drift from it."""

import shutil
import subprocess
from pathlib import Path

import pytest

from cpkit.validation.change_map import (
    ALWAYS,
    ANY_MODULE,
    CHANGE_MAP,
    EVERYTHING,
    SKILL_TABLE_BEGIN,
    matches,
    select_tests,
    skill_table,
)
from cpkit.cli import build_parser
from cpkit.commands.validate import changed_paths
from cpkit.skills import check_skills
from cpkit.validation.import_graph import package_modules, importing_tests, transitive_cpkit_imports

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_REPO = Path(__file__).parent / "fixtures" / "cards" / "repo"
SKILL = "skills/demo-feature/SKILL.md"


CHECKS = ["tests/test_import_graph.py", "tests/test_repo_text.py"]  # with every module change


@pytest.mark.parametrize("changed,expected", [
    ("src/cpkit/eval_cp/context.py", ["functional/test_eval_cp.py", "tests/test_eval_cp.py", "tests/test_eval_cp_protocol.py",
                              "tests/test_eval_plan.py"]),
    ("src/cpkit/parallel/layout.py", ["functional/test_groups.py", "tests/test_groups.py", "tests/test_layout.py",
                             "tests/test_layout_cli.py"]),
    ("src/cpkit/dynamic/scheduler.py", ["functional/test_dynamic_cp.py", "functional/test_dynamic_failures.py",
                                        "functional/test_dynamic_p2p_shapes.py", "functional/test_dynamic_pipeline.py",
                                        "functional/test_mcore_hybrid_cp.py", "functional/test_mlm_data_path.py",
                                        "functional/test_replay_gpu.py",
                                        "tests/test_dynamic_cost.py", "tests/test_dynamic_mcore.py",
                                        "tests/test_dynamic_mlm.py", "tests/test_dynamic_pipeline.py", "tests/test_dynamic_registry.py",
                                        "tests/test_dynamic_runtime.py", "tests/test_dynamic_scheduler.py",
                                        "tests/test_replay.py", "tests/test_schedule_cli.py"]),
    ("src/cpkit/attention/a2a.py", ["functional/test_attention.py", "functional/test_attention_features.py",
                                    "functional/test_attention_module.py", "functional/test_device.py",
                                    "functional/test_gpt.py", "functional/test_gpt_features.py",
                                    "functional/test_hierarchical.py", "functional/test_kernels_gpu.py",
                                    "functional/test_skill_faults.py", "functional/test_te_backend.py",
                                    "tests/test_attention_features.py", "tests/test_attention_module.py",
                                    "tests/test_attention_unit.py", "tests/test_band.py", "tests/test_cudnn_fe.py",
                                    "tests/test_flex_band.py", "tests/test_ring_threads.py"]),
    ("src/cpkit/cards/status.py", ["tests/test_cards.py", "tests/test_cards_upstream.py", "tests/test_change_map.py",
                                   "tests/test_changed_nodes.py", "tests/test_cli_output.py",
                                   "tests/test_coverage_map.py", "tests/test_coverage_map_fresh.py",
                                   "tests/test_mutation.py", "tests/test_proof_report.py", "tests/test_repo_cards_skills.py",
                                   "tests/test_skills.py", "tests/test_stoppable.py", "tests/test_symbol_graph.py",
                                   "tests/test_validate.py"]),
    # A file in the harness folder with a row of its own: that row, not everything.
    ("src/cpkit/testing/models.py", ["functional/test_dynamic_cp.py", "functional/test_eval_cp.py",
                                     "functional/test_gpt.py", "functional/test_hierarchical.py",
                                     "functional/test_te_backend.py", "tests/test_collective_devices.py",
                                     "tests/test_dynamic_runtime.py",
                                     "tests/test_eval_cp.py", "tests/test_models.py"]),
])
def test_a_file_in_each_feature_selects_its_tests(changed, expected):
    # The rows' files, plus every test file that imports the module.
    selection = select_tests([changed])
    assert selection.files == sorted(set(expected + CHECKS + importing_tests(changed, ROOT))) and not selection.everything


def test_every_test_file_that_imports_a_module_is_selected_by_its_change():
    # Per test file, the cpkit modules it loads (directly or through cpkit's own imports);
    # changing any of them must select it (or everything).
    src = ROOT / "src"
    files = {m: p.relative_to(ROOT).as_posix() for m, p in package_modules(src).items()}
    missed: dict[str, list[str]] = {}
    for folder in ("tests", "functional"):
        for test in sorted((ROOT / folder).glob("test_*.py")):
            name = test.relative_to(ROOT).as_posix()
            for module in transitive_cpkit_imports(test, ROOT, src):
                selection = select_tests([files[module]])
                if not selection.everything and name not in selection.files:
                    missed.setdefault(files[module], []).append(name)
    assert missed == {}, f"src/cpkit/validation/change_map.py::select_tests misses importing tests: {missed}"


def test_a_thd_position_change_selects_the_tests_that_catch_it():
    # tests/test_dynamic_runtime.py and the dynamic functional tests run thd_position_ids
    # (through cpkit.dynamic.runtime), although neither imports cpkit.sharding itself.
    selected = select_tests(["src/cpkit/sharding.py"]).files
    for test in ("tests/test_sharding.py", "tests/test_dynamic_runtime.py", "functional/test_dynamic_cp.py",
                 "functional/test_dynamic_failures.py", "functional/test_dynamic_pipeline.py"):
        assert test in selected


def test_a_module_an_example_imports_selects_the_example_test():
    # The examples run in a subprocess: functional/test_examples.py imports none of them.
    assert "functional/test_examples.py" in select_tests(["src/cpkit/eval_cp/context.py"]).files
    assert "functional/test_examples.py" in select_tests(["examples/eval_cp_in_your_loop.py"]).files


def test_the_import_closure_follows_lazy_and_package_imports(tmp_path):
    files = {
        "src/cpkit/__init__.py": "",
        "src/cpkit/sub/__init__.py": "from cpkit.sub.inner import g\n",
        "src/cpkit/sub/inner.py": "def g():\n    from ..leaf import h\n    return h\n",
        "src/cpkit/leaf.py": "h = 1\n",
        "src/cpkit/alone.py": "",
        "tests/test_uses_sub.py": "from cpkit.sub import g\n",
        "functional/test_plain.py": "import torch\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert importing_tests("src/cpkit/leaf.py", tmp_path) == ["tests/test_uses_sub.py"]
    assert importing_tests("src/cpkit/__init__.py", tmp_path) == ["tests/test_uses_sub.py"]
    assert importing_tests("src/cpkit/alone.py", tmp_path) == []


def test_docs_only_change_selects_only_the_text_check():
    selection = select_tests(["README.md", "evidence/2026-11-22-4xH200-1ec52e4/README.md", "scripts/gpu-suites.sh"])
    assert selection.files == ["tests/test_repo_text.py"] and not selection.everything
    assert all("text check only" in reason for reason in selection.reasons.values())


@pytest.mark.parametrize("harness", ["src/cpkit/harness/launch.py", "src/cpkit/compat.py", "pyproject.toml",
                                     "tests/conftest.py"])
def test_harness_change_selects_everything(harness):
    selection = select_tests(["README.md", "src/cpkit/eval_cp/context.py", harness])
    assert selection.everything and selection.files == list(EVERYTHING)


def test_changed_test_file_selects_itself_and_unmapped_code_selects_everything():
    assert select_tests(["functional/test_launcher.py"]).files == ["functional/test_launcher.py",
                                                                    "tests/test_repo_text.py"]
    unmapped = select_tests(["src/cpkit/brand_new_module.py"])
    assert unmapped.everything and "CHANGE_MAP" in unmapped.reasons["src/cpkit/brand_new_module.py"]


def test_every_module_is_named_by_a_row():
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "src" / "cpkit").rglob("*.py")]
    unnamed = [m for m in modules if not any(matches(p, m) for row in CHANGE_MAP for p in row.changed)]
    assert unnamed == [], f"add these to src/cpkit/validation/change_map.py::CHANGE_MAP: {unnamed}"


def test_every_test_file_is_selected_by_some_change():
    # A test file no row names runs only when it changes itself (or with everything).
    named = {f for row in CHANGE_MAP for f in (*row.unit, *row.functional)} | set(ALWAYS) | set(ANY_MODULE)
    files = [p.relative_to(ROOT).as_posix() for folder in ("tests", "functional") for p in (ROOT / folder).glob("test_*.py")]
    harness = {"functional/test_launcher.py", "tests/test_pytest_plugin.py", "tests/test_gpu_claim.py",
               "tests/test_cpu_shim.py", "functional/test_rank_pool.py", "tests/test_rendezvous.py",
               "functional/test_children.py"}  # selected with the harness: everything
    assert sorted(f for f in files if f not in named and f not in harness) == []


def test_every_path_the_map_names_exists():
    named = {p for row in CHANGE_MAP for p in (*row.changed, *row.unit, *row.functional)}
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


def _skill_with_table(repo: Path, table: str) -> None:
    text = (repo / SKILL).read_text()
    (repo / SKILL).write_text(text + "\n" + table + "\n")


def _drift_problems(repo: Path) -> list[str]:
    return [p for p in check_skills(repo, build_parser()) if "differs from src/cpkit/validation/change_map.py" in p]


def test_skill_table_matching_the_map_passes(tmp_path):
    repo = Path(shutil.copytree(FIXTURE_REPO, tmp_path / "repo"))
    _skill_with_table(repo, skill_table())
    assert _drift_problems(repo) == []


def test_planted_drift_in_the_skill_table_fails_the_skills_check(tmp_path):
    repo = Path(shutil.copytree(FIXTURE_REPO, tmp_path / "repo"))
    drifted = skill_table().replace("`tests/test_eval_plan.py`", "`tests/test_eval_plan.py`, `tests/test_x.py`", 1)
    assert drifted != skill_table()
    _skill_with_table(repo, drifted)
    problems = _drift_problems(repo)
    assert len(problems) == 1 and problems[0].startswith(SKILL + ":")
    assert SKILL_TABLE_BEGIN in drifted


def test_leftovers_of_an_earlier_table_after_the_end_marker_fail_the_skills_check(tmp_path):
    # a regeneration that replaced the rows only left the old trailer behind, copy after copy
    repo = Path(shutil.copytree(FIXTURE_REPO, tmp_path / "repo"))
    trailer = skill_table()[skill_table().rindex("|") + 1:]  # the text after the rows, end marker included
    _skill_with_table(repo, skill_table() + trailer)
    assert _drift_problems(repo) == []  # the table itself is right
    problems = [p for p in check_skills(repo, build_parser()) if "end of generated table" in p]
    assert len(problems) == 1 and "appears 2 times, once allowed" in problems[0], problems


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def test_changed_paths_since_the_merge_base_include_uncommitted_and_untracked(tmp_path):
    repo = tmp_path
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.py").write_text("a\n")
    (repo / "b.py").write_text("b\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    _git(repo, "checkout", "-qb", "work")
    (repo / "a.py").write_text("a2\n")
    _git(repo, "commit", "-qam", "change a")
    (repo / "b.py").write_text("b2\n")  # uncommitted
    (repo / "c.py").write_text("c\n")  # untracked
    _git(repo, "checkout", "-q", "main")
    (repo / "main_only.py").write_text("m\n")
    _git(repo, "add", "main_only.py")
    _git(repo, "commit", "-qm", "main moves on")
    _git(repo, "checkout", "-q", "work")
    base, paths = changed_paths(repo, None)
    assert base == _git(repo, "merge-base", "HEAD", "main").strip()
    assert paths == ["a.py", "b.py", "c.py"]  # main's own commit is not this branch's change
    with pytest.raises(ValueError, match="not a commit"):
        changed_paths(repo, "no-such-ref")

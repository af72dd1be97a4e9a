"""A measured claim is held to the code its command ran, derived, not hand-written
(src/cpkit/cards/claim_scope.py): a body change in a function on a claim's path marks it stale,
a change off the path does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpkit.cards.claim_scope import WHOLE_SUITE, claim_scope, entry_modules, recorded_code
from cpkit.cards.freshness import FRESH, STALE, ChangeIndex
from cpkit.cards.schema import load_cards

ROOT = Path(__file__).resolve().parents[1]
WINDOWS = "python -m cpkit.bench attention --cp 2 --seq 32K,128K --kv-heads 8 --backends cpkit,te --features window,window2"


def test_the_attention_bench_runs_the_a2a_forward_and_not_the_scheduler():
    scope = claim_scope(WINDOWS, ROOT)
    assert {"src/cpkit/attention/a2a.py", "src/cpkit/attention/cudnn_fe.py", "src/cpkit/attention/p2p.py",
            "src/cpkit/bench/attention/attention_features.py", "src/cpkit/parallel/layout.py"} <= set(scope)
    assert "src/cpkit/dynamic/scheduler.py" not in scope and "src/cpkit/eval_cp/rebind.py" not in scope


def test_lazy_exports_named_by_string_are_on_the_path():
    # cpkit.attention's __getattr__ loads the MCore module by name (importlib.import_module)
    assert "src/cpkit/attention/module.py" in claim_scope("python -m cpkit.bench eval_cp", ROOT)


def test_a_script_preset_is_its_branch_and_the_scripts_it_sources():
    modules, paths = entry_modules("DYNAMIC_STEP_BUDGET_S=200 bash scripts/gpu-bench.sh dynamic_step", ROOT)
    assert "cpkit.bench.dynamic.dynamic_step" in modules and "cpkit.bench.attention.attention" not in modules
    assert {"scripts/gpu-bench.sh", "scripts/gpu-env.sh", "scripts/upstream-unpack.sh"} <= paths


def test_a_mutation_claim_is_its_file_and_tests_and_validate_is_everything():
    scope = claim_scope("python -m cpkit.testing.mutation src/cpkit/parallel/layout.py tests/test_layout.py --sample 30", ROOT)
    assert {"src/cpkit/parallel/layout.py", "tests/test_layout.py", "src/cpkit/testing/mutation.py"} <= set(scope)
    assert "src/cpkit/attention/a2a.py" not in scope
    assert claim_scope("cpkit validate --record-map", ROOT) == WHOLE_SUITE


def test_a_repository_script_brings_the_cpkit_modules_it_imports(tmp_path):
    """An evidence folder's A/B script run by path: in scope are the script and the cpkit modules
    it imports (with theirs), not the rest of cpkit."""
    (tmp_path / "src" / "cpkit" / "attention").mkdir(parents=True)
    for name, text in (("cpkit/__init__.py", ""), ("cpkit/attention/__init__.py", ""),
                       ("cpkit/attention/a2a.py", "from cpkit.attention import chunks\n"),
                       ("cpkit/attention/chunks.py", ""), ("cpkit/attention/p2p.py", "")):
        (tmp_path / "src" / name).write_text(text)
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence" / "ab.py").write_text("import torch\nfrom cpkit.attention import a2a\n")
    scope = claim_scope("PYTHONPATH=src python3 evidence/ab.py", tmp_path)
    assert set(scope) == {"evidence/ab.py", "src/cpkit/__init__.py", "src/cpkit/attention/__init__.py",
                          "src/cpkit/attention/a2a.py", "src/cpkit/attention/chunks.py"}
    assert claim_scope("python3 evidence/missing.py", tmp_path) == ()


def test_a_recorded_code_list_joins_the_scope(tmp_path):
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "bench.json").write_text(json.dumps({"code": ["src/cpkit/dynamic/scheduler.py"]}))
    assert recorded_code(tmp_path, "ev") == ("src/cpkit/dynamic/scheduler.py",)
    assert "src/cpkit/dynamic/scheduler.py" in claim_scope(WINDOWS, ROOT, recorded_code(tmp_path, "ev"))


@pytest.mark.parametrize("changed, state", [
    ("src/cpkit/attention/a2a.py", STALE),          # _UlyssesAttention.forward: on the benchmark's path
    ("src/cpkit/dynamic/scheduler.py", FRESH),      # off it
])
def test_a_change_on_the_measured_path_marks_the_claim_stale(monkeypatch, changed, state):
    index = ChangeIndex(ROOT)
    monkeypatch.setattr(index, "changed_since", lambda commit: ((changed,), ""))
    # the hand-written about of the claim that read "fresh" while its a2a path had changed
    about = ("src/cpkit/attention/cudnn_fe.py", "src/cpkit/bench/attention/attention_features.py")
    assert index.claim_freshness("8e4de0e", about, WINDOWS).state == state
    assert index.claim_freshness("8e4de0e", about).state == FRESH  # the hand-written scope alone missed it


def test_every_claim_has_a_derived_scope():
    """Every claim's command names code the scope can find (or is the whole suite, or not a run)."""
    empty = [c.id for card in load_cards(ROOT)[0] for c in card.claims
             if not c.command.startswith("not recorded") and not claim_scope(c.command, ROOT)]
    assert empty == []


def test_the_readme_benchmark_table_is_rendered_from_the_newest_claims(tmp_path):
    import dataclasses
    import datetime as dt

    from cpkit.cards.bench_pointers import BEGIN, END, QUESTIONS, newest_claim, pointer_problems, render_pointers

    cards = load_cards(ROOT)[0]
    cp2_features = next(q for q in QUESTIONS if "--cp 2 --features" in q.command)
    old = newest_claim(cp2_features, cards, ROOT)
    assert old is not None and "--cp 2" in old.command and "--features" in old.command
    newer = dataclasses.replace(old, id="a-newer-run", date=old.date + dt.timedelta(days=1))
    card = dataclasses.replace(cards[0], claims=(*cards[0].claims, newer))
    assert newest_claim(cp2_features, [card, *cards[1:]], ROOT).id == "a-newer-run"
    dense_cp2 = next(q for q in QUESTIONS if q.command == "`python -m cpkit.bench attention --cp 2`")
    assert dense_cp2.matches("python -m cpkit.bench attention --cp 2 --backends cpkit,te,torch,sdpa")
    assert not dense_cp2.matches("python -m cpkit.bench attention --cp 2 --backends cpkit")  # an A/B: not vs TE
    dense_cp4 = next(q for q in QUESTIONS if q.command == "`python -m cpkit.bench attention --cp 4`")
    assert "--features" not in newest_claim(dense_cp4, cards, ROOT).command
    (tmp_path / "README.md").write_text(f"{BEGIN}\n| stale |\n{END}\n")
    assert pointer_problems(tmp_path, cards) and "a-newer-run" in render_pointers([card, *cards[1:]], ROOT)
    assert pointer_problems(ROOT, cards) == []

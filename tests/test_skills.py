"""cpkit.skills and `cpkit skills check`, on the miniature repository in fixtures/cards/repo.

Each file in fixtures/skills/bad/ replaces the fixture skill's SKILL.md (`*.SKILL.md`) or
evals.json (`*.evals.json`) with a version that has one defect; each must be reported.
"""

import shlex
import shutil
from pathlib import Path

import pytest

from cpkit.cli import build_parser, main
from cpkit.skills import SkillError, body_anchors, body_commands, check_command, check_skills, load_skill

FIXTURES = Path(__file__).parent / "fixtures"
PARSER = build_parser()
GOOD = FIXTURES / "cards" / "repo"  # the miniature repository shared with test_cards.py
SKILL = "skills/demo-feature/SKILL.md"
EVALS = "skills/demo-feature/evals.json"


@pytest.fixture
def repo(tmp_path):
    """A private copy of the miniature repository (tests may edit it)."""
    return Path(shutil.copytree(GOOD, tmp_path / "repo"))


def test_good_skill_loads_and_passes():
    skill = load_skill(GOOD / "skills" / "demo-feature", GOOD)
    assert skill.name == "demo-feature" and skill.license == "Apache-2.0"
    assert skill.body_start_line == 7
    assert check_skills(GOOD, PARSER) == []


BAD_SKILLS = {
    # SKILL.md
    "bad_name.SKILL.md": f"{SKILL}: name: 'Demo_Feature' is not kebab-case",
    "name_not_folder.SKILL.md": f"{SKILL}: name: 'other-feature' differs from its folder 'demo-feature'",
    "long_description.SKILL.md": f"{SKILL}: description: 1182 characters, at most 1024",
    "missing_frontmatter_key.SKILL.md": f"{SKILL}: license: missing required frontmatter key",
    "unknown_frontmatter_key.SKILL.md": f"{SKILL}: version: unknown frontmatter key",
    "no_frontmatter.SKILL.md": f"{SKILL}: missing frontmatter",
    "unclosed_frontmatter.SKILL.md": f"{SKILL}: frontmatter is not closed",
    "long_body.SKILL.md": f"{SKILL}: body: 530 lines, at most 500",
    "unknown_subcommand.SKILL.md": f"{SKILL}:19: `cpkit cards` has no subcommand 'frobnicate'",
    "unknown_flag.SKILL.md": f"{SKILL}:19: `cpkit cards status` has no option --fast",
    "group_without_subcommand.SKILL.md": f"{SKILL}:18: `cpkit cards` needs a subcommand (check, status, record)",
    "inline_command.SKILL.md": f"{SKILL}:14: `cpkit cards` has no subcommand 'run'",
    "missing_test_path.SKILL.md": f"{SKILL}:22: `pytest tests/test_nothing_here.py`: does not exist",
    "missing_test_node.SKILL.md": f"{SKILL}:20: `pytest tests/fixture_suite.py::test_slow`: no symbol 'test_slow'",
    "unknown_marker.SKILL.md": f"{SKILL}:20: `-m not gpu8`: unknown marker 'gpu8'",
    "stale_anchor.SKILL.md": f"{SKILL}:10: `src/demo/core.py::Widget.gone` no symbol 'Widget.gone'",
    "missing_path.SKILL.md": f"{SKILL}:10: `src/demo/engine.py` does not exist",
    "missing_link.SKILL.md": f"{SKILL}:13: link target 'details.md' does not exist",
    # evals.json
    "not_a_list.evals.json": f"{EVALS}: expected a non-empty list of eval cases",
    "missing_key.evals.json": f"{EVALS}: [0].ground_truth: missing required key",
    "unknown_key.evals.json": f"{EVALS}: [0].rubric: unknown key",
    "behavior_not_list.evals.json": f"{EVALS}: [0].expected_behavior: expected a non-empty list of strings",
    "wrong_skill.evals.json": f"{EVALS}: [1].expected_skill: 'other-skill' must be 'demo-feature' or null",
    "no_negative.evals.json": f"{EVALS}: no negative case (expected_skill: null)",
    "no_positive.evals.json": f"{EVALS}: no positive case (expected_skill: 'demo-feature')",
    "duplicate_id.evals.json": f"{EVALS}: duplicate ids: demo-positive",
    "duplicate_key.evals.json": f"{EVALS}: invalid JSON: duplicate key 'question'",
    "invalid_json.evals.json": f"{EVALS}: invalid JSON",
}


def test_every_bad_fixture_has_an_expectation():
    assert sorted(p.name for p in (FIXTURES / "skills" / "bad").iterdir()) == sorted(BAD_SKILLS)


@pytest.mark.parametrize("name", sorted(BAD_SKILLS))
def test_bad_skill_is_reported(repo, name):
    target = SKILL if name.endswith(".SKILL.md") else EVALS
    shutil.copy(FIXTURES / "skills" / "bad" / name, repo / target)
    problems = check_skills(repo, PARSER)
    assert any(p.startswith(BAD_SKILLS[name]) for p in problems), problems


def test_load_skill_raises_with_every_problem(repo):
    text = (repo / SKILL).read_text().replace("name: demo-feature", "name: x_y").replace("license: Apache-2.0\n", "")
    (repo / SKILL).write_text(text)
    with pytest.raises(SkillError) as err:
        load_skill(repo / "skills" / "demo-feature", repo)
    assert len(err.value.problems) == 3  # not kebab-case, not the folder, no license


def test_missing_skill_files_are_reported(repo):
    (repo / EVALS).unlink()
    (repo / "skills" / "empty-skill").mkdir()
    problems = check_skills(repo, PARSER)
    assert "skills/demo-feature: missing evals.json" in problems
    assert "skills/empty-skill: missing SKILL.md" in problems



def test_a_skills_sibling_page_is_held_to_the_same_checks(repo):
    """Details moved out of SKILL.md (read on demand) keep their anchors and commands checked."""
    sibling = repo / "skills" / "demo-feature" / "details.md"
    sibling.write_text("# Details\n\nSee `src/cpkit/nowhere.py::gone`.\n\n```bash\ncpkit no-such-command\n```\n")
    problems = [p for p in check_skills(repo, PARSER) if p.startswith("skills/demo-feature/details.md")]
    assert problems[0].startswith("skills/demo-feature/details.md:3: `src/cpkit/nowhere.py::gone`")
    assert any(p.startswith("skills/demo-feature/details.md:6:") for p in problems)


# ----------------------------------------------------------------------------- what counts


BODY = """\
Prose with `src/a.py::f`, `tests/`, `a::b`, `not/an/anchor.py`, `x.py` and `cpkit cards check`.
See [x](ref.md#part), [web](https://example.com) and [top](#top).

```bash
A=1 uv run cpkit skills check && pytest tests/t.py \\
  -q | tee log  # a comment
git status
```

```console
$ python -m cpkit.bench attention
pytest output-not-a-command
```

```python
pytest_args = ["tests/not_checked.py"]
```

```text
cpkit not-checked
```
"""


def test_body_anchors_are_backticked_prefixed_or_double_colon_words():
    assert [a for _, a in body_anchors(BODY)] == ["src/a.py::f", "tests/", "a::b", "link:ref.md"]


def test_body_commands_come_from_shell_fences_and_inline_spans():
    assert body_commands(BODY) == [
        (0, ["cpkit", "cards", "check"]),
        (4, ["cpkit", "skills", "check"]),
        (4, ["pytest", "tests/t.py", "-q"]),
        (10, ["python", "-m", "cpkit.bench", "attention"]),
    ]


def test_unbalanced_quotes_matter_only_in_checked_commands():
    body = "```bash\necho it's\nA=1 pytest 'tests\n```\n"
    [(line, argv)] = body_commands(body)
    assert line == 2 and check_command(argv, GOOD, PARSER) == ["cannot parse command: A=1 pytest 'tests"]


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("cpkit cards status --feature <slug> --run", None),
        ("cpkit cards status --feature=x --json", None),
        ("python -m cpkit.cli skills check", None),
        ("cpkit cards --help", None),
        ("cpkit cards status --feat x", "has no option --feat"),  # no abbreviations
        ("cpkit nope", "`cpkit` has no subcommand 'nope'"),
        ("python -m cpkit validate", "no module cpkit.__main__"),
        ("python -m cpkit.bench nope", "unknown benchmark"),
        ("torchrun --nnodes 2 --nproc-per-node 8 -m cpkit.cluster all --report <path>", None),
        ("python -m cpkit.cluster smoke --backend gloo --hierarchical-cp-sizes 8,2", None),
        ("torchrun --nproc-per-node 4 -m cpkit.cluster everything", "invalid choice: 'everything'"),
        ("torchrun -m cpkit.cluster all --nproc 4", "unrecognized arguments: --nproc 4"),
        ("torchrun train.py", None),
        ("python examples/nope.py", "no file examples/nope.py"),
        ("torchrun --nproc-per-node 2 examples/nope.py", "no file examples/nope.py"),
        ("pytest tests -m dist -k 'a or b' -n 2 --junitxml out/x.xml", None),
        ("python -m pytest tests/fixture_suite.py::TestGroup::test_member", None),
        ("pytest tests/fixture_suite.py::TestGroup::test_nope", "no symbol 'TestGroup.test_nope'"),
        ("pytest -m 'gpu2 or gpu16'", "unknown marker 'gpu16'"),
        ("git status", None),
    ],
)
def test_check_command(command, problem):
    problems = check_command(shlex.split(command), GOOD, PARSER)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_cli_exit_codes(repo, capsys):
    assert main(["skills", "check", "--root", str(GOOD)]) == 0
    shutil.copy(FIXTURES / "skills" / "bad" / "stale_anchor.SKILL.md", repo / SKILL)
    assert main(["skills", "check", "--root", str(repo)]) == 1
    assert "Widget.gone" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["skills"])
    assert err.value.code == 2


def test_the_attention_skill_names_every_known_upstream_loss_difference():
    """The skill's "Is my loss right under CP?" section names every key of the loss matrix's
    UPSTREAM record (the strict xfails' reasons), so a known difference is never news to a reader."""
    import ast as _ast

    root = Path(__file__).resolve().parents[1]
    matrix = root / "functional" / "test_loss_matrix.py"
    tree = _ast.parse(matrix.read_text(encoding="utf-8"))
    (upstream,) = [node.value for node in tree.body if isinstance(node, _ast.Assign)
                   and any(getattr(t, "id", None) == "UPSTREAM" for t in node.targets)]
    keys = [k.value for k in upstream.keys]
    text = (root / "skills" / "context-parallel-attention" / "SKILL.md").read_text(encoding="utf-8")
    section = text.split("## 7. Is my loss right under CP?", 1)[1].split("\n## ", 1)[0]
    assert keys and [k for k in keys if f"`{k}`" not in section] == []
    assert "MCore" in section and "0.19" in section

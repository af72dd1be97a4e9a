"""Loading a skill guide (`skills/<name>/SKILL.md`: strict YAML frontmatter and body) and
checking its `evals.json`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cpkit.validation.strict_yaml import StrictYAMLError, load_strict_yaml, yaml_error_text

__all__ = [
    "FRONTMATTER_KEYS", "MAX_DESCRIPTION_CHARS", "MAX_BODY_LINES", "EVAL_KEYS",
    "Skill", "SkillError", "load_skill", "skill_dirs", "check_evals", "rel_path",
]

FRONTMATTER_KEYS = ("name", "description", "license", "when_to_use")
MAX_DESCRIPTION_CHARS = 1024
MAX_NAME_CHARS = 64
MAX_BODY_LINES = 500
EVAL_KEYS = ("id", "question", "expected_skill", "ground_truth", "expected_behavior")

_KEBAB = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Skill:
    """A loaded skill: its frontmatter, body and where the body starts in SKILL.md."""

    name: str
    path: str  # repo-relative SKILL.md
    description: str
    license: str
    when_to_use: Any
    body: str
    body_start_line: int  # 1-based line of the body's first line in SKILL.md


class SkillError(ValueError):
    """A skill failed to load; `.problems` lists every problem, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def skill_dirs(root: str | Path) -> list[Path]:
    """Skill folders under `root/skills` (hidden folders and __pycache__ skipped), sorted."""
    skills = Path(root) / "skills"
    if not skills.is_dir():
        return []
    return sorted(d for d in skills.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))


def rel_path(path: Path, root: Path) -> str:
    """`path` relative to `root` in posix form, or as given when it lies outside."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _text_problem(value: Any, allow_list: bool = False) -> str | None:
    if isinstance(value, str) and value.strip():
        return None
    if allow_list and isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return None
    kind = "a non-empty string" + (" or list of strings" if allow_list else "")
    return f"expected {kind}, got {value!r}"


def load_skill(folder: str | Path, root: str | Path) -> Skill:
    """Load `folder/SKILL.md` and check its frontmatter and body length.

    Raises SkillError listing every problem (`skills/x/SKILL.md: name: ...`).
    """
    folder, root = Path(folder), Path(root)
    file = folder / "SKILL.md"
    rel = rel_path(file, root)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SkillError([f"{rel}: cannot read: {exc.strerror}"]) from None
    if not lines or lines[0].strip() != "---":
        raise SkillError([f"{rel}: missing frontmatter: the file must start with a '---' line"])
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise SkillError([f"{rel}: frontmatter is not closed by a '---' line"])
    try:
        meta = load_strict_yaml("\n".join(lines[1:end]))
    except StrictYAMLError as exc:
        raise SkillError([f"{rel}: frontmatter: {exc}"]) from None
    except yaml.YAMLError as exc:
        raise SkillError([f"{rel}: frontmatter: {yaml_error_text(exc)}"]) from None
    if not isinstance(meta, dict):
        raise SkillError([f"{rel}: frontmatter: expected a mapping, got {type(meta).__name__}"])
    problems = [f"{rel}: {k}: unknown frontmatter key (allowed: {', '.join(FRONTMATTER_KEYS)})"
                for k in meta if k not in FRONTMATTER_KEYS]
    problems += [f"{rel}: {k}: missing required frontmatter key" for k in FRONTMATTER_KEYS if k not in meta]
    for key in FRONTMATTER_KEYS:
        if key in meta:
            problem = _text_problem(meta[key], allow_list=key == "when_to_use")
            if problem:
                problems.append(f"{rel}: {key}: {problem}")
    name = meta.get("name")
    if isinstance(name, str) and name:
        if not _KEBAB.match(name) or len(name) > MAX_NAME_CHARS:
            problems.append(f"{rel}: name: {name!r} is not kebab-case of at most {MAX_NAME_CHARS} characters")
        if name != folder.name:
            problems.append(f"{rel}: name: {name!r} differs from its folder {folder.name!r}")
    description = meta.get("description")
    if isinstance(description, str) and len(description) > MAX_DESCRIPTION_CHARS:
        problems.append(f"{rel}: description: {len(description)} characters, at most {MAX_DESCRIPTION_CHARS}")
    body = lines[end + 1:]
    if len(body) > MAX_BODY_LINES:
        problems.append(f"{rel}: body: {len(body)} lines, at most {MAX_BODY_LINES}; move details to sibling files")
    if problems:
        raise SkillError(problems)
    return Skill(name=name, path=rel, description=description, license=meta["license"],
                 when_to_use=meta["when_to_use"], body="\n".join(body), body_start_line=end + 2)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate key {dupes[0]!r}")
    return dict(pairs)


def check_evals(file: str | Path, skill_name: str, root: str | Path) -> list[str]:
    """Problems with a skill's evals.json: a list of {id, question, expected_skill (the skill's
    name, or null for a negative case), ground_truth, expected_behavior: [str]} objects with unique
    ids, at least one positive and one negative case."""
    file, root = Path(file), Path(root)
    rel = rel_path(file, root)
    try:
        data = json.loads(file.read_text(encoding="utf-8"), object_pairs_hook=_reject_duplicates)
    except OSError as exc:
        return [f"{rel}: cannot read: {exc.strerror}"]
    except ValueError as exc:
        return [f"{rel}: invalid JSON: {exc}"]
    if not isinstance(data, list) or not data:
        return [f"{rel}: expected a non-empty list of eval cases, got {type(data).__name__}"]
    problems: list[str] = []
    ids: list[Any] = []
    for i, case in enumerate(data):
        where = f"{rel}: [{i}]"
        if not isinstance(case, dict):
            problems.append(f"{where}: expected an object with keys {', '.join(EVAL_KEYS)}")
            continue
        problems += [f"{where}.{k}: unknown key (allowed: {', '.join(EVAL_KEYS)})" for k in case if k not in EVAL_KEYS]
        problems += [f"{where}.{k}: missing required key" for k in EVAL_KEYS if k not in case]
        for key in ("question", "ground_truth"):
            if key in case and (problem := _text_problem(case[key])):
                problems.append(f"{where}.{key}: {problem}")
        if "id" in case:
            if not isinstance(case["id"], (str, int)) or isinstance(case["id"], bool) or case["id"] == "":
                problems.append(f"{where}.id: expected a non-empty string or integer, got {case['id']!r}")
            ids.append(case["id"])
        if "expected_skill" in case and case["expected_skill"] not in (skill_name, None):
            problems.append(f"{where}.expected_skill: {case['expected_skill']!r} must be {skill_name!r} or null")
        behavior = case.get("expected_behavior")
        if "expected_behavior" in case and (
            not isinstance(behavior, list) or not behavior
            or not all(isinstance(b, str) and b.strip() for b in behavior)
        ):
            problems.append(f"{where}.expected_behavior: expected a non-empty list of strings")
    dupes = sorted({str(x) for x in ids if ids.count(x) > 1})
    if dupes:
        problems.append(f"{rel}: duplicate ids: {', '.join(dupes)}")
    cases = [c for c in data if isinstance(c, dict) and "expected_skill" in c]
    if not any(c["expected_skill"] == skill_name for c in cases):
        problems.append(f"{rel}: no positive case (expected_skill: {skill_name!r})")
    if not any(c["expected_skill"] is None for c in cases):
        problems.append(f"{rel}: no negative case (expected_skill: null)")
    return problems

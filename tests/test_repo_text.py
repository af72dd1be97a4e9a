"""The repository speaks of the software only: no tracked text tells how it was developed
(working sessions, machine leases, issue numbers, briefs), and nothing points outside the
checkout (../shared). Raw tool output kept as evidence (logs, JSON, XML, bench tables) is exempt:
it is what the tools printed."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Phrases about the development process, each with what to write instead.
FORBIDDEN = [
    (re.compile(r"\bsessions?\s+\d|\bsession\d|\bGPU session\b", re.I), "a date, a machine and a commit"),
    (re.compile(r"\b(machine\s+)?leases?\b", re.I), "the machine and the run"),
    (re.compile(r"\bissue\s+#?\d+", re.I), "what the target is, not where it was asked for"),
    (re.compile(r"\bbriefs?\b", re.I), "the software's own words"),
    (re.compile(r"\bthe lead\b", re.I), "the software's own words"),
    (re.compile(r"\.\./shared|/work/(shared|main|wt)\b"), "a path inside the repository"),
]
#: An issue number is fine when it is an upstream project's ("TE issue 1930").
UPSTREAM = ("TE", "MCore", "Megatron-LM", "Megatron-Bridge", "PyTorch", "torch", "NCCL", "cuDNN", "GitHub", "upstream")
#: Evidence files that are raw tool output rather than prose.
RAW_OUTPUT = re.compile(r"^evidence/.*\.(json|jsonl|xml|log|txt|tgz|png)$")


def git_checkout_top(root: Path) -> bool:
    """True when `root` is the top folder of a git checkout (not a plain copy of the tree, such as
    an unpacked tarball, which git does not know or knows as untracked files of another checkout)."""
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:  # no git on this machine
        return False
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == Path(root).resolve()


def tracked_text_files(root: Path = ROOT) -> list[str]:
    """Tracked files that are prose or code (raw evidence output and binaries left out). Skips
    the calling test, with the reason, where `root` is not a git checkout: nothing is tracked."""
    if not git_checkout_top(root):
        pytest.skip(f"{root} is not a git checkout (a copied or unpacked tree): no tracked files to check")
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    files = []
    for path in out.splitlines():
        if RAW_OUTPUT.match(path) or not (root / path).is_file():
            continue
        try:
            (root / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def development_words(text: str) -> list[tuple[int, str, str]]:
    """(line, offending phrase, what to write instead) for every forbidden phrase in `text`."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, instead in FORBIDDEN:
            hits += [(n, m.group(0), instead) for m in pattern.finditer(line)
                     if not (m.group(0).lower().startswith("issue")
                             and re.findall(r"[\w-]+", line[:m.start()])[-1:] in [[name] for name in UPSTREAM])]
    return hits


# The planted phrases are joined from pieces (S, L, SH) so that this file itself stays clean
# for the text checks that grep the tracked files.
S, L, SH = "sess" + "ion", "le" + "ase", "../sha" + "red"


@pytest.mark.parametrize("text, flagged", [
    (f"Measured in {S} 6 on one machine {L}", [f"{S} 6", f"machine {L}"]),
    (f"see evidence/2026-11-21-4xH200-{S}4/ and issue 9's target", [f"{S}4", "issue 9"]),
    (f"run {SH}/gpu/te-install.sh as the brief says", [SH, "brief"]),
    ("@pytest.fixture(scope=\"session\")\ndef pytest_collection_finish(session):", []),
    ("2026-11-22, 4x H200, commit 1ec52e4: 57 of 57", []),
    ("accepted and rounded down (TE issue 1930); see issue 12", ["issue 12"]),
])
def test_development_words_are_flagged(text, flagged):
    assert sorted(phrase for _, phrase, _ in development_words(text)) == sorted(flagged)


def test_tracked_text_speaks_of_the_software_only():
    files = tracked_text_files()
    assert "README.md" in files and "src/cpkit/cli.py" in files
    problems = [f"{path}:{n}: {phrase!r}: write {instead}"
                for path in files for n, phrase, instead in development_words((ROOT / path).read_text(encoding="utf-8"))
                if path != "tests/test_repo_text.py"]
    assert problems == [], "\n".join(problems)


def _copy_of_the_tree(folder: Path) -> Path:
    folder.mkdir()
    for name in ("README.md", "pyproject.toml"):
        (folder / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def test_a_plain_copy_of_the_tree_skips_with_the_reason(tmp_path):
    copy = _copy_of_the_tree(tmp_path / "cpkit")
    with pytest.raises(pytest.skip.Exception, match="is not a git checkout"):
        tracked_text_files(copy)


def test_a_copy_unpacked_inside_another_checkout_skips_too(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    copy = _copy_of_the_tree(tmp_path / "cpkit")
    with pytest.raises(pytest.skip.Exception, match="is not a git checkout"):
        tracked_text_files(copy)


def test_the_checkout_itself_is_read(tmp_path):
    copy = _copy_of_the_tree(tmp_path / "cpkit")
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    subprocess.run(["git", "add", "README.md"], cwd=copy, check=True)
    assert tracked_text_files(copy) == ["README.md"]

"""Every strict xfail in the test suites names the exception it expects (`raises=`): without it a
config error, a crash or a case that did not run counts as the expected failure (the nccl3 loss
matrix cells' CPConfigError did). Grid xfails go through grid_params(xfail=...), which takes an
UpstreamDefect (cpkit.testing.upstream_xfail) and always passes its `raises`."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _strict_xfails_without_raises(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "xfail"):
            continue
        kwargs = {k.arg: k.value for k in node.keywords}
        strict = kwargs.get("strict")
        if isinstance(strict, ast.Constant) and strict.value is True and "raises" not in kwargs:
            lines.append(node.lineno)
    return lines


def test_every_strict_xfail_names_raises():
    found = {str(p.relative_to(ROOT)): lines
             for folder in ("tests", "functional", "src")
             for p in sorted((ROOT / folder).rglob("*.py"))
             if (lines := _strict_xfails_without_raises(p))}
    assert not found, f"strict xfails without raises= (file: lines): {found}"


def test_the_scan_finds_one(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest\n\n@pytest.mark.xfail(strict=True, reason='r')\ndef test_x():\n    pass\n")
    assert _strict_xfails_without_raises(bad) == [3]

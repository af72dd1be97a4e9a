"""`python -m cpkit.cards.render`: rewrite every generated block of claims in the skills
(skills/**/*.md) and the README from the cards' `claims:` (and the README's benchmark table:
src/cpkit/cards/bench_pointers.py), and print the files it changed.

A block starts with the line src/cpkit/cards/claims.py::RENDER_BEGIN (naming the card) and ends
with RENDER_END; `cpkit cards check` reports a block that differs from its card."""

from __future__ import annotations

import sys
from pathlib import Path

from cpkit.cards.bench_pointers import replace_pointers
from cpkit.cards.claims import replace_rendered_blocks
from cpkit.cards.schema import CardError, load_cards
from cpkit.validation.repo import find_repo_root

__all__ = ["render_files", "main"]


def render_files(root: str | Path) -> list[str]:
    """Rewrite the generated claim blocks under `root`; returns the repo-relative files changed.
    Raises CardError when a card does not load."""
    root = Path(root)
    cards, problems = load_cards(root)
    if problems:
        raise CardError(problems)
    files = sorted((root / "skills").rglob("*.md")) + ([root / "README.md"] if (root / "README.md").is_file() else [])
    changed = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        new = replace_pointers(replace_rendered_blocks(text, cards), cards, root)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path.relative_to(root).as_posix())
    return changed


def main(argv: list[str] | None = None) -> int:
    """Rewrite the blocks of the repository around the current directory (or `argv[0]`); 0 when
    done, 1 when a card does not load."""
    argv = sys.argv[1:] if argv is None else argv
    root = find_repo_root(argv[0] if argv else None)
    try:
        changed = render_files(root)
    except CardError as exc:
        print("\n".join(exc.problems))
        return 1
    for rel in changed:
        print(f"rewrote the generated claims in {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

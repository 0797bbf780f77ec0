"""The docs a newcomer reads stay what issue 46 made them: a page per registered method, links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

from sgl_sparse.registry import get_method_class, registered_methods

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _builtin_methods() -> list[str]:
    """sgl_sparse's own methods (other tests register methods of their own in the same process)."""
    return [m for m in registered_methods() if get_method_class(m).__module__.startswith("sgl_sparse.")]


def test_every_registered_method_has_a_page() -> None:
    pages = {p.stem for p in (ROOT / "docs" / "methods").glob("*.md")} - {"README"}
    missing = sorted(set(_builtin_methods()) - pages)
    assert not missing, f"docs/methods/ has no page for {missing}"
    index = (ROOT / "docs" / "methods" / "README.md").read_text()
    assert all(f"({name}.md)" in index for name in _builtin_methods())


def test_relative_links_resolve() -> None:
    broken = []
    for md in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")]:
        for target in LINK.findall(md.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not broken, broken

"""The docs link up: every relative link in README.md and docs/ resolves inside the repository, and every page under
docs/ is reachable from the README."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)  # links inside code are examples, not links


def _links(page: Path) -> list[str]:
    return LINK.findall(CODE.sub("", page.read_text()))


def _target(page: Path, link: str) -> Path | None:
    """The file a relative link points to (its anchor dropped); None for a web link or an anchor on the page."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
        return None
    return (page.parent / link.split("#", 1)[0]).resolve()


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_resolves_inside_the_repository() -> None:
    broken = []
    for page in _pages():
        for link in _links(page):
            target = _target(page, link)
            if target is None:
                continue
            if not target.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {link} leaves the repository")
            elif not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} does not exist")
    assert not broken, "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme() -> None:
    seen, queue = set(), [ROOT / "README.md"]
    while queue:
        page = queue.pop()
        if page in seen:
            continue
        seen.add(page)
        for link in _links(page):
            target = _target(page, link)
            if target is not None and target.suffix == ".md" and target.is_file():
                queue.append(target)
    unreachable = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p not in seen]
    assert not unreachable, f"not linked from the README (directly or through a linked page): {unreachable}"

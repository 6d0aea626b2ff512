"""Every relative link and #anchor in the documentation points to a file and a heading that exist:
README.md, docs/**/*.md, bench/README.md, examples/README.md. Anchors are GitHub's heading slugs.
No network: web links are not followed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "examples" / "README.md",
                *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        marker = re.match(r"^\s*(```+|~~~+)", line)
        if marker:
            if fence is None:
                fence = marker.group(1)[0] * 3
            elif marker.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (link targets and markup dropped), lower case, every
    character but letters, digits, '_', '-' and spaces removed, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """'page:line: target (why)' for each relative link of the page that leads nowhere."""
    broken = []
    for number, line in _prose_lines(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "``", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading with that anchor in {dest.name})")
    return broken


def test_slugs_follow_github():
    assert slug("Faults and bad input: what to expect") == "faults-and-bad-input-what-to-expect"
    assert slug("`megatron-entropy plan`") == "megatron-entropy-plan"
    assert slug("Entropy rules, the entropy controller, rollout correction") == \
        "entropy-rules-the-entropy-controller-rollout-correction"
    assert slug("The quickstart, three losses") == "the-quickstart-three-losses"
    assert slug("bf16 against fp32") == "bf16-against-fp32"
    assert slug("[Rollout servers](rollout_servers.md)") == "rollout-servers"


def test_a_broken_file_link_and_a_broken_anchor_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Title\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n"
                    "[ok](other.md#same-1) [ok](#top) ![img](other.md) [web](https://x/y)\n"
                    "[gone](missing.md) [bad](other.md#same-2) `[code](missing.md)`\n"
                    "```\n[fenced](missing.md)\n```\n")
    assert broken_links(page) == [
        "page.md:4: missing.md (no such file)",
        "page.md:4: other.md#same-2 (no heading with that anchor in other.md)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page), "\n".join(broken_links(page))

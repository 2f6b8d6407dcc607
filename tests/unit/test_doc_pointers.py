"""Every pointer from the code into docs/ leads somewhere, and none into a lab log.

Comments keep the rule and may point to a topic page for the explanation behind it
(`docs/x.md, "Section"`). When a page is split or a section renamed, such a pointer goes stale
without any other test noticing; this one reads every pointer in `nanoddp/` and `tools/` and checks
that the page exists and that each quoted name is one of its headings or a bold entry (`**Name**`)
on it. The reason for a line of code sits beside it as a note, never in a dated log: no pointer
leads into docs/notes/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A page, then optionally (after a comma or an opening parenthesis) one or more quoted names joined
# by "and" or commas; comment markers and line breaks inside are folded away first.
POINTER = re.compile(r'(docs/[\w/.-]+\.md)(?!")(?:[,:]?\s*\(?\s*((?:"[^"]+"(?:\s*(?:and|,)\s*)?)+))?')


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("nanoddp").rglob("*.py"), *ROOT.joinpath("tools").rglob("*.py")])


def _folded(text: str) -> str:
    """Line breaks and the comment markers after them become one space, so a pointer split across
    lines of a comment or docstring reads as one."""
    return re.sub(r"\s*\n\s*#?\s*", " ", text)


def _anchors(page: Path) -> list[str]:
    text = page.read_text()
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return [name.lower() for name in headings + re.findall(r"\*\*([^*]+)\*\*", text)]


def pointers() -> list[tuple[str, str, str | None]]:
    """(source file, page, quoted section or None) for every pointer in the code."""
    found = []
    for source in _sources():
        for match in POINTER.finditer(_folded(source.read_text())):
            page, names = match.group(1), match.group(2)
            rel = str(source.relative_to(ROOT))
            found += [(rel, page, name) for name in re.findall(r'"([^"]+)"', names)] if names else [(rel, page, None)]
    return found


def test_the_code_points_into_the_docs():
    # The check below must have something to check: `nanoddp.comm.plan.plan` cites docs/comm.md's section
    # on the α–β model by name.
    assert any(name for _, _, name in pointers()), "no docs pointer with a section found: the pattern broke"


def test_no_code_points_into_docs_notes():
    into_notes = [f"{source}: {page}" for source, page, _ in pointers() if page.startswith("docs/notes/")]
    assert not into_notes, "state the reason beside the code instead of pointing into a log:\n" + "\n".join(into_notes)


def test_every_pointer_names_a_page_and_section_that_exist():
    broken = []
    for source, page, name in pointers():
        path = ROOT / page
        if not path.is_file():
            broken.append(f"{source}: {page} does not exist")
        elif name is not None and not any(name.lower() in anchor for anchor in _anchors(path)):
            broken.append(f'{source}: {page} has no heading or bold entry "{name}"')
    assert not broken, "stale pointers into docs/:\n" + "\n".join(broken)

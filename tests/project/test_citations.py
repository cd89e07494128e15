"""Every citation of the documentation resolves to a heading in `docs/`.

Code, tests, scripts and the docs themselves cite a document by file and section, e.g.
`kda.md §6b` or ``mx_formats.md`` §2 (…), §2.1, §4-§5: each number must be the number of a
heading of `docs/<name>.md` (`## 6. Title`, `### 10.5 Title`, `### 6b. Title`). A list or range
continues the citation before it: `§7-8` cites 7 and 8, `§1 and §7` cites 1 and 7. A bare
mention of a document (`kda.md`) must name a file in `docs/`. Mentions are lowercase names in
prose: `README.md`, `RESULTS.md`, paths (`src/notes.md`, as the chat format's sources name
other repositories' files) and file names in string literals (`"c.md"`) are not mentions."""

import re
from pathlib import Path

from helpers.paths import REPO_ROOT

SOURCES = ("k31jax", "tests", "benchmarks", "scripts", "convert", "notebooks", "docs", "README.md")
SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".toml", ".txt"}

SECTION = r"\d+[a-z]?(?:\.\d+)*"
# A document name not glued to a word or a path.
DOC = r"(?<![\w./-])([a-z][a-z0-9_]*)\.md\b"
FIRST = re.compile(DOC + rf"`{{0,2}}[ \t]*§({SECTION})")
# Spaces, or a line break into a wrapped comment or docstring line.
GAP = r"[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?"
# What may sit between two sections of one citation: a parenthetical remark, then a list
# separator before the next `§N`, or a range dash before `§N` or a bare `N`.
NEXT = re.compile(rf"(?:{GAP}\([^()\n]*\))?{GAP}(?:(?:,|/|and|or){GAP}§|[-–]{GAP}§?)({SECTION})")
# A name that a quote closes is a file name in a string literal, not a document.
MENTION = re.compile(DOC + r"(?![\"'])")
HEADING = re.compile(rf"^#{{1,6}}[ \t]+({SECTION})\.?(?:[ \t]|$)")
FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def _lines(text: str):
    """(number, start offset, line) for the lines that name a document."""
    start = 0
    for number, line in enumerate(text.split("\n"), 1):
        if ".md" in line:
            yield number, start, line
        start += len(line) + 1


def citations(text: str) -> list[tuple[int, str, str]]:
    """(line, document, section) for every section cited in `text`. The document's name and
    first section share a line; a list or range may wrap onto the next one."""
    found = []
    for number, start, line in _lines(text):
        for match in FIRST.finditer(text, start, start + len(line)):
            name, end = match.group(1), match.end()
            found.append((number, name, match.group(2)))
            while nxt := NEXT.match(text, end):
                found.append((number + text.count("\n", match.end(), nxt.start(1)), name, nxt.group(1)))
                end = nxt.end()
    return found


def mentions(text: str) -> list[tuple[int, str]]:
    """(line, document) for every document named in `text`."""
    return [(number, m.group(1)) for number, start, line in _lines(text)
            for m in MENTION.finditer(text, start, start + len(line))]


def headings(text: str) -> set[str]:
    """The section numbers of a markdown document's headings, outside fenced blocks."""
    numbers, fence = set(), None
    for line in text.splitlines():
        if m := FENCE.match(line):
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
        elif fence is None and (h := HEADING.match(line)):
            numbers.add(h.group(1))
    return numbers


def source_files(root: Path):
    for name in SOURCES:
        path = root / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*"))
                        if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts)


def unresolved(root: Path) -> list[str]:
    """`file:line: problem` for each citation or mention under `root` that `root/docs` lacks."""
    docs: dict[str, set[str] | None] = {}

    def sections(name: str) -> set[str] | None:
        if name not in docs:
            path = root / "docs" / f"{name}.md"
            docs[name] = headings(path.read_text(encoding="utf-8")) if path.is_file() else None
        return docs[name]

    problems = []
    for path in source_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(root)
        for line, name in mentions(text):
            if sections(name) is None:
                problems.append(f"{where}:{line}: {name}.md (no docs/{name}.md)")
        for line, name, section in citations(text):
            numbers = sections(name)
            if numbers is not None and section not in numbers:
                problems.append(f"{where}:{line}: {name}.md §{section} (docs/{name}.md has no heading {section})")
    return problems


def test_every_citation_resolves():
    problems = unresolved(REPO_ROOT)
    assert not problems, "unresolved documentation citations:\n" + "\n".join(problems)


S = "\u00a7"  # written out so that the samples below are not citations of this file


def test_citation_forms_are_parsed():
    text = (f"Spec: ``mx_formats.md`` {S}2 (OCP conversion), {S}2.1 (rules), {S}4-{S}5 (XLA).\n"
            f"(architecture.md {S}7-8, kda.md {S}6b; attention.md {S}1 and {S}7) K3 report {S}2.3.3\n"
            f"see vision.md {S}10.5. then {S}9\n# jax_notes.md {S}7,\n# {S}8: and {S}2")
    assert citations(text) == [
        (1, "mx_formats", "2"), (1, "mx_formats", "2.1"), (1, "mx_formats", "4"), (1, "mx_formats", "5"),
        (2, "architecture", "7"), (2, "architecture", "8"), (2, "kda", "6b"),
        (2, "attention", "1"), (2, "attention", "7"), (3, "vision", "10.5"),
        (4, "jax_notes", "7"), (5, "jax_notes", "8")]
    assert [name for _, name in mentions(text + '\nREADME.md RESULTS.md shared/spec/x.md ("c.md")')] == [
        "mx_formats", "architecture", "kda", "attention", "vision", "jax_notes"]


def test_headings_are_numbered_sections_outside_fences():
    text = "# Title\n## 2. Two\n### 2.2 Sub\n### 6b. Lettered\n```\n## 9. In a fence\n```\n#### Notes\n"
    assert headings(text) == {"2", "2.2", "6b"}


def test_checker_reports_a_made_up_citation(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kda.md").write_text("# KDA\n## 6. Numerics\n### 6b. Tiling\n")
    (tmp_path / "k31jax").mkdir()
    (tmp_path / "k31jax" / "mod.py").write_text(
        f'"""kda.md {S}6, {S}6b.\n\nSee kda.md {S}99 and vision.md {S}1; HISTORY.md."""\n')
    (tmp_path / "README.md").write_text("The RESULTS.md table.\n")
    assert unresolved(tmp_path) == [
        "k31jax/mod.py:3: vision.md (no docs/vision.md)",
        f"k31jax/mod.py:3: kda.md {S}99 (docs/kda.md has no heading 99)"]

"""The layout of `benchmarks/RESULTS.md`, which `_harness.record` writes and the tests check.

One `## <benchmark>` section per script in `benchmarks/` (the file name without `.py`): what it
measures, what the current figures say, how to reproduce them, and the latest recorded blocks.
A block is what one `--record` run printed, between `<!-- bench:KEY -->` and
`<!-- /bench:KEY -->` lines; KEY is the benchmark's name, or `<benchmark>_<part>` for a script
that records parts apart (`scan_wide`, `serve_startup`). Recording replaces the block of the
same KEY inside its section and leaves the section's text as it is; a missing block is added at
the end of its section, a missing section at the end of the file. Superseded figures are moved
to `benchmarks/HISTORY.md` by hand.

No JAX here: the tests read and write results files without starting a backend.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

_BEGIN = re.compile(r"<!-- bench:(\S+) -->")
_END = re.compile(r"<!-- /bench:(\S+) -->")


def block_key(benchmark: str, part: str | None = None) -> str:
    return benchmark if part is None else f"{benchmark}_{part}"


def block(key: str, lines: Sequence[str]) -> list[str]:
    """`lines` between the begin and end markers of block `key`."""
    return [f"<!-- bench:{key} -->", *lines, f"<!-- /bench:{key} -->"]


@dataclasses.dataclass
class Section:
    title: str  # the heading without its "## "
    start: int  # index of the heading line
    end: int  # index one past the section's last line
    blocks: dict[str, tuple[int, int]]  # block key -> indices of its begin and end marker lines


def sections(lines: Sequence[str], name: str = "RESULTS.md") -> list[Section]:
    """The `## ` sections of a results file's lines, in order. A `## ` line inside a code fence
    or a recorded block is text (the train and serve blocks print such lines). Raises
    ValueError, naming the file and line, on a repeated heading or block, a block outside any
    section, or a block left open."""
    found: list[Section] = []
    where: dict[str, str] = {}  # block key -> title of the section holding it
    fence, open_key, open_at = False, None, 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if open_key is not None:
            end = _END.fullmatch(stripped)
            if end and end.group(1) == open_key:
                found[-1].blocks[open_key] = (open_at, i)
                open_key = None
            continue
        if stripped.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        begin = _BEGIN.fullmatch(stripped)
        if begin:
            open_key, open_at = begin.group(1), i
            if not found:
                raise ValueError(f"{name}:{i + 1}: block `{open_key}` comes before the first `## ` section")
            if open_key in where:
                raise ValueError(f"{name}:{i + 1}: block `{open_key}` appears twice (first in '## {where[open_key]}')")
            where[open_key] = found[-1].title
        elif _END.fullmatch(stripped):
            raise ValueError(f"{name}:{i + 1}: `{stripped}` closes no open block")
        elif line.startswith("## "):
            title = line[3:].strip()
            if any(s.title == title for s in found):
                raise ValueError(f"{name}:{i + 1}: section '## {title}' appears twice")
            if found:
                found[-1].end = i
            found.append(Section(title, i, len(lines), {}))
    if open_key is not None:
        raise ValueError(f"{name}:{open_at + 1}: block `{open_key}` is never closed (`<!-- /bench:{open_key} -->`)")
    return found


def put_block(text: str, benchmark: str, key: str, block_lines: Sequence[str], name: str = "RESULTS.md") -> str:
    """`text` with block `key` (its marker lines included in `block_lines`) in the section
    `## benchmark`: replacing the block there, else added at the section's end; the section is
    added at the end of the file when missing."""
    lines = text.splitlines()
    found = sections(lines, name)
    home = next((s for s in found if s.title == benchmark), None)
    stray = next((s for s in found if key in s.blocks and s is not home), None)
    if stray is not None:
        raise ValueError(f"{name}: block `{key}` is in section '## {stray.title}', not in '## {benchmark}': "
                         f"move it there first")
    if home is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", f"## {benchmark}", "", *block_lines]
    elif key in home.blocks:
        begin, end = home.blocks[key]
        lines[begin:end + 1] = block_lines
    else:
        at = home.end
        while at > home.start + 1 and not lines[at - 1].strip():
            at -= 1
        spacer = [""] if at == home.end < len(lines) else []  # the next heading would follow at once
        lines[at:at] = ["", *block_lines, *spacer]
    return "\n".join(lines) + "\n"

"""The README's tool output is the tool's: every `$ k31jax ...` example block, the planner's
per-device table and the parameter-count table are recomputed by running the commands, so the
figures cannot drift from the code again.

An example block is one or more `$ k31jax ARGS` lines, each followed by the exact stdout of
that command; a line `...` stands for any number of lines (a shortened output).
"""

import re
import shlex

import pytest

from helpers.paths import REPO_ROOT
from k31jax.cli import main
from k31jax.distributed import DEVICES

README = (REPO_ROOT / "README.md").read_text()
ELIDED = "..."


def run(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0, argv
    return capsys.readouterr().out


def example_commands() -> list[tuple[str, list[str]]]:
    """(command, expected lines) of every `$ k31jax` line in the README's fenced blocks."""
    found = []
    for block in re.findall(r"^```\n(\$ k31jax .*?)^```$", README, re.S | re.M):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *lines = part.rstrip("\n").split("\n")
            found.append((command, lines))
    return found


def matches(expected: list[str], output: str) -> bool:
    pattern = "".join(r"(?:.*\n)*?" if line == ELIDED else re.escape(line.rstrip()) + r"[ \t]*\n"
                      for line in expected)
    return re.fullmatch(pattern, output if output.endswith("\n") else output + "\n") is not None


EXAMPLES = example_commands()


def test_the_readme_has_planner_examples():
    assert sum(cmd.startswith("k31jax plan") for cmd, _ in EXAMPLES) >= 6


@pytest.mark.parametrize("command, expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_example_output_is_what_the_command_prints(command, expected, capsys):
    output = run(shlex.split(command)[1:], capsys)
    assert matches(expected, output), f"README shows for `{command}`:\n" + "\n".join(expected) + \
        f"\n\nbut it prints:\n{output}"


def test_matches_understands_elisions():
    assert matches(["a", ELIDED, "d"], "a\nb\nc\nd\n") and matches(["a", ELIDED], "a\nb\n")
    assert not matches(["a", "d"], "a\nb\nd\n") and not matches(["a", ELIDED, "x"], "a\nb\n")


# ---- the planner's per-device table ---------------------------------------------------
TABLE_HEAD = "| hardware | mesh (rules) | weights | caches | prefill act. | total / device |"
COLUMNS = {  # column -> the plan lines it adds up
    "weights": ("weights: routed experts", "weights: everything else"),
    "caches": ("MLA latent cache", "indexer key cache", "KDA recurrent state", "KDA conv state",
               "cache validity mask"),
    "prefill act.": ("AttnRes block state", "peak activations"),
    "total": ("total",),
}
DEVICE_BY_NAME = {label.removeprefix("NVIDIA "): key for key, (label, _) in DEVICES.items()}


def plan_columns(output: str) -> dict[str, float]:
    """GB per device of each table column, from the bytes column of `k31jax plan`."""
    rows = {}
    for line in output.splitlines():
        m = re.match(r"(.*?)\s{2,}([\d,]+)\s+[\d.,]+$", line)
        if m:
            rows[m[1]] = int(m[2].replace(",", ""))
    return {col: round(sum(b for label, b in rows.items() if label.startswith(starts)) / 1e9, 1)
            for col, starts in COLUMNS.items()}


def table_rows() -> list[dict]:
    lines = README[README.index(TABLE_HEAD):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        hardware, mesh, *figures = [cell.strip().replace("*", "") for cell in line.strip("|").split("|")]
        count, name = re.match(r"(\d+) x (.+?)(?: \(|$)", hardware).groups()
        mesh, rules = re.fullmatch(r"`(\S+)` \(`(\w+)`\)", mesh).groups()
        rows.append(dict(count=int(count), device=DEVICE_BY_NAME[name], mesh=mesh, rules=rules,
                         figures=dict(zip(COLUMNS, map(float, figures)))))
    return rows


def test_planner_table_figures_are_the_tools(capsys):
    template = re.search(r"each row is `(k31jax plan [^`]*)`", " ".join(README.split()))[1]
    rows = table_rows()
    assert len(rows) >= 5
    for row in rows:
        argv = shlex.split(template.replace("MESH", row["mesh"]).replace("RULES", row["rules"])
                           .replace("DEVICE", row["device"]))[1:]
        output = run(argv, capsys)
        devices = re.search(r"\((\d+) devices?, rules (\w+)\)", output).groups()
        assert (int(devices[0]), devices[1]) == (row["count"], row["rules"]), (row, output.splitlines()[0])
        assert plan_columns(output) == row["figures"], (row, output)


# ---- parameter counts -----------------------------------------------------------------
def test_sizes_table_is_what_info_prints(capsys):
    section = README[README.index("## Sizes"):]
    rows = re.findall(r"^\| `(\w+)`[^|]*\| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", section, re.M)
    assert {name for name, *_ in rows} >= {"k3", "k31_pro"}
    for name, total, active, size in rows:
        output = run(["info", "--config", name], capsys)
        shown = [re.search(rf"^{label}\s+([\d,]+)", output, re.M)[1]
                 for label in (r"text model total", r"active per token \(excl\. embedding\)",
                               r"bytes, MXFP4 experts \+ bf16 rest")]
        assert shown == [total, active, size], name

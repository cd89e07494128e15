"""benchmarks/RESULTS.md: one section per benchmark, and `--record` writing a run into its
benchmark's section in place (`benchmarks/_harness.record`, the layout in `benchmarks/_results.py`)."""

import importlib
import re
import sys
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _results  # noqa: E402

# Sections of RESULTS.md that no script in benchmarks/ records, and the script they name instead.
OTHER_SECTIONS = {"embedded default model": "scripts/train_embedded_model.py"}


@pytest.fixture(scope="module")
def harness():
    """`benchmarks/_harness.py`, imported without tuning this test process's malloc (the import
    applies `tune_host_malloc` unless K31JAX_HOST_MALLOC=0)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K31JAX_HOST_MALLOC", "0")
        return importlib.import_module("_harness")


class _Session:
    """What `record` reads of a `_harness.Session`, without measuring the machine."""

    def __init__(self, stamp: str, loaded: bool = False):
        self.stamp, self.loaded, self.load_after, self.cores = stamp, loaded, 1.0, 2

    def finish(self):
        return self

    def header(self) -> str:
        return self.stamp


def _section_text(path: Path, title: str) -> str:
    lines = path.read_text().splitlines()
    section = next(s for s in _results.sections(lines) if s.title == title)
    return "\n".join(lines[section.start:section.end])


def test_record_twice_keeps_one_section_with_the_latest_block_and_its_text(tmp_path, harness):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nIntro.\n\n## forward\n\nWhat forward measures.\n\n"
                       "Reproduce: `benchmarks/forward.py --record`.\n\n## mx\n\nThe mx text.\n")
    for run in ("run 1", "run 2"):
        assert harness.record("forward", [f"figures of {run}", "## a line the script prints"], _Session(run),
                              results=results, command="benchmarks/forward.py --batch 1")
    text = results.read_text()
    assert [s.title for s in _results.sections(text.splitlines())] == ["forward", "mx"]
    assert text.count("<!-- bench:forward -->") == 1 and text.count("<!-- /bench:forward -->") == 1
    forward = _section_text(results, "forward")
    assert "figures of run 2" in forward and "run 1" not in text
    assert "`forward` (`benchmarks/forward.py --batch 1`): run 2" in forward
    # the section's own text stays, before the block; the next section is untouched
    assert forward.index("What forward measures.") < forward.index("Reproduce:") < forward.index("<!-- bench:forward -->")
    assert _section_text(results, "mx") == "## mx\n\nThe mx text."


def test_record_adds_a_part_to_its_section_and_a_missing_section(tmp_path, harness):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## scan\n\nThe scan text.\n\n## mx\n\nThe mx text.\n")
    harness.record("scan", ["narrow"], _Session("a"), results=results, command="benchmarks/scan.py")
    harness.record("scan", ["wide"], _Session("b"), part="wide", results=results, command="benchmarks/scan.py --shape wide")
    harness.record("cpu_gemm", ["gemm"], _Session("c"), results=results, command="benchmarks/cpu_gemm.py")
    found = _results.sections(results.read_text().splitlines())
    assert [(s.title, list(s.blocks)) for s in found] == [("scan", ["scan", "scan_wide"]), ("mx", []),
                                                        ("cpu_gemm", ["cpu_gemm"])]
    assert _section_text(results, "scan").startswith("## scan\n\nThe scan text.\n\n<!-- bench:scan -->")
    assert "\n\n## mx\n\nThe mx text.\n\n## cpu_gemm\n\n<!-- bench:cpu_gemm -->" in results.read_text()


def test_record_refuses_a_loaded_run_and_a_block_in_another_section(tmp_path, harness):
    results = tmp_path / "RESULTS.md"
    text = "# Benchmark results\n\n## mx\n\n<!-- bench:forward -->\nold\n<!-- /bench:forward -->\n"
    results.write_text(text)
    assert not harness.record("mx", ["busy"], _Session("loaded", loaded=True), results=results, command="x")
    assert results.read_text() == text
    with pytest.raises(ValueError, match=r"block `forward` is in section '## mx', not in '## forward'"):
        harness.record("forward", ["new"], _Session("quiet"), results=results, command="x")


@pytest.mark.parametrize("text, error", [
    ("## a\n\n## a\n", r":3: section '## a' appears twice"),
    ("## a\n<!-- bench:a -->\nx\n", r":2: block `a` is never closed"),
    ("## a\n<!-- bench:a -->\n<!-- /bench:a -->\n## b\n<!-- bench:a -->\n<!-- /bench:a -->\n",
     r":5: block `a` appears twice \(first in '## a'\)"),
    ("intro\n<!-- bench:a -->\n<!-- /bench:a -->\n", r":2: block `a` comes before the first `## ` section"),
])
def test_sections_reject_an_ambiguous_file(text, error):
    with pytest.raises(ValueError, match=error):
        _results.sections(text.splitlines())


def test_results_md_has_one_section_per_benchmark():
    results = BENCHMARKS / "RESULTS.md"
    lines = results.read_text().splitlines()
    found = _results.sections(lines, name=str(results))  # raises on a repeated heading or block
    titles = [s.title for s in found]
    assert len(titles) == len(set(titles))
    scripts = {p.stem: p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert set(titles) == set(scripts) | set(OTHER_SECTIONS)
    for section in found:
        text = "\n".join(lines[section.start:section.end])
        names = OTHER_SECTIONS.get(section.title) or f"benchmarks/{section.title}.py"
        assert names in text, f"## {section.title} does not say how to reproduce it ({names})"
        assert all(re.fullmatch(rf"{re.escape(section.title)}(_\w+)?", key) for key in section.blocks), \
            f"## {section.title} holds another benchmark's block: {list(section.blocks)}"
        if section.title in scripts and "from _harness import" in scripts[section.title].read_text():
            assert section.blocks, f"## {section.title} has no recorded block"
    history = BENCHMARKS / "HISTORY.md"
    past = _results.sections(history.read_text().splitlines(), name=str(history))
    assert not any(s.blocks for s in past), "HISTORY.md holds a live block: --record writes RESULTS.md only"
    assert {s.title for s in past} <= set(titles)


def test_mentions_of_results_md_sections_name_one():
    """README and the library cite RESULTS.md sections by name ("serve", "## scan"): each names a
    section there."""
    root = BENCHMARKS.parent
    titles = {s.title for s in _results.sections((BENCHMARKS / "RESULTS.md").read_text().splitlines())}
    cited = {}
    for path in [root / "README.md", *sorted((root / "k31jax").rglob("*.py"))]:
        for name in re.findall(r'RESULTS\.md\W{0,6}"(?:## )?([^"]+)"', path.read_text()):
            cited.setdefault(name, path.relative_to(root))
    assert cited, "no citation found: the pattern no longer matches how they are written"
    assert {name: str(path) for name, path in cited.items() if name not in titles} == {}


def test_alternate_reverses_the_order_every_other_round(harness):
    calls = []

    def side(name):
        def run():
            calls.append(name)
            return {"seconds": float(len(calls))}
        return run

    stats = harness.alternate({"a": side("a"), "b": side("b")}, repeats=4)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then A B, B A, ...
    a, b = stats["a"]["seconds"], stats["b"]["seconds"]  # a ran as calls 3, 6, 7, 10; b as 4, 5, 8, 9
    assert (a.median, a.low, a.high, a.n) == (6.5, 3.0, 10.0, 4) and (b.median, b.low, b.high) == (6.5, 4.0, 9.0)
    with pytest.raises(ValueError, match="repeats=2"):
        harness.alternate({"a": side("a")}, repeats=2)

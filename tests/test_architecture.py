"""The architecture contract: packages on layers, imports only downward, no import cycles.

The layers live in pyproject.toml (`[tool.importlinter]`) and are checked by import-linter;
the cycle check counts every import, function-level and TYPE_CHECKING ones included."""

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([str(LINT), "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_layers_contract_holds():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("module,bad_import", [
    ("config.py", "from k31jax.generate import Engine"),          # the bottom layer reaching the top
    ("kernels/kda_chunk/ops.py", "from k31jax.ops import _kda"),   # a kernel importing the ops it serves
    ("sharding/_rules.py", "from k31jax.nn import K31ForCausalLM"),
])
def test_layers_contract_fails_on_an_upward_import(tmp_path, module, bad_import):
    """The same contract on a copy of the package with one upward import added is broken."""
    shutil.copytree(ROOT / "k31jax", tmp_path / "k31jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "k31jax" / module
    target.write_text(target.read_text() + f"\n\ndef _upward():\n    {bad_import}\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "BROKEN" in run.stdout and bad_import.split()[1] in run.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("k31jax", include_external_packages=False)
    assert len(graph.modules) > 80
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_convert_is_not_an_installed_package(tmp_path):
    """`convert/` holds runnable scripts only; the library is `k31jax.conversion`."""
    run = subprocess.run([sys.executable, "-c", "import convert"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode != 0 and "No module named 'convert'" in run.stderr
    for script in ("convert.py", "export.py", "make_synthetic_release.py"):
        run = subprocess.run([sys.executable, str(ROOT / "convert" / script), "--help"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    run = subprocess.run([str(LINT.parent / "k31jax"), "convert", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "usage: k31jax convert" in run.stdout, run.stderr

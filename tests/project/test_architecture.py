"""The architecture contract: packages on layers, imports only downward, no import cycles,
and private modules that stay private.

The layers live in pyproject.toml (`[tool.importlinter]`) and are checked by import-linter;
the cycle check counts every import, function-level and TYPE_CHECKING ones included.

Privacy: a module or name whose own segment starts with one underscore (`k31jax.ckpt._plan`,
`from k31jax.nn import _helper`) belongs to its package (`k31jax.ckpt`, the first level under
`k31jax`); code outside that package imports the package's public names only. The rule holds
for the library, `benchmarks/`, `scripts/`, `convert/` and the notebooks' code cells. Tests may
reach private modules: they check internals against their float64 references."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from helpers.paths import REPO_ROOT

LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([str(LINT), "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_layers_contract_holds():
    run = _lint(REPO_ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("module,bad_import", [
    ("config/_model_config.py", "from k31jax.generate import Engine"),  # the bottom layer reaching the top
    ("kernels/kda_chunk/ops.py", "from k31jax.ops import _kda"),   # a kernel importing the ops it serves
    ("sharding/_rules.py", "from k31jax.nn import K31ForCausalLM"),
])
def test_layers_contract_fails_on_an_upward_import(tmp_path, module, bad_import):
    """The same contract on a copy of the package with one upward import added is broken."""
    shutil.copytree(REPO_ROOT / "k31jax", tmp_path / "k31jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "k31jax" / module
    target.write_text(target.read_text() + f"\n\ndef _upward():\n    {bad_import}\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "BROKEN" in run.stdout and bad_import.split()[1] in run.stdout


PRIVACY_ROOTS = ("k31jax", "benchmarks", "scripts", "convert", "notebooks")


def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not segment.startswith("__")


def _owner(module: str) -> str | None:
    """The package a `k31jax.*` module belongs to (`k31jax.nn._model` -> `nn`); None outside k31jax."""
    parts = module.split(".")
    return parts[1] if parts[0] == "k31jax" and len(parts) > 1 else None


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    """(dotted name of a file under `root`, whether it is a package's `__init__`)."""
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_init = parts[-1] == "__init__"
    if is_init:
        parts = parts[:-1]
    return ".".join(parts), is_init


def _imports(tree: ast.AST, module: str, is_init: bool):
    """(line, imported module, imported names) of every import in a module, relative ones resolved."""
    package = module if is_init else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            yield node.lineno, base, tuple(a.name for a in node.names)


def private_reaches(root: Path) -> list[str]:
    """`file:line: what` for every import of another package's private module or name under
    `root` (a checkout: the folders of `PRIVACY_ROOTS`)."""
    found = []
    for top in PRIVACY_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if "__pycache__" in path.parts or path.suffix not in (".py", ".ipynb"):
                continue
            if path.suffix == ".ipynb":
                cells = json.loads(path.read_text())["cells"]
                sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
                module, is_init = "notebook", False
            else:
                sources = [path.read_text()]
                module, is_init = _module_name(root, path)
            mine = _owner(module)
            for source in sources:
                try:
                    tree = ast.parse(source)
                except SyntaxError:  # a notebook cell with shell magics
                    continue
                for line, imported, names in _imports(tree, module, is_init):
                    owner = _owner(imported)
                    if owner is None or owner == mine:
                        continue
                    targets = [imported, *(f"{imported}.{n}" for n in names)]
                    bad = [t for t in targets if any(_is_private(s) for s in t.split(".")[1:])]
                    if bad:
                        found.append(f"{path.relative_to(root)}:{line}: {bad[-1]} is private to k31jax.{owner}")
    return found


def test_no_package_imports_another_packages_private_names():
    assert private_reaches(REPO_ROOT) == []


@pytest.mark.parametrize("module,bad_import", [
    ("nn/_ffn.py", "from ..ops._moe import permute"),              # relative, into a private module
    ("generate/_engine.py", "from k31jax.ckpt import _plan"),     # a private module as a name
    ("train/_trainer.py", "from ..quant import _formats"),
])
def test_privacy_contract_fails_on_a_private_import(tmp_path, module, bad_import):
    """The same check on a copy of the checkout with one private import added reports exactly it."""
    for top in PRIVACY_ROOTS:
        shutil.copytree(REPO_ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "*.npz"))
    target = tmp_path / "k31jax" / module
    text = target.read_text()
    target.write_text(text + f"\n\ndef _reach():\n    {bad_import}\n")
    line = len((text + "\n\ndef _reach():").splitlines()) + 1
    found = private_reaches(tmp_path)
    assert len(found) == 1 and found[0].startswith(f"k31jax/{module}:{line}: "), found


def test_privacy_allows_a_packages_own_private_modules(tmp_path):
    (tmp_path / "k31jax" / "ops").mkdir(parents=True)
    (tmp_path / "k31jax" / "ops" / "__init__.py").write_text("from ._moe import permute\nfrom . import _kda\n")
    (tmp_path / "k31jax" / "kernels" / "kda").mkdir(parents=True)
    (tmp_path / "k31jax" / "kernels" / "kda" / "ops.py").write_text("from .._common import call\n")
    assert private_reaches(tmp_path) == []


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
    """`convert/` holds runnable scripts only; the library is `k31jax.ckpt`."""
    run = subprocess.run([sys.executable, "-c", "import convert"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode != 0 and "No module named 'convert'" in run.stderr
    for script in ("convert.py", "export.py", "make_synthetic_release.py"):
        run = subprocess.run([sys.executable, str(REPO_ROOT / "convert" / script), "--help"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    run = subprocess.run([str(LINT.parent / "k31jax"), "convert", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "usage: k31jax convert" in run.stdout, run.stderr

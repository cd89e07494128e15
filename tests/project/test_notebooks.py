"""The notebooks run top to bottom (CI executes them; outputs are not compared)."""

import pytest

from helpers.paths import REPO_ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("K31JAX_NOTEBOOK_STEPS", "3")  # the training notebooks' step count (the kernel inherits it)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "qat_finetune.ipynb", "sharded_inference.ipynb"} <= {p.name for p in NOTEBOOKS}

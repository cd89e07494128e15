"""What the tests share, imported as `helpers.<module>` from every test folder
(`pythonpath = ["tests"]` in pyproject.toml's `[tool.pytest.ini_options]`):

- `paths`: the repository, the golden files, the shared data and the subprocess scripts;
- `model`: tiny configs, randomized weights, abstract modules, the relative error measure;
- `processes`: the environment of the processes a test starts (the `k31jax` CLI, workers);
- `release`: random models written in the release layout, and surgery on release folders;
- `faults`: the CLI run in-process under a fault, and the checks every fault case makes;
- `vision`: a tiny MoonViT config, its random release-named weights, random images.

This package imports nothing itself: `conftest.py` reads `processes` before JAX is imported.
"""

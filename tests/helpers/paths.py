"""Where the tests' data lives, so that no test counts its own folder's depth."""

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
# Checked-in golden outputs of peer implementations, and the scripts that made them.
GOLDEN_DIR = TESTS_DIR / "golden"
# Scripts the tests run as separate processes.
MULTIPROCESS_DIR = TESTS_DIR / "multiprocess"
# Data shared by the workspace next to the checkout (the K3 release golden, the spec's inventory).
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


def stdlib_corpus(folder: Path, names: tuple[str, ...]) -> Path:
    """`folder` holding copies of the Python standard library sources `names` (real text every
    machine has)."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in names:
        (folder / name).write_text((stdlib / name).read_text())
    return folder

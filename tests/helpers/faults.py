"""Helpers for the fault tests: hashes of whole folders (SRC must be untouched), the CLI run
in-process with its exit code and stderr lines, and the checks every fault case makes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

from k31jax.cli import main as cli_main

LOCK_SUFFIX = ".k31jax.lock"
TEMP_RE = re.compile(r"^\..*\.k31jax-tmp-\d+-[0-9a-f]{8}$")


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of the bytes (files), the target (links) or 'dir' (folders)."""
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in dirnames + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run(capsys, *argv) -> tuple[int, list[str]]:
    """`k31jax ARGV` in-process: (exit code, the non-empty stderr lines)."""
    capsys.readouterr()
    code = cli_main([*map(str, argv), "--no-progress"])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def run_with_output(capsys, *argv) -> tuple[int, str, list[str]]:
    """`k31jax ARGV` in-process: (exit code, stdout, the non-empty stderr lines)."""
    capsys.readouterr()
    code = cli_main([*map(str, argv), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def run_bare(capsys, *argv) -> tuple[int, list[str]]:
    """`k31jax ARGV` for commands without --no-progress: (exit code, stderr lines); an
    argparse exit (SystemExit) counts as its code."""
    capsys.readouterr()
    try:
        code = cli_main([*map(str, argv)])
    except SystemExit as e:
        code = e.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def one_error(lines: list[str], command: str, *fragments: str) -> str:
    """stderr is exactly one `k31jax <command>: error: ...` line holding every fragment."""
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"k31jax {command}: error: "), line
    assert "Traceback" not in line
    for f in fragments:
        assert f in line, f"{f!r} not in {line!r}"
    return line


def leftovers(parent: Path) -> list[str]:
    """Temporary folders and lock files of any run left in `parent`."""
    return sorted(n for n in os.listdir(parent) if TEMP_RE.match(n) or n.endswith(LOCK_SUFFIX))


def assert_clean(parent: Path, expected: set[str]) -> None:
    """`parent` holds exactly `expected`: nothing half-written published, no temp tree, no lock."""
    assert set(os.listdir(parent)) == expected, (sorted(os.listdir(parent)), leftovers(parent))


@contextlib.contextmanager
def hold_lock(dst: Path):
    """Hold DST's lock the way a running conversion does (flock + our pid in the file)."""
    path = dst.parent / f".{dst.name}{LOCK_SUFFIX}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.unlink(path)
        os.close(fd)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def make_temp_tree(parent: Path, name: str, pid: int) -> Path:
    """A temporary folder as a run with `pid` leaves it when killed mid-conversion."""
    box = parent / f".{name}.k31jax-tmp-{pid}-0123abcd"
    (box / "checkpoint.partial_save" / "state").mkdir(parents=True)
    (box / "checkpoint.partial_save" / "state" / "chunk").write_bytes(b"\0" * 4096)
    (box / "pid").write_text(f"{pid}\n")
    return box

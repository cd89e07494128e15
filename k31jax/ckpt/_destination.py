"""Safe destinations for `convert` and `export`: nothing lost, nothing half-written published.

`atomic_destination(dst, src=..., ...)` is the one way both commands write their output:

- DST may not be SRC, lie inside it or contain it (symlinks, `..` and bind mounts resolved):
  `SourceOverlapError`, before anything is written.
- An exclusive `flock` on `.<name>.k31jax.lock` in DST's parent is held for the whole run, so
  a second run into the same DST fails at once, naming the holder's pid.
- Everything is written into a temporary folder with a generated, glob-safe name in DST's
  parent (`.<label>.k31jax-tmp-<pid>-<hex>/<stage>`): Orbax globs for its pending folders
  under the path it is given, so DST's own name (`[`, `*`, `?`, a leading dot) never reaches
  it (glob characters in the parent folders are handled by `_orbax_save.literal_root`).
- Publishing is one atomic rename that never replaces anything without `overwrite=True`
  (`renameat2(RENAME_NOREPLACE)`), and with it replaces only what `replaceable` recognises
  (a k31jax checkpoint, an exported release folder) or an empty folder, atomically swapped
  (`RENAME_EXCHANGE`). A DST that appeared meanwhile is checked again, never deleted blindly.
- On any failure, interruption (`stop` set by a signal handler) or disk full the temporary
  folder is removed after the caller's writers have stopped; a temporary folder left by a
  killed run (its pid gone and its pid file unlocked) is removed by the next run into the
  same parent, with one line on stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import re
import shutil
import sys
import threading
import uuid
from pathlib import Path
from typing import Callable

from ._transforms import CheckpointError
from ._progress import human_bytes

# `.<label>.k31jax-tmp-<pid>-<hex8>`; `-export-tmp` is what earlier versions' export left.
_TEMP_RE = re.compile(r"^\..*\.k31jax(?:-export)?-tmp-(\d+)-[0-9a-f]{8}$")
_PID_FILE = "pid"
_NAME_MAX = 255
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# TensorStore reports a failed write as a ValueError whose text carries the OS error.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", f"os_error_code='{errno.ENOSPC}'",
                   f"os_error_code='{errno.EDQUOT}'")


class DestinationError(CheckpointError):
    """DST cannot be written as asked: it exists, another run holds it, or it appeared meanwhile."""


class SourceOverlapError(DestinationError):
    """DST is SRC, lies inside it or contains it (a usage error: exit code 2 on the command line)."""


class DiskFullError(CheckpointError):
    """The file system of DST ran out of space (or quota) while the output was written."""


class Interrupted(Exception):
    """The run was asked to stop (`stop` was set, e.g. by SIGINT / SIGTERM); nothing was published."""


def check_stop(stop: threading.Event | None) -> None:
    """Raise `Interrupted` if `stop` is set: called by the writers at their safe points."""
    if stop is not None and stop.is_set():
        raise Interrupted("stopped on request before anything was published")


def _absolute(path: str | os.PathLike) -> Path:
    """`path` made absolute with `..` resolved through the real parent (symlinks followed for
    the parent, not for the last component, which is what a rename replaces)."""
    p = Path(os.path.abspath(path))
    if not p.name:
        raise DestinationError(f"{p}: the root folder cannot be a destination")
    return p.parent.resolve() / p.name


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_at_or_under(path: Path, top: Path) -> bool:
    """True when `path` is `top` or lies under it, comparing resolved paths and, for folders
    that exist, device and inode (bind mounts, hard-linked names)."""
    if path == top or top in path.parents:
        return True
    return any(_same_file(p, top) for p in (path, *path.parents) if os.path.lexists(p))


def check_overlap(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Refuse a DST that is SRC, lies inside it or contains it (`SourceOverlapError`)."""
    src_real, dst_abs = Path(src).resolve(), _absolute(dst)
    dst_real = dst_abs.resolve()  # where a symlinked DST points
    shown = f"{dst_abs}" if dst_real == dst_abs else f"{dst_abs} (a link to {dst_real})"
    if _same_file(dst_real, src_real) or dst_real == src_real:
        raise SourceOverlapError(f"destination {shown} is the source folder {src_real}; choose another DST")
    if _is_at_or_under(dst_real, src_real):
        raise SourceOverlapError(f"destination {shown} lies inside the source folder {src_real}; "
                                 "choose a DST outside it")
    if _is_at_or_under(src_real, dst_real):
        raise SourceOverlapError(f"destination {shown} contains the source folder {src_real}; "
                                 "replacing it would delete the source")


def _describe(path: Path) -> str:
    entries = sorted(os.listdir(path))
    shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
    return f"it holds {shown}"


def check_destination(dst: Path, *, overwrite: bool, replaceable: Callable[[Path], bool], what: str) -> bool:
    """Whether `dst` exists now, or a `DestinationError` if it may not be replaced: without
    `overwrite` nothing is replaced; with it only an empty folder or what `replaceable`
    recognises (`what` names it in the message). A symlink is never replaced."""
    if not os.path.lexists(dst):
        return False
    if not overwrite:
        raise DestinationError(f"{dst}: already exists; pass --overwrite (overwrite=True) to replace it (only {what} "
                               "or an empty folder is replaced, and only once the new one is complete)")
    if dst.is_symlink():
        raise DestinationError(f"{dst}: is a symbolic link (to {os.readlink(dst)}); --overwrite does not replace "
                               "links, give the real folder or remove the link")
    if not dst.is_dir():
        raise DestinationError(f"{dst}: is a file, not {what}; --overwrite replaces only {what} or an empty folder")
    if not any(os.scandir(dst)) or replaceable(dst):
        return True
    raise DestinationError(f"{dst}: is not {what} ({_describe(dst)}); --overwrite replaces only {what} or an empty "
                           "folder, so remove it yourself or choose another DST")


def preflight(dst: str | os.PathLike, *, src: str | os.PathLike, overwrite: bool,
              replaceable: Callable[[Path], bool], what: str) -> Path:
    """The checks `atomic_destination` starts with, for a caller to fail before heavy work:
    DST does not overlap SRC and may be (re)placed. Returns DST as an absolute path."""
    check_overlap(src, dst)
    dst = _absolute(dst)
    check_destination(dst, overwrite=overwrite, replaceable=replaceable, what=what)
    return dst


def _lock_name(name: str) -> str:
    lock = f".{name}.k31jax.lock"
    if len(os.fsencode(lock)) <= _NAME_MAX:
        return lock
    return f".k31jax-{hashlib.sha256(os.fsencode(name)).hexdigest()[:24]}.lock"


@contextlib.contextmanager
def destination_lock(dst: Path):
    """Hold an exclusive `flock` on `.<name>.k31jax.lock` beside `dst` (parent must exist).
    The file holds the holder's pid for the message of a run that finds it taken, and is
    removed on release (a waiter that opened the removed file notices and retries)."""
    path = dst.parent / _lock_name(dst.name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DestinationError(f"{dst}: another k31jax run is writing it (pid {holder}, lock file {path}); "
                                   "wait for it to finish or stop it") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed this file after we opened it: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _owner_gone(box: Path, pid: int) -> bool:
    """A temporary folder is stale when its pid is not a live process and no process holds
    the lock on its pid file (which covers a reused pid and pid namespaces)."""
    if _pid_alive(pid):
        return False
    try:
        fd = os.open(box / _PID_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # killed before it wrote its pid file
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # conflicts with any lock a live owner holds
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_stale_temp_folders(parent: Path) -> list[tuple[Path, int]]:
    """Remove the temporary folders of killed runs from `parent`; returns (path, pid) of each."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        box, pid = Path(entry.path), int(m.group(1))
        if pid != os.getpid() and _owner_gone(box, pid):
            shutil.rmtree(box, ignore_errors=True)
            if not os.path.lexists(box):
                removed.append((box, pid))
    return removed


def _label(name: str) -> str:
    """A glob-safe, non-hidden stand-in for DST's name in the temporary folder's name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name.lstrip("."))[:64] or "dst"


_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """`renameat2(2)` with `flags`; False where the C library or the file system lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _publish(stage: Path, dst: Path, box: Path, *, overwrite: bool, replaceable, what: str) -> None:
    """Move `stage` to `dst` atomically. `dst` is checked again now (it may have appeared
    during the run): without `overwrite` anything there stays and the run fails."""
    appeared = f"{dst}: appeared while this run was writing and was left untouched"
    if os.path.lexists(dst) and not overwrite:
        raise DestinationError(f"{appeared}; pass --overwrite to replace {what} or an empty folder")
    if not check_destination(dst, overwrite=overwrite, replaceable=replaceable, what=what):
        try:
            if not _renameat2(stage, dst, _RENAME_NOREPLACE):
                if os.path.lexists(dst):  # no renameat2: the lock keeps other k31jax runs out meanwhile
                    raise FileExistsError(errno.EEXIST, "exists", str(dst))
                os.rename(stage, dst)
        except FileExistsError:
            raise DestinationError(appeared) from None
        return
    if _renameat2(stage, dst, _RENAME_EXCHANGE):
        return  # the replaced folder is now at `stage`, removed with the box
    os.rename(dst, box / "replaced")
    try:
        os.rename(stage, dst)
    except BaseException:
        os.rename(box / "replaced", dst)
        raise


def _is_disk_full(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(exc) for text in _DISK_FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def atomic_destination(
    dst: str | os.PathLike,
    *,
    src: str | os.PathLike,
    overwrite: bool,
    replaceable: Callable[[Path], bool],
    what: str,
    stage_name: str,
    stop: threading.Event | None = None,
    needed_bytes: int | None = None,
    command: str = "k31jax",
):
    """Yield a fresh folder path to write the output into (not created: Orbax creates its
    own); when the block completes it is published at `dst` (see module doc). `replaceable`
    recognises `what` (e.g. "a k31jax checkpoint") for `overwrite`; `stop` is checked before
    publishing; `needed_bytes` goes into the disk-full message; `command` prefixes the line
    reporting removed stale temporary folders. Writers started in the block must be stopped
    by the block itself (inner `with`s) before this removes the temporary folder."""
    dst = preflight(dst, src=src, overwrite=overwrite, replaceable=replaceable, what=what)
    check_stop(stop)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(dst):
        check_destination(dst, overwrite=overwrite, replaceable=replaceable, what=what)
        stale = remove_stale_temp_folders(dst.parent)
        if stale:
            listed = ", ".join(f"{p} (pid {pid})" for p, pid in stale)
            many = len(stale) > 1
            print(f"{command}: removed {len(stale)} stale temporary folder{'s' if many else ''} left by "
                  f"{'killed runs' if many else 'a killed run'}: {listed}", file=sys.stderr)
        box = dst.parent / f".{_label(dst.name)}.k31jax-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        box.mkdir()
        try:
            owner = os.open(box / _PID_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(owner, fcntl.LOCK_EX)  # held while the run lives: see `_owner_gone`
                os.write(owner, f"{os.getpid()}\n".encode())
                yield box / stage_name
                check_stop(stop)
                _publish(box / stage_name, dst, box, overwrite=overwrite, replaceable=replaceable, what=what)
            finally:
                os.close(owner)
        except BaseException as e:
            shutil.rmtree(box, ignore_errors=True)
            if isinstance(e, Interrupted):
                raise Interrupted(f"stopped before {dst} was published; its temporary folder was removed") from None
            if isinstance(e, Exception) and not isinstance(e, CheckpointError) and _is_disk_full(e):
                need = f"; the finished output alone is {human_bytes(needed_bytes)}" if needed_bytes else ""
                raise DiskFullError(f"no space left on device while writing into {dst.parent} "
                                    f"({human_bytes(max(_free_bytes(dst.parent), 0))} free{need}); the temporary "
                                    f"folder was removed and {dst} was not touched") from e
            raise
        shutil.rmtree(box, ignore_errors=True)


__all__ = ["DestinationError", "DiskFullError", "Interrupted", "SourceOverlapError", "atomic_destination",
           "check_destination", "check_overlap", "check_stop", "destination_lock", "preflight",
           "remove_stale_temp_folders"]

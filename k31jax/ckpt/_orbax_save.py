"""Orbax save-side options and patches for the converter (and nothing else).

`save_context` sets the converter's storage options (no compression, chunked expert leaves,
TensorStore's per-write fsync off); `fast_partial_saves` swaps two private Orbax functions
for linear-time equivalents for the duration of a conversion; `flush_new_files` and
`fsync_tree` manage durability and the page cache; `literal_root` keeps Orbax's globs from
reading glob characters in the output path as wildcards, and `settled_writes` waits for a
failed save's background writes before its folder is removed. Loading never needs any of
this: every patch of Orbax internals lives here, scoped to a `with` block.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import os
import sys
import threading
import time
from pathlib import Path

from ._manifest import file_identity, hash_file
from ._orbax import quiet_orbax


def _ocp():
    # Orbax is imported on first use, as in `k31jax.ckpt` (a heavy import).
    import orbax.checkpoint.experimental.v1 as ocp1

    return ocp1


@contextlib.contextmanager
def save_context(*, chunk_byte_size: int = 1 << 28, fsync_each_write: bool = False, use_ocdbt: bool = True):
    """Orbax options for the converter: no compression (MXFP4 bytes do not compress), no
    defensive copy of host arrays, and leaves larger than `chunk_byte_size` (the routed
    experts: 4.9 GB per leaf in K3) stored in chunks of at most that size, split along the
    leading (expert / vocab) axis first, so a sharded restore reads only the chunks it needs;
    smaller leaves are one chunk each (chunking costs write speed). With `fsync_each_write=False`
    TensorStore's per-write fsync is switched off for the duration (the converter syncs every
    file once at the end).

    With OCDBT every partial save leaves its own database, and finalize merges them all in
    one transaction, superlinearly in their number: a 93-layer tree in 442 calls converts in
    82 s all told, in 1,549 calls it had not finished merging after 8 minutes (3 GB held).
    Hence few, large calls (`convert` never writes less than the largest leaf per call).
    `use_ocdbt=False` avoids the merge but stores a file per chunk: a file per expert."""
    ocp1 = _ocp()
    ctx = ocp1.Context()
    ctx.array.saving.use_compression = False
    ctx.array.saving.use_ocdbt = use_ocdbt
    ctx.memory.deepcopy_host_arrays = False
    storage = ocp1.options.ArrayOptions.Saving.StorageOptions

    def chunked(_, value):  # split the leading axis (experts, vocab) first: that is what restores shard
        if getattr(value, "nbytes", 0) <= chunk_byte_size:
            return None
        return storage(chunk_byte_size=chunk_byte_size, shard_axes=(0,))

    ctx.array.saving.scoped_storage_options_creator = chunked
    overrides = {} if fsync_each_write else {"file_io_sync": False}
    patched = []
    try:  # private Orbax module, imported where used and guarded: other Orbax versions lack it
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        defaults = (tsu._BASE_TS_CONTEXT, tsu._DEFAULT_OCDBT_TS_CONTEXT)
    except (ImportError, AttributeError):  # a different orbax: keep its defaults
        defaults = ()
    for d in defaults:
        for key, value in overrides.items():
            patched.append((d, key, key in d, d.get(key)))
            d[key] = value
    try:
        with ctx, quiet_orbax():
            yield ctx
    finally:
        for d, key, had, old in patched:
            if had:
                d[key] = old
            else:
                d.pop(key, None)


def drop_interior_keys(d: dict) -> dict:
    """Drop every metadata key that is a strict prefix of another (an interior node, not a
    leaf): tuple keys (their `repr`) by tuple prefix, other pairs by string prefix ending in
    '.' or '/'. The same result as Orbax's partial-save `_filter_conflicting_keys`, which
    compares every ordered pair of keys — quadratic in the leaf count, for every call being
    merged: a 93-layer tree of K3's 3,180 leaves in 442 calls had not finished after 16
    CPU-minutes."""
    parsed = {}
    for k in d:
        try:
            parsed[k] = ast.literal_eval(k)
        except (ValueError, SyntaxError):
            parsed[k] = k
    tuple_prefixes, prefixes_of_all, prefixes_of_plain = set(), set(), set()
    for k, t in parsed.items():
        is_tuple = isinstance(t, tuple)
        if is_tuple:
            tuple_prefixes.update(t[:i] for i in range(len(t)))
        cuts = {k[:i] for i, ch in enumerate(k) if ch in "./"}
        prefixes_of_all |= cuts
        if not is_tuple:
            prefixes_of_plain |= cuts
    for k, t in parsed.items():
        if isinstance(t, tuple):
            interior = t in tuple_prefixes or k in prefixes_of_plain
        else:
            interior = k in prefixes_of_all
        if interior:
            del d[k]
    return d


@contextlib.contextmanager
def fast_partial_saves():
    """Orbax partial saves and their finalize in time linear in the leaves written.

    Orbax's partial save re-reads and re-merges the metadata of every earlier call and checks
    each new key against all saved keys, and its finalize filters keys pairwise per call:
    for K3's 3,180 leaves in 647 calls that grows with the square of the calls (a 93-layer
    synthetic tree in 442 calls had not finished after 16 CPU-minutes). Inside this context the
    replacement check keeps a set of the keys written so far (same errors: a key written
    twice, or a key that is a prefix of another, is refused) and finalize uses
    `drop_interior_keys`; both are restored afterwards. Where Orbax lacks these private
    functions nothing is patched (correct, just slow)."""
    try:  # private Orbax modules, imported where used and guarded: other Orbax versions lack them
        from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as handler
        from orbax.checkpoint.experimental.v1._src.partial import saving
    except ImportError:  # pragma: no cover - a different orbax layout
        yield
        return
    patches = [(handler, "_get_partial_save_additions"), (saving, "_filter_conflicting_keys")]
    if not all(hasattr(mod, name) for mod, name in patches):  # pragma: no cover
        yield
        return
    seen: set[tuple] = set()
    interior: set[tuple] = set()

    async def additions(directory, flat_item, pytree_metadata_options):
        for key in flat_item:
            path = key if isinstance(key, tuple) else (key,)
            if path in seen or path in interior or any(path[:i] in seen for i in range(1, len(path))):
                raise handler.PartialSaveReplacementError(
                    f"Key {key!r} was found in a previous partial save in this session (or is a prefix "
                    "of / prefixed by one). Partial saving does not support REPLACEMENT.")
            seen.add(path)
            interior.update(path[:i] for i in range(1, len(path)))
        return set(flat_item)

    old = [getattr(mod, name) for mod, name in patches]
    handler._get_partial_save_additions = additions
    saving._filter_conflicting_keys = drop_interior_keys
    try:
        yield
    finally:
        for (mod, name), fn in zip(patches, old):
            setattr(mod, name, fn)


def flush_new_files(root: Path, seen: set[str], *, sealed_depth: int = 2, digests: dict | None = None) -> None:
    """fsync the files written under `root` since the last call and drop them from the page
    cache (a streaming writer's pages are never read again; recycling them keeps the cache
    footprint of a 1.5 TB conversion at one write call). `seen` carries state between calls.
    With `digests` each file is first hashed for the checksum manifest while its pages are
    still cached (`digests[file_identity] = digest`), so the manifest never re-reads the bulk
    of a conversion from disk.

    Orbax writes each partial save into a new folder `sealed_depth` levels below the
    converter's box (`<box>/<name>.partial_save/<pending>`) and leaves it alone until
    finalize, so a folder at that depth is walked once, when it first appears: each call
    costs what it wrote, not what the checkpoint holds. (Anything rewritten later is synced
    by the final `fsync_tree`.) Safe to run while the next save writes: files that vanish
    mid-walk are skipped."""
    base = len(Path(root).parts)
    for dirpath, dirnames, files in os.walk(root):
        depth = len(Path(dirpath).parts) - base
        if depth == sealed_depth - 1:
            fresh = [d for d in dirnames if os.path.join(dirpath, d) not in seen]
            seen.update(os.path.join(dirpath, d) for d in fresh)
            dirnames[:] = fresh
        for f in files:
            path = os.path.join(dirpath, f)
            if depth < sealed_depth and path in seen:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # renamed or removed by a save running meanwhile
                continue
            try:
                if digests is not None:
                    before = os.fstat(fd)
                    with contextlib.suppress(FileNotFoundError):  # renamed meanwhile: hashed at the end
                        _, digest = hash_file(path)
                        if file_identity(os.fstat(fd)) == file_identity(before):  # not written meanwhile
                            digests[file_identity(before)] = digest
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if depth < sealed_depth:
                seen.add(path)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (durability before the final rename)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def literal_root(root: Path):
    """Orbax finds its pending folders, OCDBT process folders and array metadata by globbing
    with the folder it was given as part of the pattern, so a `[`, `*` or `?` anywhere in
    that folder's path is read as a wildcard and the save silently loses data (a finalized
    checkpoint without its arrays). Inside this context a local glob under `root` treats the
    `root` part literally (etils' local backend is patched; other patterns are untouched)."""
    import glob as glob_lib

    from etils.epath import backend as backend_lib

    os_backend = backend_lib.os_backend
    prefix = os.fspath(root).rstrip(os.sep) + os.sep
    if not glob_lib.has_magic(prefix):
        yield
        return
    real = os_backend.glob

    def glob(path):
        path = os.fspath(path)
        if path.startswith(prefix):
            return glob_lib.glob(glob_lib.escape(prefix) + path[len(prefix):])
        return real(path)

    os_backend.glob = glob
    try:
        yield
    finally:
        del os_backend.glob  # the instance attribute shadowed the class's method


class _DropClosedLoopErrors:
    """After a failed save Orbax closes its event loops while TensorStore writes are still in
    flight; each write then reports `RuntimeError('Event loop is closed')` as an unraisable
    exception from its completion callback (hundreds of tracebacks). Those, and only those,
    are dropped while the writes settle."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        self.previous(unraisable)


@contextlib.contextmanager
def settled_writes(timeout: float = 120.0):
    """On leaving (also on failure or interruption) wait until every TensorStore write started
    in the block has finished and Orbax's background save threads started in it have ended,
    so that nothing writes into the output folder any more when the caller removes it: a
    failed Orbax save returns while its other writes are in flight, and TensorStore's file
    driver recreates missing folders for them. `timeout` bounds the wait (seconds)."""
    import tensorstore as ts

    try:  # private Orbax class: the thread each background save runs in
        from orbax.checkpoint._src.futures.future import _SignalingThread as orbax_thread
    except ImportError:  # pragma: no cover - a different orbax layout
        orbax_thread = None
    before = set(threading.enumerate())
    pending: set = set()
    guard = threading.Lock()
    real_write = ts.TensorStore.write
    descriptor = ts.TensorStore.__dict__["write"]  # what binds `self`: put back as it was

    def write(self, *args, **kwargs):
        future = real_write(self, *args, **kwargs)
        with guard:
            pending.add(future)

        def forget(_, future=future):  # done writes are dropped: they may hold the written arrays
            with guard:
                pending.discard(future)

        future.add_done_callback(forget)
        return future

    ts.TensorStore.write = write
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _DropClosedLoopErrors(previous_hook)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        ts.TensorStore.write = descriptor
        deadline = time.monotonic() + timeout
        if orbax_thread is not None:
            for t in threading.enumerate():
                if isinstance(t, orbax_thread) and t not in before:
                    t.join(max(0.0, deadline - time.monotonic()))
        with guard:
            futures = list(pending)
        for future in futures:
            with contextlib.suppress(Exception):  # the save's own error is already being raised
                future.result(timeout=max(0.0, deadline - time.monotonic()))
        if failed:  # the failed save's abandoned asyncio tasks log their errors when collected: now,
            gc.collect()  # while the caller's log filters (the CLI's) are still in place
        sys.unraisablehook = previous_hook

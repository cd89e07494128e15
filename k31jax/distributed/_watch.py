"""Noticing at once that a peer process of a multi-process run has died.

A killed process closes its sockets, and a survivor's next gloo collective fails at once. But
a survivor is not always in a collective: it may be compiling, or waiting in one of Orbax's
checkpoint barriers, which go through the coordination service. There nothing notices the
death until the service's heartbeat timeout (100 s), and then `jax.distributed` aborts the
process with a multi-line fatal log. The coordination service has no faster way to tell, so
the processes keep one TCP connection each to process 0 (a star) whose only use is to end:
process 0 sees a peer's connection close the moment the peer dies, names it to the others,
and each survivor stops with one line. A process that ends in order says so first, so its
closing connection alarms no one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import jax
from jax._src import distributed as _jax_distributed  # the coordinator's address and key-value store

_FRAME = struct.Struct("!ci")  # kind, process id
_HELLO, _LOST, _DONE = b"H", b"L", b"D"
_CONNECT_TIMEOUT_S = 300  # as long as jax.distributed.initialize waits for every process
_watches_started = 0  # numbers each watch's key-value entry; every process starts them in the same order


class PeerWatch:
    """The watching thread of one process; `finish` when the process ends."""

    def __init__(self, on_lost: Callable[[str], None]):
        global _watches_started
        _watches_started += 1
        self._key = f"k31jax/peer_watch/{_watches_started}"
        self._on_lost = on_lost
        self._me, self._count = jax.process_index(), jax.process_count()
        self._finishing = threading.Event()
        self._orderly = True
        self._sockets: dict[int, socket.socket] = {}
        self._lock = threading.Lock()  # guards _sockets, and _finishing against a concurrent alarm
        self._ready = threading.Event()  # process 0: every peer connected; a peer: connected
        self._listener = self._listen() if self._me == 0 else None
        self._thread = threading.Thread(target=self._watch_peers if self._me == 0 else self._watch_process_0,
                                        name="k31jax-peer-watch", daemon=True)
        self._thread.start()
        self._ready.wait(_CONNECT_TIMEOUT_S)

    def finish(self, orderly: bool = True) -> None:
        """This process ends: stop watching and close the connections, first saying that it
        ends in order when `orderly` (otherwise the other end hears of a lost process)."""
        with self._lock:
            self._finishing.set()
            self._orderly = orderly
            if self._listener is not None:
                self._listener.close()
            for conn in self._sockets.values():
                self._close(conn)

    def settle(self, timeout: float) -> None:
        """Give the watch up to `timeout` seconds to name a lost peer (a survivor's failed
        collective and the dead peer's closing connection race each other)."""
        self._thread.join(timeout)

    def _close(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if self._orderly:
                conn.sendall(_FRAME.pack(_DONE, self._me))
            conn.shutdown(socket.SHUT_RDWR)

    def _alarm(self, process: int) -> None:
        """`process` died: process 0 tells the others which, then this process's `on_lost`."""
        with self._lock:
            if self._finishing.is_set():
                return
            for other, conn in self._sockets.items():
                if other != process:
                    with contextlib.suppress(OSError):
                        conn.sendall(_FRAME.pack(_LOST, process))
        self._on_lost(f"process {process} of {self._count} stopped answering (its process ended)")

    def _listen(self) -> socket.socket:
        host = _jax_distributed.global_state.coordinator_address.rsplit(":", 1)[0].strip("[]")
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        _jax_distributed.global_state.client.key_value_set(self._key, f"{host}:{listener.getsockname()[1]}")
        return listener

    def _watch_peers(self) -> None:
        """Process 0: accept every peer's connection, then wait for any to close."""
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        remaining, unconnected = set(range(1, self._count)), set(range(1, self._count))
        try:
            while remaining and not self._finishing.is_set():
                for key, _ in selector.select(timeout=0.5):
                    if key.fileobj is self._listener:
                        conn = self._listener.accept()[0]
                        hello = _receive(conn)
                        if hello is None or hello[:1] != _HELLO:
                            conn.close()
                            continue
                        peer = _FRAME.unpack(hello)[1]
                        with self._lock:
                            self._sockets[peer] = conn
                        selector.register(conn, selectors.EVENT_READ, peer)
                        unconnected.discard(peer)
                        if not unconnected:
                            self._ready.set()
                        continue
                    peer, frame = key.data, _receive(key.fileobj)
                    selector.unregister(key.fileobj)
                    remaining.discard(peer)
                    if frame is None or frame[:1] != _DONE:
                        self._alarm(peer)
                        return
        except (OSError, ValueError):  # the listener closed by `finish`
            return
        finally:
            self._ready.set()

    def _watch_process_0(self) -> None:
        """Another process: connect to process 0, then wait for its word or its end."""
        try:
            address = _jax_distributed.global_state.client.blocking_key_value_get(self._key,
                                                                                  _CONNECT_TIMEOUT_S * 1000)
            host, port = address.rsplit(":", 1)
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S)
            conn.settimeout(None)
            conn.sendall(_FRAME.pack(_HELLO, self._me))
        except Exception:  # noqa: BLE001 - process 0 gone before the watch began: its collectives will say so
            return
        finally:
            self._ready.set()
        with self._lock:
            if self._finishing.is_set():  # this process ended while connecting
                self._close(conn)
                return
            self._sockets[0] = conn
        frame = _receive(conn)
        if frame is None:
            self._alarm(0)
        elif frame[:1] == _LOST:
            self._alarm(_FRAME.unpack(frame)[1])


def _receive(conn: socket.socket) -> bytes | None:
    """One frame, or None when the connection closed (or broke) first."""
    data = b""
    try:
        while len(data) < _FRAME.size:
            chunk = conn.recv(_FRAME.size - len(data))
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    return data


@contextlib.contextmanager
def watch_peers(on_lost: Callable[[str], None]) -> Iterator[PeerWatch | None]:
    """Call `on_lost(line)` (from another thread) the moment a peer process of this
    `jax.distributed` run dies; `line` names it ("process 1 of 2 stopped answering (...)").
    Every process enters at the same point of its program: entering waits until all are
    connected (at most as long as `jax.distributed.initialize` waits for them).
    Leaving the block normally tells the peers this process ended in order; leaving it by an
    exception does not, so the peers hear of it. Nothing happens with one process."""
    if jax.process_count() == 1:
        yield None
        return
    watch = PeerWatch(on_lost)
    try:
        yield watch
    except BaseException:
        watch.finish(orderly=False)
        raise
    watch.finish()

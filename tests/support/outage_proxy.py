"""A TCP proxy in front of PostgreSQL that goes down as a crashed server does, and comes back.

``down()``: every connection through it is closed at once (the client reads
"server closed the connection unexpectedly" mid-statement, or finds it closed
at the next one) and new connections are refused, as while the server is
stopped; ``down_after(pattern)`` does so the moment a client sends a
statement holding ``pattern``, which then gets no answer. ``up()``: it
listens again on the same port, in front of the same database, as a server
restarted on the same data. The real server never stops, so the other tests
of the run, and the test's own connection, go on.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from tests.support.server import free_port


class OutageProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.connections = 0
        self._pattern: bytes | None = None
        # Set from the moment the pattern is seen until up(): no answer reaches a client any more.
        self._mute = False
        self.went_down = threading.Event()
        self.up()

    def down_after(self, pattern: bytes) -> None:
        """Go down the moment a client sends ``pattern`` (forwarded first): its statement gets no answer."""
        with self._lock:
            self._pattern = pattern
            self._mute = False
            self.went_down.clear()

    def up(self) -> None:
        with self._lock:
            self._mute = False
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="outage-proxy", daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, set()
        if listener is not None:
            # shutdown wakes the accept() blocked on it; close alone would not.
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.down()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # down()
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._open |= {client, server}
                self.connections += 1
            for source, sink, answers in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(source, sink, answers), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if answers and self._mute:
                    break
                pattern = None if answers else self._pattern
                if pattern is not None and pattern in data:
                    # Muted before the statement is forwarded: on a loaded machine the server's answer was
                    # once relayed between the forward and down(), and the statement "got no answer" too late.
                    self._pattern, self._mute = None, True
                    sink.sendall(data)
                    self.down()
                    self.went_down.set()
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._open.discard(source)
        # Each socket is the source of one pump: that pump closes it.
        source.close()


@contextmanager
def outage_proxy(target: tuple[str, int]) -> Iterator[OutageProxy]:
    proxy = OutageProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()

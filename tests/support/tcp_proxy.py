"""A TCP proxy between a worker and PostgreSQL that can stop forwarding: a network cut, made on purpose.

While cut, it neither reads nor writes either side and keeps both sockets
open, as a partition that drops packets does: the server sees a client that
went silent (a session idle in its transaction, holding its locks), the
client a server that never answers. ``cut_after(pattern)`` cuts the moment a
client sends a statement containing ``pattern``, once the statement has
reached the server: the cut lands in the middle of a transaction, on purpose.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.server import free_port


class CuttableProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._pattern: bytes | None = None
        self._tail = b""
        self.cut_happened = threading.Event()
        # The proxy's own ports toward the server: what pg_stat_activity shows as the sessions' client_port.
        self.upstream_ports: set[int] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    def cut_after(self, pattern: bytes) -> None:
        """Cut everything right after a client sends ``pattern`` (forwarded first)."""
        with self._lock:
            self._pattern = pattern
            self._tail = b""

    def cut(self) -> None:
        self._forwarding.clear()
        self.cut_happened.set()

    def heal(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._stop = True
        self._forwarding.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stop:
            if not self._forwarding.is_set():
                self._forwarding.wait(0.1)
                continue
            for key, _ in self._selector.select(timeout=0.1):
                if key.data is None:
                    self._accept()
                elif self._forwarding.is_set():
                    self._pump(key.fileobj, *key.data)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            server = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self.upstream_ports.add(server.getsockname()[1])
        self._selector.register(client, selectors.EVENT_READ, (server, True))
        self._selector.register(server, selectors.EVENT_READ, (client, False))

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            data = source.recv(65536)
        except OSError:
            data = b""
        if not data:
            for sock in (source, sink):
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
                sock.close()
            return
        sink.sendall(data)
        if from_client:
            with self._lock:
                pattern = self._pattern
                seen = self._tail + data
                if pattern is not None and pattern in seen:
                    self._pattern = None
                    self.cut()
                elif pattern is not None:
                    self._tail = seen[-len(pattern) :]


@contextmanager
def cuttable_proxy(target: tuple[str, int]) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()

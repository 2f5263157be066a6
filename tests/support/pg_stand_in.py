"""A PostgreSQL server that has only the ``postgres`` database, as far as a client's connect can tell.

It speaks enough of the frontend/backend protocol (version 3) for libpq to
connect: it declines SSL and GSS encryption, accepts a startup for the
``postgres`` database without a password (trust, as the local test server
is set up) and answers any other database with the ``FATAL`` a real server
sends (SQLSTATE 3D000, ``database "x" does not exist``). That is the one
state ``scripts/test`` reports with a command, and a test can have it on any
machine, with or without a PostgreSQL installed.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_PROTOCOL_3 = 196608
ONLY_DATABASE = "postgres"


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body


def _fatal(code: str, text: str) -> bytes:
    fields = b"".join(
        tag + value.encode() + b"\0" for tag, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", code), (b"M", text))
    )
    return _message(b"E", fields + b"\0")


def _read_exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _startup(conn: socket.socket) -> dict[str, str]:
    """The startup parameters, after declining every encryption request."""
    while True:
        (length,) = struct.unpack("!I", _read_exact(conn, 4))
        body = _read_exact(conn, length - 4)
        (code,) = struct.unpack("!I", body[:4])
        if code in (_SSL_REQUEST, _GSSENC_REQUEST):
            conn.sendall(b"N")
            continue
        if code != _PROTOCOL_3:
            raise ConnectionError(f"unsupported protocol {code}")
        parts = body[4:].split(b"\0")
        return {parts[i].decode(): parts[i + 1].decode() for i in range(0, len(parts) - 1, 2) if parts[i]}


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn: socket.socket = self.request
        try:
            params = _startup(conn)
        except (ConnectionError, struct.error, UnicodeDecodeError):
            return
        database = params.get("database") or params.get("user", "")
        if database != ONLY_DATABASE:
            conn.sendall(_fatal("3D000", f'database "{database}" does not exist'))
            return
        parameters = b"".join(
            _message(b"S", name + b"\0" + value + b"\0")
            for name, value in ((b"server_version", b"15.0"), (b"client_encoding", b"UTF8"))
        )
        auth_ok, ready = _message(b"R", struct.pack("!I", 0)), _message(b"Z", b"I")
        conn.sendall(auth_ok + parameters + ready)
        try:
            while conn.recv(4096):  # until the client's Terminate closes the connection
                pass
        except OSError:
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextmanager
def postgres_stand_in() -> Iterator[str]:
    """``postgres://postgres@127.0.0.1:<port>``: a server whose only database is ``postgres``."""
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"postgres://postgres@127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()

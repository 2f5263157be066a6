"""A local stand-in for the Hugging Face Hub: a real HTTP server over fixture folders.

It answers what the pinned ``huggingface_hub`` asks of the Hub, as the Hub
answers it:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``
  (``HfApi.model_info``; with ``?blobs=True`` each sibling has its size, git
  blob id and, for LFS files, ``lfs.sha256``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (``list_repo_tree``, which
  ``snapshot_download`` lists with), one page;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: small files are served
  there (``ETag`` = git blob id); LFS files (``*.onnx``, ``*.onnx_data``,
  anything over 10 MB) answer ``302`` to a "CDN" URL on another origin
  (``localhost`` instead of ``127.0.0.1``, so the client drops the token as
  it does for the Hub's CDN), with ``X-Linked-Etag``/``X-Linked-Size``;
- ``Range: bytes=N-`` answers ``206`` with ``Content-Range``;
- errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``).

A repository's only branch is ``main``; its commit id is a digest of its
files, so ``--revision <commit>`` resolves too.

Faults a test can inject (``clear_faults`` removes them):

- ``interrupt(path, after=N)``: the next download of ``path`` stops after
  its first N bytes and the connection drops; until cleared the file then
  answers ``503`` (the Hub unreachable for it), so a client's retries fail;
- ``corrupt(path)``: the file is served with one byte changed (same size);
- ``require_token(token)``: the API and ``resolve`` routes answer ``401``
  without ``Authorization: Bearer <token>``.

Every request is recorded (``requests``), with the repository file whose
content it served, if any.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".onnx", ".onnx_data", ".onnx.data")
LFS_MIN_SIZE = 10 * 1024 * 1024
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


def git_blob_id(data: bytes) -> str:
    """The git object id of a file with these bytes, as the Hub reports ``blobId``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @property
    def blob_id(self) -> str:
        # An LFS file's git object is its pointer file.
        return git_blob_id(self.pointer if self.lfs else self.data)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class Repo:
    repo_id: str
    files: dict[str, RepoFile]
    commit: str


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    """Header names in lower case."""
    file: str | None
    """The repository file whose bytes this request was answered with (a GET of content), else None."""
    status: int


@dataclass
class _Faults:
    interrupt_after: dict[str, int] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    token: str | None = None


def load_repo(repo_id: str, folder: Path) -> Repo:
    """The files of ``folder`` as the repository ``repo_id`` (dotfiles left out, as git would hold them)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        data = path.read_bytes()
        lfs = rel.endswith(LFS_SUFFIXES) or len(data) > LFS_MIN_SIZE
        files[rel] = RepoFile(path=rel, data=data, lfs=lfs)
    manifest = "".join(f"{rel}\0{item.blob_id}\n" for rel, item in files.items())
    return Repo(repo_id=repo_id, files=files, commit=hashlib.sha1(manifest.encode()).hexdigest())


class HubStandIn:
    """The running server; see the module docstring."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = {repo_id: load_repo(repo_id, folder) for repo_id, folder in repos.items()}
        self._faults = _Faults()
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{port}"
        self.cdn_url = f"http://localhost:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hf-hub-stand-in", daemon=True)

    # --- faults and the record ----------------------------------------------------------------------

    def interrupt(self, path: str, *, after: int) -> None:
        with self._lock:
            self._faults.interrupt_after[path] = after

    def corrupt(self, path: str) -> None:
        with self._lock:
            self._faults.corrupt.add(path)

    def require_token(self, token: str | None) -> None:
        with self._lock:
            self._faults.token = token

    def clear_faults(self) -> None:
        with self._lock:
            self._faults = _Faults()

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def served_files(self) -> set[str]:
        """The repository files whose bytes were sent since the record was last cleared."""
        return {r.file for r in self.requests if r.file is not None}

    # --- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> HubStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # --- used by the handler ------------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)

    def _token_ok(self, authorization: str | None) -> tuple[bool, str]:
        with self._lock:
            token = self._faults.token
        if token is None or authorization == f"Bearer {token}":
            return True, ""
        if authorization is None:
            return False, "Invalid username or password."
        return False, "Invalid credentials in Authorization header"

    def _content_fault(self, path: str) -> tuple[str, int | None]:
        """What to do with a content request for ``path``: ("unreachable"|"interrupt"|"corrupt"|"", cut offset)."""
        with self._lock:
            if path in self._faults.unreachable:
                return "unreachable", None
            if path in self._faults.interrupt_after:
                self._faults.unreachable.add(path)
                return "interrupt", self._faults.interrupt_after.pop(path)
            return ("corrupt" if path in self._faults.corrupt else ""), None


def _corrupted(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :] if data else b"?"


def _handler_for(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "hf-hub-stand-in"

        def log_message(self, format: str, *args: object) -> None:
            pass  # the record is in hub.requests

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        # --- routing --------------------------------------------------------------------------------

        def _serve(self, *, body: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            self._query = parse_qs(url.query)
            self._file: str | None = None
            self._status = 500
            try:
                if path.startswith("/cdn/"):
                    self._cdn(path[len("/cdn/") :], body=body)
                elif path.startswith("/api/models/"):
                    if self._authorized():
                        rest = path[len("/api/models/") :]
                        if "/tree/" in rest:
                            self._tree(*rest.partition("/tree/")[::2])
                        else:
                            self._model_info(rest)
                elif "/resolve/" in path:
                    if self._authorized():
                        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                        revision, _, file_path = rest.partition("/")
                        self._resolve(repo_id, revision, file_path, body=body)
                else:
                    self._error(404, "Not found", None)
            finally:
                hub._record(
                    Request(
                        method=self.command,
                        path=path,
                        query=self._query,
                        headers={k.lower(): v for k, v in self.headers.items()},
                        file=self._file,
                        status=self._status,
                    )
                )

        def _authorized(self) -> bool:
            ok, message = hub._token_ok(self.headers.get("Authorization"))
            if not ok:
                # As the Hub: without a token a private repository looks missing; a bad token is said to be bad.
                sent = self.headers.get("Authorization") is not None
                self._error(401, message, None if sent else "RepoNotFound")
            return ok

        def _model_info(self, rest: str) -> None:
            repo_id, _, revision = rest.partition("/revision/")
            repo = self._repo(repo_id, revision or "main")
            if repo is None:
                return
            blobs = self._query.get("blobs", [""])[0].lower() == "true"
            siblings = []
            for item in repo.files.values():
                sibling: dict[str, object] = {"rfilename": item.path}
                if blobs:
                    sibling.update(size=len(item.data), blobId=item.blob_id)
                    if item.lfs:
                        sibling["lfs"] = {
                            "size": len(item.data),
                            "sha256": item.sha256,
                            "pointerSize": len(item.pointer),
                        }
                siblings.append(sibling)
            info = {"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id, "sha": repo.commit}
            info.update(private=False, gated=False, disabled=False, tags=["onnx"], siblings=siblings)
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

        def _tree(self, repo_id: str, rest: str) -> None:
            revision, _, under = rest.partition("/")
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            prefix = f"{under.strip('/')}/" if under.strip("/") else ""
            recursive = self._query.get("recursive", [""])[0].lower() == "true"
            entries: dict[str, dict[str, object]] = {}
            for item in repo.files.values():
                if not item.path.startswith(prefix):
                    continue
                below = item.path[len(prefix) :]
                if "/" in below and not recursive:
                    folder = prefix + below.split("/", 1)[0]
                    entries[folder] = {
                        "type": "directory",
                        "oid": git_blob_id(folder.encode()),
                        "size": 0,
                        "path": folder,
                    }
                    continue
                entry: dict[str, object] = {
                    "type": "file",
                    "oid": item.blob_id,
                    "size": len(item.data),
                    "path": item.path,
                }
                if item.lfs:
                    entry["lfs"] = {"oid": item.sha256, "size": len(item.data), "pointerSize": len(item.pointer)}
                entries[item.path] = entry
            if recursive:
                for folder in sorted({p.rsplit("/", 1)[0] for p in entries if "/" in p[len(prefix) :]}):
                    entries[folder] = {
                        "type": "directory",
                        "oid": git_blob_id(folder.encode()),
                        "size": 0,
                        "path": folder,
                    }
            body = json.dumps([entries[key] for key in sorted(entries)]).encode()
            self._send(200, body, {"Content-Type": "application/json"})

        def _resolve(self, repo_id: str, revision: str, file_path: str, *, body: bool) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            item = repo.files.get(file_path)
            headers = {"X-Repo-Commit": repo.commit}
            if item is None:
                self._error(404, "Entry not found", "EntryNotFound", headers)
                return
            if item.lfs:
                # Content-addressed, as the Hub's CDN is; the path only tells the record which file it was.
                location = f"{hub.cdn_url}/cdn/{item.sha256}/{quote(repo_id)}/{quote(item.path)}"
                headers.update(
                    {
                        "Location": location,
                        "ETag": f'"{item.blob_id}"',
                        "X-Linked-Etag": f'"{item.sha256}"',
                        "X-Linked-Size": str(len(item.data)),
                    }
                )
                self._send(302, b"", headers)
                return
            self._content(item, headers, body=body)

        def _cdn(self, rest: str, *, body: bool) -> None:
            sha256, _, named = rest.partition("/")
            found = [
                item
                for repo_id, repo in hub.repos.items()
                if named.startswith(f"{repo_id}/")
                for item in [repo.files.get(named[len(repo_id) + 1 :])]
                if item is not None and item.lfs and item.sha256 == sha256
            ]
            if not found:
                self._error(404, "No such object", None)
                return
            self._content(found[0], {}, body=body)

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "Repository not found", "RepoNotFound")
                return None
            if revision not in ("main", repo.commit):
                self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound", {"X-Repo-Commit": repo.commit})
                return None
            return repo

        # --- answers --------------------------------------------------------------------------------

        def _content(self, item: RepoFile, headers: dict[str, str], *, body: bool) -> None:
            fault, cut = hub._content_fault(item.path) if body else ("", None)
            if fault == "unreachable":
                self._error(503, "Service unavailable", None)
                return
            data = _corrupted(item.data) if fault == "corrupt" else item.data
            headers = {**headers, "ETag": f'"{item.etag}"', "Accept-Ranges": "bytes"}
            headers["Content-Type"] = "application/octet-stream"
            start, status = 0, 200
            match = _RANGE_RE.match(self.headers.get("Range") or "")
            if match:
                start = int(match[1])
                end = int(match[2]) if match[2] else len(data) - 1
                if start >= len(data):
                    headers["Content-Range"] = f"bytes */{len(data)}"
                    self._send(416, b"", headers)
                    return
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data, status = data[start : end + 1], 206
            if not body:
                self._send(status, b"", {**headers, "Content-Length": str(len(data))})
                return
            self._file = item.path
            if fault == "interrupt":
                self._send_cut(status, data[: max(0, (cut or 0) - start)], len(data), headers)
                return
            self._send(status, data, headers)

        def _send_cut(self, status: int, part: bytes, full_length: int, headers: dict[str, str]) -> None:
            """Promise ``full_length`` bytes, send ``part``, drop the connection."""
            self._status = status
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(full_length))
            self.end_headers()
            self.wfile.write(part)
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client may be gone already

        def _error(self, status: int, message: str, code: str | None, headers: dict[str, str] | None = None) -> None:
            headers = {**(headers or {}), "Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers)

        def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
            self._status = status
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler


@contextmanager
def hf_hub_stand_in(repos: dict[str, Path]) -> Iterator[HubStandIn]:
    """``with hf_hub_stand_in({"org/name": folder}) as hub:`` a running stand-in; ``hub.url`` is its HF_ENDPOINT."""
    hub = HubStandIn(repos).start()
    try:
        yield hub
    finally:
        hub.stop()

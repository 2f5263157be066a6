"""The installation's signing key, made on first start and kept in the data directory.

Admin sessions and stream tokens are signed with it, so it must be secret
and the same in every process of the installation (web, workers, the
maintenance node, ``manage.py``). Several of them may start at once on a
fresh data directory: each writes its own candidate to a private temporary
file and tries to hard-link it into place, which only one can do; all of
them then read whichever key won.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

KEY_FILE_NAME = "secret-key"
_KEY_BYTES = 50
# Only the fallback without hard links lets a reader see the file before
# its key is written; it waits this long for the writer.
_READ_WAIT_SECONDS = 2.0


def secret_key_load_or_create(data_dir: Path) -> str:
    """The key in ``data_dir/secret-key``, created (mode 0600) if there is none yet."""
    path = data_dir / KEY_FILE_NAME
    try:
        if not path.exists():
            data_dir.mkdir(parents=True, exist_ok=True)
            _create(path)
        return _read(path)
    except OSError as error:
        raise ImproperlyConfigured(
            f"cannot read or create the signing key file {path}: {error}; "
            "make the data directory (LMSP_DATA_DIR) writable or set LMSP_SECRET_KEY"
        ) from error


def _create(path: Path) -> None:
    key = secrets.token_urlsafe(_KEY_BYTES)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return  # another process won; its key is the one
        except OSError:
            # A file system without hard links: create in place, exclusively.
            _create_in_place(path, key)
    finally:
        temp.unlink(missing_ok=True)
    _sync_directory(path.parent)


def _create_in_place(path: Path, key: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
        out.flush()
        os.fsync(out.fileno())


def _sync_directory(directory: Path) -> None:
    # The new name must survive a power loss too, or the next start makes
    # another key and every token and session signed so far stops working.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ImproperlyConfigured(
            f"the signing key file {path} is readable by others (mode {mode:o}); run: chmod 600 {path}"
        )
    deadline = time.monotonic() + _READ_WAIT_SECONDS
    while True:
        key = path.read_text().strip()
        if key or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(key) < 32:
        raise ImproperlyConfigured(f"the signing key file {path} holds no usable key; delete it to make a new one")
    return key

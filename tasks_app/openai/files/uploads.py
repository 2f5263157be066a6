"""A multipart upload streamed to disk (docs/batches.md): never whole in memory, never in the database.

Django's multipart parser hands the file's bytes to ``StagingUploadHandler``
in pieces; each piece is written to a staging file in LMSP_FILES_DIR and
added to the file's SHA-256 as it goes. The view keeps the staged file
(``services.files.file_create`` renames it) or, whatever went wrong, removes
it (``discard``): a request cut off, refused or failed leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler

from tasks_app.exceptions import PayloadTooLarge
from tasks_app.services.files import file_staging_path

CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class StagedFile:
    """A file field's bytes, on disk: where, how many, their digest, and the name the client gave."""

    name: str
    path: Path
    size: int
    sha256: str


class StagingUploadHandler(FileUploadHandler):
    chunk_size = CHUNK_BYTES

    def __init__(self, request: Any = None) -> None:
        super().__init__(request)
        self.staged: list[Path] = []
        self._handle: Any = None
        self._digest: Any = None
        self._size = 0

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        path = file_staging_path()
        self.staged.append(path)
        self._handle = path.open("xb")
        self._digest = hashlib.sha256()
        self._size = 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self._size += len(raw_data)
        if self._size > settings.LMSP_MAX_FILE_BYTES:
            raise PayloadTooLarge(f"The file exceeds {settings.LMSP_MAX_FILE_BYTES} bytes (LMSP_MAX_FILE_BYTES)")
        self._digest.update(raw_data)
        self._handle.write(raw_data)

    def file_complete(self, file_size: int) -> StagedFile:
        handle, self._handle = self._handle, None
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        return StagedFile(
            name=self.file_name or "file", path=self.staged[-1], size=self._size, sha256=self._digest.hexdigest()
        )

    def upload_interrupted(self) -> None:
        self.discard()

    def discard(self, keep: Path | None = None) -> None:
        """Remove every staging file of this request but ``keep`` (already renamed into place)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        for path in self.staged:
            if path != keep:
                path.unlink(missing_ok=True)

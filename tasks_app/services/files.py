"""Files (OpenAI's Files API, docs/batches.md): kept on disk under LMSP_FILES_DIR, named by a row.

An upload is streamed by the adapter into a staging file in the same
directory (``file_staging_path``), its SHA-256 computed on the way; here it
is renamed to its own name and its row created, or removed. A staging file
of a request that was cut off is removed by the adapter, and one a crashed
process left behind by ``file_staging_sweep``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tasks_app.exceptions import FileInUse
from tasks_app.ids import new_file_id
from tasks_app.models import Batch, Client, File, FilePurpose
from tasks_app.models.batches import BATCH_ACTIVE

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".upload-"
# A staging file this old belongs to no request still being read.
STAGING_MAX_AGE_SECONDS = 24 * 3600


def files_dir() -> Path:
    """LMSP_FILES_DIR, made on first use."""
    path = Path(settings.LMSP_FILES_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_path(file: File) -> Path:
    return files_dir() / file.path


def file_staging_path() -> Path:
    """A new staging file's name: in the files' own directory, so that keeping it is a rename."""
    return files_dir() / f"{STAGING_PREFIX}{secrets.token_hex(12)}"


def file_staging_sweep(*, older_than_seconds: int = STAGING_MAX_AGE_SECONDS) -> int:
    """Remove staging files no request is writing any more (a process killed mid-upload left them)."""
    cutoff = time.time() - older_than_seconds
    removed = 0
    for path in files_dir().glob(f"{STAGING_PREFIX}*"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _expires_at(created_at: datetime) -> datetime | None:
    """When the retention cleanup deletes a file made now (None: kept until deleted)."""
    keep = settings.LMSP_FILE_RETENTION_SECONDS
    return created_at + timedelta(seconds=keep) if keep > 0 else None


def files_expire(*, now: datetime, size: int) -> list[File]:
    """Delete up to ``size`` files older than ``LMSP_FILE_RETENTION_SECONDS`` (0: none), never the input of a
    batch that has not ended; returns them, their rows gone (the caller removes their bytes, ``file_bytes_remove``)."""
    if settings.LMSP_FILE_RETENTION_SECONDS <= 0:
        return []
    cutoff = now - timedelta(seconds=settings.LMSP_FILE_RETENTION_SECONDS)
    reading = Batch.objects.filter(status__in=[str(s) for s in BATCH_ACTIVE]).values("input_file_id")
    old = File.objects.filter(created_at__lt=cutoff).exclude(pk__in=reading)
    with transaction.atomic():
        files = list(old.order_by("created_at")[:size])
        File.objects.filter(pk__in=[file.pk for file in files]).delete()
    return files


def file_bytes_remove(files: list[File]) -> None:
    """Remove the bytes of files whose rows are gone (a crash between the two leaves bytes no row names, which
    are only disk, never a file a client can read)."""
    for file in files:
        file_path(file).unlink(missing_ok=True)


def file_create(*, client: Client, filename: str, purpose: FilePurpose, staged: Path, size: int, sha256: str) -> File:
    """Keep a staged upload as the client's file: renamed into place, then its row; neither if either fails."""
    file_id = new_file_id()
    final = files_dir() / file_id
    os.replace(staged, final)
    try:
        return File.objects.create(
            id=file_id,
            client=client,
            filename=filename[:255],
            purpose=purpose,
            bytes=size,
            sha256=sha256,
            path=file_id,
            created_at=(now := timezone.now()),
            expires_at=_expires_at(now),
        )
    except BaseException:
        final.unlink(missing_ok=True)
        raise


def file_output_create(*, client_id: int, batch_id: str, name: str, path: str) -> File:
    """A batch's output or error file (``purpose: batch_output``), in the caller's transaction: its bytes are
    already on disk under ``path`` (``services/batch_output``); the digest is read here, once."""
    digest = hashlib.sha256()
    full = files_dir() / path
    with full.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return File.objects.create(
        id=new_file_id(),
        client_id=client_id,
        filename=f"{batch_id}_{name}.jsonl",
        purpose=FilePurpose.BATCH_OUTPUT,
        bytes=full.stat().st_size,
        sha256=digest.hexdigest(),
        path=path,
        created_at=(now := timezone.now()),
        expires_at=_expires_at(now),
    )


def file_delete(*, file: File) -> None:
    """Delete a file: its row, then its bytes. A batch still reading it or writing it refuses (``FileInUse``)."""
    users = Batch.objects.filter(client_id=file.client_id, status__in=[str(s) for s in BATCH_ACTIVE])
    if users.filter(input_file_id=file.id).exists():
        raise FileInUse(f"file {file.id} is the input of a batch that has not ended")
    with transaction.atomic():
        File.objects.filter(pk=file.pk).delete()
    try:
        file_path(file).unlink()
    except FileNotFoundError:
        logger.warning("file %s had no bytes on disk at %s", file.id, file.path)

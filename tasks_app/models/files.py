"""Files (OpenAI's Files API, PROFILE.md 12.2): the bytes live on disk, the table holds what names them.

A file's content is never in the database: ``path`` is its name under
``LMSP_FILES_DIR``, and ``sha256`` the digest computed while it was written,
as chapter 11.1 keeps model files.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.models.clients import Client


class FilePurpose(models.TextChoices):
    BATCH = "batch", "batch"
    """Uploaded by a client as a batch's input."""
    BATCH_OUTPUT = "batch_output", "batch_output"
    """Written by the service: a batch's output or error file."""


class File(models.Model):
    """A file a client uploaded, or a batch's output or error file."""

    id = models.CharField(max_length=31, primary_key=True)
    client = models.ForeignKey(Client, on_delete=models.CASCADE, related_name="files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20, choices=FilePurpose.choices)
    bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    path = models.CharField(max_length=255, help_text="Its name under LMSP_FILES_DIR")
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "files"
        constraints = [
            models.CheckConstraint(condition=Q(purpose__in=FilePurpose.values), name="file_purpose_valid"),
            models.CheckConstraint(condition=Q(bytes__gte=0), name="file_bytes_non_negative"),
        ]
        indexes = [models.Index(fields=["client", "-id"], name="file_client_newest")]

    def __str__(self) -> str:
        return self.id

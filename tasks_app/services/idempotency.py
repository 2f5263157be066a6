"""Idempotency keys (PROFILE.md section 5).

A key is claimed by inserting its row; the unique constraint on (client,
endpoint, key) decides between concurrent first uses, never a read before the
write. The claim lives in the caller's transaction, so a request that fails
leaves no key behind.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from tasks_app.exceptions import IdempotencyKeyInUse, IdempotencyKeyReused, InvalidRequest
from tasks_app.models import Client, IdempotencyKey, IdempotencyState

MAX_KEY_LENGTH = 255


def idempotency_key_validate(raw: str | None) -> str | None:
    """The header's value, or None when absent; 1-255 printable ASCII."""
    if raw is None:
        return None
    if not 1 <= len(raw) <= MAX_KEY_LENGTH or not all(0x20 <= ord(ch) <= 0x7E for ch in raw):
        raise InvalidRequest(
            "Idempotency-Key must be 1-255 printable ASCII characters",
            errors=[{"field": "Idempotency-Key", "message": "must be 1-255 printable ASCII characters"}],
        )
    return raw


def request_digest(body: Any) -> str:
    """SHA-256 of the canonical JSON of a parsed body (key order and spacing do not matter)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class IdempotencyClaim:
    """Either a fresh claim (``record``) or a stored reply to send again."""

    record: IdempotencyKey | None = None
    replay_status: int | None = None
    replay_body: Any = None
    replay_headers: dict[str, str] | None = None

    @property
    def is_replay(self) -> bool:
        return self.record is None


Settle = Callable[[IdempotencyKey], bool]


def idempotency_claim(
    *, client: Client, endpoint: str, key: str, request_hash: str, settle: Settle | None = None
) -> IdempotencyClaim:
    """Claim ``key`` for this request, or return what the first use answered.

    Must run inside a transaction. Raises ``IdempotencyKeyReused`` for another
    body and ``IdempotencyKeyInUse`` while the first request is unfinished.
    ``settle`` may complete an unfinished record whose work is in fact done
    (its server went away before answering); it returns True if it did.
    """
    now = timezone.now()
    expires_at = now + timedelta(seconds=settings.LMSP_IDEMPOTENCY_TTL_SECONDS)
    for _ in range(2):
        try:
            with transaction.atomic():
                record = IdempotencyKey.objects.create(
                    client=client,
                    endpoint=endpoint,
                    key=key,
                    request_hash=request_hash,
                    state=IdempotencyState.IN_PROGRESS,
                    created_at=now,
                    expires_at=expires_at,
                )
            return IdempotencyClaim(record=record)
        except IntegrityError:
            pass
        # On PostgreSQL the failed INSERT waited for the other transaction,
        # so the row we read now is committed.
        existing = IdempotencyKey.objects.filter(client=client, endpoint=endpoint, key=key).first()
        if existing is None:
            continue  # the holder rolled back between our insert and read
        if existing.expires_at <= now:
            IdempotencyKey.objects.filter(pk=existing.pk, expires_at__lte=now).delete()
            continue
        if existing.request_hash != request_hash:
            raise IdempotencyKeyReused(
                "This Idempotency-Key was first used with a different request body",
                errors=[{"field": "Idempotency-Key", "message": "already used with another body"}],
            )
        if existing.state == IdempotencyState.IN_PROGRESS:
            if settle is None or not settle(existing):
                raise IdempotencyKeyInUse("The first request with this Idempotency-Key is still being served")
        return IdempotencyClaim(
            replay_status=existing.response_status,
            replay_body=existing.response_body,
            replay_headers=dict(existing.response_headers or {}),
        )
    raise IdempotencyKeyInUse("The Idempotency-Key is contended; try again")


def idempotency_claim_if_keyed(
    *, client: Client, endpoint: str, key: str | None, request_hash: str | None, settle: Settle | None = None
) -> IdempotencyClaim | None:
    """``idempotency_claim`` for a request that may carry no key (then None)."""
    if key is None:
        return None
    if request_hash is None:
        raise ValueError("an idempotency key needs the request's digest")
    return idempotency_claim(client=client, endpoint=endpoint, key=key, request_hash=request_hash, settle=settle)


def idempotency_complete(
    *, record: IdempotencyKey, status: int, body: Any, headers: dict[str, str], task_id: str | None = None
) -> None:
    """Store the reply of a claimed key (in the same transaction as the work), and the task it made, if any."""
    record.state = IdempotencyState.COMPLETED
    record.response_status = status
    record.response_body = body
    record.response_headers = headers
    fields = ["state", "response_status", "response_body", "response_headers"]
    if task_id is not None:
        record.task_id = task_id
        fields.append("task")
    record.save(update_fields=fields)

"""Clients, their tokens and pairing codes (PROFILE.md section 1)."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, OperationalError, transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from tasks_app.exceptions import InvalidRequest
from tasks_app.models import Client, PairingCode
from tasks_app.plumbing.database_outages import Unavailable, database_unavailability
from tasks_app.plumbing.db_locks import lock_wait

logger = logging.getLogger(__name__)

# How long recording a client's last use may wait for the lock before it is skipped.
TOUCH_LOCK_WAIT_SECONDS = 0.2

SCOPES = ("responses", "read", "admin")
TOKEN_PREFIX = "lmsp_"
_CODE_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford: no I, L, O, U
_CODE_LENGTH = 8
MAX_NAME_LENGTH = 100


def token_digest(secret: str) -> str:
    """SHA-256 hex of a token or pairing code; only this is stored."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def scopes_parse(raw: str | Iterable[str]) -> list[str]:
    """Validate scopes given as ``"a,b"`` or a list; keeps the canonical order."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    wanted = {item.strip() for item in items if item and item.strip()}
    unknown = wanted - set(SCOPES)
    if unknown:
        raise InvalidRequest(
            f"unknown scopes {sorted(unknown)}; known: {', '.join(SCOPES)}",
            errors=[{"field": "scopes", "message": f"unknown scopes {sorted(unknown)}"}],
        )
    if not wanted:
        raise InvalidRequest("at least one scope is required", errors=[{"field": "scopes", "message": "empty"}])
    return [scope for scope in SCOPES if scope in wanted]


def _name_validate(name: str) -> str:
    name = name.strip()
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise InvalidRequest(
            f"client name must be 1-{MAX_NAME_LENGTH} characters",
            errors=[{"field": "client_name", "message": f"must be 1-{MAX_NAME_LENGTH} characters"}],
        )
    return name


def client_create(*, name: str, scopes: Iterable[str] | str) -> tuple[Client, str]:
    """Create a client; returns it with its token, which is never stored or shown again."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    try:
        with transaction.atomic():
            client = Client.objects.create(
                name=_name_validate(name), token_hash=token_digest(token), scopes=scopes_parse(scopes)
            )
    except IntegrityError:
        raise InvalidRequest(
            f"a client named {name!r} already exists",
            errors=[{"field": "client_name", "message": "already in use"}],
        ) from None
    return client, token


def client_local_token_ensure(*, path: Path) -> str | None:
    """Make sure ``path`` holds the token of an active client of this database; the new token when one was made.

    A token is only good for the database it was created in (a deleted SQLite file, another
    ``DATABASE_URL``, a revoked client): one that is not is replaced by a new client's. The file is
    readable by this user only and written whole or not at all.
    """
    if path.is_file():
        kept = path.read_text().strip()
        if kept and Client.objects.filter(token_hash=token_digest(kept), revoked_at__isnull=True).exists():
            return None
        path.unlink()
    _, token = client_create(name=f"local-{datetime.now().astimezone():%Y%m%d-%H%M%S}", scopes="responses,read")
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(path.name + ".new")
    descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(token + "\n")
    fresh.replace(path)
    return token


def client_revoke(*, name: str) -> Client | None:
    """Revoke the active client called ``name``; None when there is none."""
    client = Client.objects.filter(name=name, revoked_at__isnull=True).first()
    if client is None:
        return None
    return client_revoke_by_id(client_id=client.pk)


def client_revoke_by_id(*, client_id: int) -> Client | None:
    """Revoke the client ``client_id``; None when it does not exist or was already revoked.

    The row is never deleted: its tasks and responses keep pointing at it.
    The conditional UPDATE keeps the first revocation's time when two race.
    """
    now = timezone.now()
    if not Client.objects.filter(pk=client_id, revoked_at__isnull=True).update(revoked_at=now):
        return None
    return Client.objects.get(pk=client_id)


def client_touch(*, client: Client) -> None:
    """Record use, at most once per configured interval (a write per request is dear on SQLite)."""
    now = timezone.now()
    resolution = timedelta(seconds=settings.LMSP_CLIENT_LAST_USED_RESOLUTION_SECONDS)
    if client.last_used_at is not None and now - client.last_used_at < resolution:
        return
    # A statistic, not worth a read request's 503: behind a writer frozen with the lock, or on a database that
    # takes no writes now (read-only, full), skip it; the outage itself is logged once (database_outages).
    try:
        with lock_wait(TOUCH_LOCK_WAIT_SECONDS), transaction.atomic():
            Client.objects.filter(pk=client.pk).update(last_used_at=now)
    except OperationalError as error:
        reason = database_unavailability(error)
        if reason is None or reason is Unavailable.UNREACHABLE:
            raise
        logger.debug("client %s: last use not recorded, the database takes no writes now (%s)", client.pk, reason)
        return
    client.last_used_at = now


def _code_normalise(code: str) -> str:
    cleaned = code.strip().upper().replace("-", "").replace(" ", "")
    return cleaned.translate(str.maketrans({"O": "0", "I": "1", "L": "1"}))


def pairing_code_create(*, scopes: Iterable[str] | str, ttl_seconds: int | None = None) -> tuple[PairingCode, str]:
    """A one-time code (shown as ``XXXX-XXXX``) that ``POST /pair`` trades for a token."""
    ttl = settings.LMSP_PAIRING_CODE_TTL_SECONDS if ttl_seconds is None else ttl_seconds
    raw = "".join(secrets.choice(_CODE_ALPHABET) for _ in range(_CODE_LENGTH))
    pairing = PairingCode.objects.create(
        code_hash=token_digest(raw),
        scopes=scopes_parse(scopes),
        expires_at=timezone.now() + timedelta(seconds=ttl),
    )
    return pairing, f"{raw[:4]}-{raw[4:]}"


def pairing_code_redeem(*, code: str, client_name: str) -> tuple[Client, str]:
    """Trade an unused, unexpired, unlocked code for a new client and its token.

    The code is consumed by a conditional UPDATE, so two concurrent redeems
    of one code cannot both succeed; a failure after it rolls the use back.
    A wrong code counts as a failed attempt against every pending code, in
    the same transaction as the refused UPDATE, so each code meets at most
    ``LMSP_PAIRING_MAX_FAILURES`` wrong guesses however many arrive at once.
    """
    now = timezone.now()
    digest = token_digest(_code_normalise(code))
    with transaction.atomic():
        taken = _pairing_codes_redeemable(now).filter(code_hash=digest).update(used_at=now)
        if not taken:
            refusal = _pairing_failure_record(digest=digest, now=now)
        else:
            pairing = PairingCode.objects.get(code_hash=digest)
            client, token = client_create(name=client_name, scopes=pairing.scopes)
            pairing.client = client
            pairing.save(update_fields=["client"])
    if not taken:
        raise refusal
    return client, token


def _pairing_codes_redeemable(now: datetime) -> QuerySet[PairingCode]:
    return PairingCode.objects.filter(
        used_at__isnull=True, expires_at__gt=now, failed_attempts__lt=settings.LMSP_PAIRING_MAX_FAILURES
    )


def _pairing_failure_record(*, digest: str, now: datetime) -> InvalidRequest:
    """Count a refused code against every pending code; the refusal to raise once that is committed."""
    limit = settings.LMSP_PAIRING_MAX_FAILURES
    pending = PairingCode.objects.filter(code_hash=digest, used_at__isnull=True, expires_at__gt=now)
    locked = pending.filter(failed_attempts__gte=limit).exists()
    _pairing_codes_redeemable(now).update(failed_attempts=F("failed_attempts") + 1)
    if locked:
        # Naming it gives nothing away: a locked code can never be redeemed.
        return InvalidRequest(
            "the pairing code is locked after too many failed attempts; make a new one with lmsp_pair",
            errors=[{"field": "code", "message": "locked"}],
        )
    return InvalidRequest(
        "the pairing code is unknown, used or expired",
        errors=[{"field": "code", "message": "unknown, used or expired"}],
    )

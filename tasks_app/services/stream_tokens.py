"""Short-lived, read-only stream tokens for browsers (PROFILE.md section 1).

``EventSource`` cannot send an Authorization header, and a bearer token must
never travel in a URL, where proxies and browser history keep it. A stream
token grants one thing: reading one task's events, for a few minutes. It is
signed with the secret key (nothing is stored) and names the client that
minted it, so revoking the client or its ``read`` scope ends it at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.core import signing

from tasks_app.exceptions import Unauthorized
from tasks_app.models import Client, Task

SALT = "lmsp.stream-token"


@dataclass(frozen=True)
class StreamToken:
    token: str
    task_id: str
    expires_at: datetime


@dataclass(frozen=True)
class StreamGrant:
    """What a valid stream token allows: ``client`` reads ``task_id``'s events."""

    client: Client
    task_id: str


def stream_token_mint(*, client: Client, task: Task) -> StreamToken:
    """A token for ``task``'s event stream; the caller has checked that ``client`` sees it."""
    token = signing.dumps({"t": task.id, "c": client.pk}, salt=SALT, compress=False)
    # ``loads(max_age=...)`` counts from the timestamp signed into the token
    # (``payload:timestamp:signature``), so the expiry we tell is that, exactly.
    signed_at = signing.b62_decode(token.rsplit(":", 2)[-2])
    expires_at = datetime.fromtimestamp(signed_at + settings.LMSP_STREAM_TOKEN_SECONDS, tz=UTC)
    return StreamToken(token=token, task_id=task.id, expires_at=expires_at)


def stream_token_verify(*, token: str) -> StreamGrant:
    """The grant of a valid token; ``Unauthorized`` for a forged, expired or revoked one."""
    try:
        claims = signing.loads(token, salt=SALT, max_age=settings.LMSP_STREAM_TOKEN_SECONDS)
        task_id, client_id = str(claims["t"]), int(claims["c"])
    except signing.SignatureExpired:
        raise Unauthorized("The stream token has expired; mint a new one") from None
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        raise Unauthorized("The stream token is not valid") from None
    client = Client.objects.filter(pk=client_id, revoked_at__isnull=True).first()
    if client is None or not client.has_scope("read"):
        raise Unauthorized("The client that minted this stream token may no longer read")
    return StreamGrant(client=client, task_id=task_id)

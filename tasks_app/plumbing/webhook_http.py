"""One webhook attempt over HTTP: the target rule, the address check, the signature and the signed POST.

Nothing here touches the database: the deliverer's sender threads run only
this (``tasks_app.services.webhook_delivery`` claims and records around it).

The target rule (docs/webhooks.md, "Targets"): an absolute ``http`` or
``https`` URL with a host and no credentials. Unless
LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS is set, every address its host resolves
to must be a global unicast one: a private, loopback, link-local, multicast,
reserved or unspecified address (also inside an IPv4-mapped IPv6 one) is
refused. The check runs at registration and again at each attempt, and the
attempt connects to an address that check just passed (never resolving the
name a second time), so DNS that changes between check and connect (DNS
rebinding) cannot steer that connection elsewhere. Not covered: redirects are
not followed at all (a 3xx is a failed attempt), and a receiver behind a
public address that forwards inward is that receiver's business.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import ipaddress
import os
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

SECRET_PREFIX = "whsec_"
USER_AGENT = "lmsp-webhooks/1.0"
# Stored errors stay short; a receiver's answer is quoted only this far.
MAX_ERROR_CHARS = 500
ANSWER_PREVIEW_BYTES = 200
# The properties of an address that make it one deliveries may not reach, in the order they are named.
# An attempt ends after this many socket timeouts in all, however its receiver paces its bytes (each
# read alone stays within the timeout): a claim's lease outlasts an attempt (settings check it).
ATTEMPT_TIMEOUTS = 3
_FORBIDDEN = ("unspecified", "loopback", "link_local", "multicast", "private", "reserved")


class WebhookTargetError(Exception):
    """Raised when a webhook URL is not one deliveries may be sent to; the message says why."""


class WebhookTargetUnresolved(WebhookTargetError):
    """Raised when a webhook URL's host does not resolve (now): nothing can be checked or sent."""


@dataclass(frozen=True)
class Target:
    """Where a URL points: scheme, host as written (Host header, TLS name), port, and path with query."""

    scheme: str
    host: str
    port: int
    path: str


@dataclass(frozen=True)
class AttemptOutcome:
    """What one attempt got: ``delivered`` on a 2xx; else the status (if any answer came) and why."""

    delivered: bool
    status_code: int | None
    error: str
    elapsed_ms: int


def new_signing_secret() -> str:
    """``whsec_`` and the base64 of 32 random bytes (the form the openai package's ``unwrap`` decodes)."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode("ascii")


def signing_secret_hint(secret: str) -> str:
    return f"{SECRET_PREFIX}...{secret[-4:]}"


def webhook_signature(*, secret: str, webhook_id: str, timestamp: int, payload: str) -> str:
    """Standard Webhooks ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{payload}">``, keyed with the secret's bytes."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{webhook_id}.{timestamp}.{payload}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def target_parse(url: str) -> Target:
    """The target of ``url``, or ``WebhookTargetError`` saying what is wrong with it."""
    if any(char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in url):
        raise WebhookTargetError("must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise WebhookTargetError(f"is not a valid URL ({error})") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookTargetError("must be an absolute http or https URL")
    if parts.username is not None or parts.password is not None:
        raise WebhookTargetError("must not carry credentials")
    host = parts.hostname or ""
    try:
        # The name as DNS and the TLS check see it (IDNA); an IPv6 literal passes unchanged.
        host = host.encode("idna").decode("ascii") if host else host
    except UnicodeError:
        raise WebhookTargetError("has a host name that is not valid") from None
    if not host:
        raise WebhookTargetError("must name a host")
    if port == 0:
        raise WebhookTargetError("has an invalid port")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), path)


def address_refusal(address: str) -> str | None:
    """Why deliveries may not reach ``address`` (e.g. ``"loopback"``), or None for a global unicast one."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name in _FORBIDDEN:
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    return None if ip.is_global else "non-global"


def target_addresses(target: Target, *, allow_private: bool) -> list[tuple[str, int]]:
    """The addresses ``target`` resolves to now, each checked; refused if any of them is not allowed."""
    try:
        found = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise WebhookTargetUnresolved(f"host {target.host!r} does not resolve ({error})") from None
    addresses = list(dict.fromkeys((info[4][0], target.port) for info in found))
    if not allow_private:
        for address, _ in addresses:
            if (why := address_refusal(address)) is not None:
                raise WebhookTargetError(
                    f"host {target.host!r} resolves to {address} ({why} address), "
                    "allowed only with LMSP_WEBHOOK_ALLOW_PRIVATE_TARGETS"
                )
    return addresses


class _Watchdog:
    """Shuts an attempt's socket down once ``seconds`` passed, so that its blocked read ends."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float) -> None:
        self.connection, self.seconds, self.fired = connection, seconds, False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def cancel(self) -> None:
        self._timer.cancel()


class _CheckedHTTPConnection(http.client.HTTPConnection):
    """Connects to the checked addresses only (never resolving the name again); Host stays the URL's."""

    def __init__(self, target: Target, addresses: Sequence[tuple[str, int]], timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._addresses = list(addresses)

    def connect(self) -> None:
        failure: OSError | None = None
        for address in self._addresses:
            try:
                self.sock = socket.create_connection(address, self.timeout)
                return
            except OSError as error:
                failure = error
        raise failure or OSError("no address to connect to")


class _CheckedHTTPSConnection(_CheckedHTTPConnection):
    """The same over TLS: the certificate is checked against the URL's host name."""

    default_port = 443  # the Host header names the port only when it is not this

    def __init__(self, target: Target, addresses: Sequence[tuple[str, int]], timeout: float) -> None:
        super().__init__(target, addresses, timeout)
        self._tls = ssl.create_default_context()

    def connect(self) -> None:
        super().connect()
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host)


def webhook_post(
    *, url: str, webhook_id: str, payload: str, secrets: Sequence[str], timeout: float, allow_private: bool
) -> AttemptOutcome:
    """One signed POST of ``payload`` to ``url``: checked, sent, answered; never raises for the network.

    ``webhook-timestamp`` is this attempt's time, so every attempt is signed
    anew; with two secrets (a rotation that keeps the old one) both sign.
    Redirects are not followed; anything but a 2xx is a failed attempt.
    """
    started = time.monotonic()

    def outcome(delivered: bool, status: int | None, error: str) -> AttemptOutcome:
        return AttemptOutcome(delivered, status, error[:MAX_ERROR_CHARS], int((time.monotonic() - started) * 1000))

    try:
        target = target_parse(url)
        addresses = target_addresses(target, allow_private=allow_private)
    except WebhookTargetError as error:
        return outcome(False, None, f"target refused: the URL {error}")
    timestamp = int(time.time())
    signatures = [
        webhook_signature(secret=s, webhook_id=webhook_id, timestamp=timestamp, payload=payload) for s in secrets
    ]
    headers = {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signatures),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }
    kind = _CheckedHTTPSConnection if target.scheme == "https" else _CheckedHTTPConnection
    connection = kind(target, addresses, timeout)
    watchdog = _Watchdog(connection, ATTEMPT_TIMEOUTS * timeout)
    late = f"no answer within {watchdog.seconds:g} s (3 x LMSP_WEBHOOK_TIMEOUT_SECONDS)"
    try:
        connection.request("POST", target.path, body=payload.encode("utf-8"), headers=headers)
        answer = connection.getresponse()
        preview = answer.read(ANSWER_PREVIEW_BYTES).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as error:
        if watchdog.fired:
            return outcome(False, None, late)
        return outcome(False, None, f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    finally:
        watchdog.cancel()
        connection.close()
    if watchdog.fired:
        # The shutdown ends a read as if the receiver had closed: a status line cut at "HTTP/1.1 200" and
        # no headers still parse as a 200, so an answer the deadline cut is never taken as one.
        return outcome(False, None, late)
    if 200 <= answer.status < 300:
        return outcome(True, answer.status, "")
    return outcome(False, answer.status, f"HTTP {answer.status} {answer.reason}: {preview}".rstrip(": "))

"""Parsing and checking of the edge settings (hosts, proxies, origins); a bad value stops the start."""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# Binding to every interface names no host a client would send.
_WILDCARD_BINDS = {"", "0.0.0.0", "::"}


def env_list(name: str) -> list[str]:
    """A comma-separated environment variable; empty when unset."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def allowed_hosts_default(bound_host: str) -> list[str]:
    """The host the service is bound to (``LMSP_HOST``) and the loopback names, as ALLOWED_HOSTS entries."""
    bare = bound_host.strip().strip("[]")
    named = [] if bare in _WILDCARD_BINDS else [f"[{bare}]" if ":" in bare else bare]
    return list(dict.fromkeys([*named, *LOOPBACK_HOSTS]))


def env_networks(name: str) -> list[str]:
    """Addresses and CIDR networks, checked; kept as text (``tasks_app.edge.throttles`` compiles them)."""
    networks = []
    for entry in env_list(name):
        try:
            networks.append(str(ipaddress.ip_network(entry, strict=False)))
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {entry!r} is not an IP address or network (CIDR)") from None
    return networks


def env_origins(name: str) -> list[str]:
    """Origins as browsers send them (``scheme://host[:port]``, lower case), or ``*`` for any."""
    origins = []
    for entry in env_list(name):
        if entry == "*":
            origins.append(entry)
            continue
        parts = urlsplit(entry.rstrip("/"))
        if parts.scheme not in {"http", "https"} or not parts.netloc or parts.path or parts.query or parts.fragment:
            raise ImproperlyConfigured(f"{name}: {entry!r} is not an origin such as https://app.example:8443")
        origins.append(f"{parts.scheme}://{parts.netloc}".lower())
    return origins

"""Rate limits of the public endpoints, counted in Redis and keyed on the client's real address.

The counts live in Redis, not in a process's memory: every web process of
the installation shares them and a restart of one does not reset them
(docs/security.md says why Redis and not the database).
"""

from __future__ import annotations

import ipaddress
import logging
from functools import lru_cache

import redis
from django.conf import settings
from django.http import HttpRequest
from rest_framework.throttling import SimpleRateThrottle

from tasks_app.exceptions import RateLimitUnavailable
from tasks_app.plumbing import notify

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# One IPv6 host usually owns a whole /64: counting single addresses would
# give it 2**64 budgets.
_IPV6_CLIENT_PREFIX = 64
# What a refused request is told when the counter cannot be reached.
_UNAVAILABLE_RETRY_AFTER_SECONDS = 5


@lru_cache(maxsize=8)
def _networks(configured: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in configured)


def _address(raw: str) -> IPAddress | None:
    text = raw.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "192.0.2.1:443"
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # A dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d.
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _trusted(address: IPAddress | None, networks: tuple[IPNetwork, ...]) -> bool:
    return address is not None and any(address in network for network in networks)


def client_address(request: HttpRequest) -> str:
    """The address a request came from, as far as it can be trusted.

    The peer (``REMOTE_ADDR``), unless the peer is one of
    ``LMSP_TRUSTED_PROXIES``: then the right-most ``X-Forwarded-For`` hop
    that is not a trusted proxy, since only the hops our own proxies
    appended are true; whatever lies left of them the client wrote itself.
    """
    peer = request.META.get("REMOTE_ADDR") or ""
    networks = _networks(tuple(settings.LMSP_TRUSTED_PROXIES))
    if not _trusted(_address(peer), networks):
        return peer
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _trusted(_address(hop), networks):
            return hop
    return hops[0] if hops else peer


def _client_key(address: str) -> str:
    parsed = _address(address)
    if parsed is None:
        return address[:100]
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{parsed}/{_IPV6_CLIENT_PREFIX}", strict=False))
    return str(parsed)


class RedisRateThrottle(SimpleRateThrottle):
    """At most the scope's rate of requests per client address per window, across all web processes.

    A fixed window per address: the first request of a window creates its
    counter with the window as expiry, every request adds one. Without
    Redis the request is refused with a 503, never let through uncounted.
    """

    def get_cache_key(self, request, view) -> str:
        return notify.key("throttle", self.scope, _client_key(client_address(request)))

    def allow_request(self, request, view) -> bool:
        name = self.get_cache_key(request, view)
        try:
            with notify.redis_client().pipeline(transaction=True) as pipe:
                pipe.set(name, 0, ex=self.duration, nx=True)
                pipe.incr(name)
                pipe.ttl(name)
                _, count, ttl = pipe.execute()
        except redis.RedisError as error:
            logger.warning("rate limit of %s unavailable: %s", self.scope, error)
            raise RateLimitUnavailable(
                "The rate limit cannot be checked right now; retry shortly",
                headers={"Retry-After": str(_UNAVAILABLE_RETRY_AFTER_SECONDS)},
            ) from None
        self._wait = max(int(ttl), 1)
        return count <= self.num_requests

    def wait(self) -> float:
        return self._wait


class PairThrottle(RedisRateThrottle):
    """``POST /pair``: ``LMSP_PAIR_RATE`` per address (each code also locks after failed guesses)."""

    scope = "pair"


def throttle_reset(*, scope: str) -> int:
    """Forget every address's count in ``scope``; returns how many were dropped."""
    client = notify.redis_client()
    names = list(client.scan_iter(match=notify.key("throttle", scope, "*"), count=1000))
    return client.delete(*names) if names else 0

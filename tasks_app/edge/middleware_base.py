"""A base for middlewares that run on whichever side, sync or async, the rest of the chain runs on.

Under ASGI a sync-only middleware pushes the async views (event streams)
through a thread; one that is only async costs the sync views a hop. A
subclass says what to answer instead of calling on (``before``) and what to
do to the answer (``after``); both run on the event loop or the request's
thread without any I/O of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse


class SyncAndAsyncMiddleware:
    """Calls ``before``, then (unless it answered) the rest of the chain, then ``after``."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        answered = self.before(request)
        if self.is_async:
            return self._acall(request, answered)
        return answered if answered is not None else self.after(request, self.get_response(request))

    async def _acall(self, request: HttpRequest, answered: HttpResponse | None) -> HttpResponse:
        return answered if answered is not None else self.after(request, await self.get_response(request))

    def before(self, request: HttpRequest) -> HttpResponse | None:
        """The answer to give instead of calling on; None to call on."""
        return None

    def after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        """The answer of the rest of the chain, as it is to go out."""
        return response

"""The base of every DRF view of the API: the scopes each method needs, and strict input.

Protocol-neutral: LMSP's own views (``tasks_app.api``) and the OpenAI adapters
(``tasks_app.openai``) build on it alike; ``auth.HasRequiredScopes`` reads
``required_scopes``.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers
from rest_framework.views import APIView

READ = ("read",)
WRITE = ("responses",)


class ScopedAPIView(APIView):
    """``required_scopes`` per HTTP method; ``None`` marks a public method."""

    scopes_by_method: dict[str, tuple[str, ...] | None] = {}

    @property
    def allowed_methods(self) -> list[str]:
        # DRF offers OPTIONS on every view, but without a metadata class it
        # answers 405: the ``Allow`` of every answer must not list it.
        return [method for method in super().allowed_methods if method != "OPTIONS"]

    @property
    def required_scopes(self) -> tuple[str, ...] | None:
        method = "GET" if self.request.method == "HEAD" else self.request.method
        if method in self.scopes_by_method:
            return self.scopes_by_method[method]
        # A method the view does not serve gets its 405 without a token; a
        # handler someone forgot to list still needs one.
        if method == "OPTIONS" or not hasattr(self, method.lower()):
            return None
        return ()


def validated(serializer_class: type[serializers.BaseSerializer], data: Any) -> Any:
    """What ``serializer_class`` makes of ``data``; its ``ValidationError`` (a 400 problem) otherwise."""
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data

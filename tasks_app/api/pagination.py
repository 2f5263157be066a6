"""The list endpoints' query (``?limit=&after=``) and envelope (PROFILE.md section 7)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from tasks_app.edge.strict_json import StrictSerializer

MAX_AFTER = 200


class ListQuerySerializer(StrictSerializer):
    """``?limit=&after=`` of every list endpoint (query strings are text)."""

    limit = serializers.IntegerField(required=False, default=20, min_value=1, max_value=100)
    after = serializers.CharField(required=False, min_length=1, max_length=MAX_AFTER, trim_whitespace=False)


def list_body(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The list envelope of PROFILE.md section 7."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }

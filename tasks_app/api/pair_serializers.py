"""The input and output serializers of ``POST /pair``."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from tasks_app.edge.strict_json import StrictCharField, StrictSerializer


class PairInputSerializer(StrictSerializer):
    """A pairing code to trade for a new client's token (PROFILE.md section 1)."""

    # Not trimmed here: the service normalises the code and the name (so the schema's lengths hold as sent).
    code = StrictCharField(min_length=1, max_length=32, trim_whitespace=False)
    client_name = StrictCharField(min_length=1, max_length=100, trim_whitespace=False)


class ClientOutputSerializer(serializers.BaseSerializer):
    """The reply of ``POST /pair``: the only time the token is shown."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        client, token = instance
        return {"object": "client", "name": client.name, "scopes": client.scopes, "token": token}

"""The input and output serializers of ``/tasks`` (chapter 7)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

from rest_framework import serializers

from tasks_app.api.pagination import ListQuerySerializer
from tasks_app.core.wire import events_url, task_object, unix_seconds
from tasks_app.edge.strict_json import StrictChoiceField, StrictSerializer
from tasks_app.ids import TASK_PREFIX
from tasks_app.models import TaskType
from tasks_app.openai.responses.serializers import ResponseRequestSerializer
from tasks_app.states import RestartPolicy, TaskStatus


class TaskCreateInputSerializer(StrictSerializer):
    """The task envelope of chapter 7.1."""

    type = StrictChoiceField(choices=TaskType.values)
    input = ResponseRequestSerializer()
    on_restart = StrictChoiceField(choices=RestartPolicy.values, required=False, default=RestartPolicy.FAIL)


# The query parameters' schemas where a plain string would say less than the server checks.
TASK_ID_PATTERN = rf"^{TASK_PREFIX}[0-7][0-9A-HJKMNP-TV-Z]{{25}}$"
TASK_AFTER_SCHEMA = {"type": "string", "pattern": TASK_ID_PATTERN}
_STATUS = f"(?:{'|'.join(TaskStatus.values)})"
TASK_STATUS_SCHEMA = {"type": "string", "pattern": f"^{_STATUS}(?:,{_STATUS})*$"}


class TaskListQuerySerializer(ListQuerySerializer):
    status = serializers.CharField(required=False, trim_whitespace=False)

    def validate_after(self, value: str) -> str:
        # fullmatch: the id pattern's ``$`` would also match before a trailing newline.
        if not re.fullmatch(TASK_ID_PATTERN, value):
            raise serializers.ValidationError("must be a task id")
        return value

    def validate_status(self, value: str) -> list[str]:
        if not re.fullmatch(TASK_STATUS_SCHEMA["pattern"], value):
            raise serializers.ValidationError(f"must be one or more of {', '.join(TaskStatus.values)}, comma-separated")
        return value.split(",")


class TaskOutputSerializer(serializers.BaseSerializer):
    """A task; ``context["queue_positions"]`` holds the queued ones' places (``selectors.task_queue_positions``)."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return task_object(instance, self.context.get("queue_positions", {}).get(instance.id))


class StreamTokenOutputSerializer(serializers.BaseSerializer):
    """A minted stream token and the URL an ``EventSource`` opens with it."""

    def to_representation(self, instance: Any) -> dict[str, Any]:
        return {
            "object": "stream_token",
            "token": instance.token,
            "task_id": instance.task_id,
            "expires_at": unix_seconds(instance.expires_at),
            "events_url": f"{events_url(instance.task_id)}?{urlencode({'token': instance.token})}",
        }

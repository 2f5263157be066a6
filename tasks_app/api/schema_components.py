"""The schema-only components: the objects the API answers, as serializers spectacular reads.

They never render anything: ``tasks_app/core/wire.py`` and the output serializers
build the real bodies; ``tests/test_openapi.py`` checks those against these.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema_serializer
from rest_framework import serializers

from tasks_app.api.schema_annotations import EVENT_TYPES
from tasks_app.api.schema_problems import problem_codes
from tasks_app.models import ModelLayout, TaskType
from tasks_app.openai.responses.serializers import MAX_METADATA_PAIRS
from tasks_app.services.capabilities import EXTENSIONS
from tasks_app.services.clients import SCOPES
from tasks_app.states import ResponseStatus, RestartPolicy, TaskStatus


@extend_schema_serializer(component_name="ProblemFieldError")
class ProblemFieldErrorSchema(serializers.Serializer):
    field = serializers.CharField(
        help_text="Where: a dotted path into the body (`input.model`, `input.input[0].role`), "
        "or the query parameter or header at fault (`starting_after`, `Idempotency-Key`)."
    )
    message = serializers.CharField()


@extend_schema_serializer(component_name="SdkError")
class SdkErrorSchema(serializers.Serializer):
    """The problem again, in the shape the ``openai`` package reads (its exception's text and attributes)."""

    message = serializers.CharField(help_text="`code: detail`, what `str(exc)` of the openai package shows.")
    type = serializers.ChoiceField(choices=["invalid_request_error", "server_error"])
    param = serializers.CharField(allow_null=True, help_text="The first field of `errors`, or null.")
    code = serializers.ChoiceField(choices=problem_codes())


@extend_schema_serializer(component_name="Problem")
class ProblemSchema(serializers.Serializer):
    """An RFC 9457 problem (``application/problem+json``); also a failed task's or response's ``error``."""

    type = serializers.CharField(help_text="`urn:lmsp:problem:` followed by `code`.")
    title = serializers.CharField(help_text="Fixed per code.")
    status = serializers.IntegerField(help_text="The HTTP status that goes with `code`.")
    detail = serializers.CharField(help_text="What went wrong with this request, for people.")
    code = serializers.ChoiceField(choices=problem_codes(), help_text="What programs branch on.")
    instance = serializers.CharField(
        required=False, help_text="The request path. Absent in a task's or response's `error`."
    )
    param = serializers.CharField(
        required=False,
        help_text="`unsupported_parameter` only: the field (its path in the body) that asks for what the "
        "service does not do.",
    )
    errors = ProblemFieldErrorSchema(
        many=True, required=False, help_text="Validation errors, one per offending field (400 only)."
    )
    message = serializers.CharField(
        required=False,
        help_text="Extension: in a task's or response's `error` only, `code: detail`, which OpenAI's "
        "`ResponseError` requires.",
    )
    error = SdkErrorSchema(
        required=False,
        help_text="Extension: in every HTTP answer (absent in a task's or response's `error`), "
        "for clients written against OpenAI's error shape.",
    )


@extend_schema_serializer(component_name="InputTokensDetails")
class InputTokensDetailsSchema(serializers.Serializer):
    cached_tokens = serializers.IntegerField(
        min_value=0, help_text="Input tokens the worker's prefix cache held: their model calls were skipped."
    )
    cache_write_tokens = serializers.IntegerField(min_value=0, help_text="Always 0: storing a prefix costs nothing.")


@extend_schema_serializer(component_name="OutputTokensDetails")
class OutputTokensDetailsSchema(serializers.Serializer):
    reasoning_tokens = serializers.IntegerField(min_value=0, help_text="0: no reasoning is counted apart.")


@extend_schema_serializer(component_name="Usage")
class UsageSchema(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    input_tokens_details = InputTokensDetailsSchema()
    output_tokens = serializers.IntegerField()
    output_tokens_details = OutputTokensDetailsSchema()
    total_tokens = serializers.IntegerField()


@extend_schema_serializer(component_name="OutputText")
class OutputTextSchema(serializers.Serializer):
    type = serializers.ChoiceField(choices=["output_text"])
    text = serializers.CharField()
    annotations = serializers.ListField(child=serializers.DictField())
    logprobs = serializers.ListField(
        child=serializers.DictField(), help_text="Always empty: log probabilities are not returned."
    )


@extend_schema_serializer(component_name="OutputMessage")
class OutputMessageSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`msg_` + ULID.")
    type = serializers.ChoiceField(choices=["message"])
    status = serializers.ChoiceField(choices=["in_progress", "completed", "incomplete"])
    role = serializers.ChoiceField(choices=["assistant"])
    content = OutputTextSchema(many=True)


@extend_schema_serializer(component_name="OutputFunctionCall")
class OutputFunctionCallSchema(serializers.Serializer):
    """A call of one of the request's function tools (PROFILE.md 10.4, docs/tools.md)."""

    id = serializers.CharField(help_text="`fc_` + ULID.")
    type = serializers.ChoiceField(choices=["function_call"])
    status = serializers.ChoiceField(choices=["in_progress", "completed", "incomplete"])
    call_id = serializers.CharField(
        help_text="`call_` + ULID (9 letters and digits for a Mistral model): the id its output is sent back with."
    )
    name = serializers.CharField()
    arguments = serializers.CharField(help_text="The arguments as JSON text (empty while none are written).")


OUTPUT_ITEM = PolymorphicProxySerializer(
    component_name="OutputItem",
    serializers={"message": OutputMessageSchema, "function_call": OutputFunctionCallSchema},
    resource_type_field_name="type",
    many=True,
)


@extend_schema_serializer(component_name="IncompleteDetails")
class IncompleteDetailsSchema(serializers.Serializer):
    reason = serializers.ChoiceField(choices=["max_output_tokens"])


_SAMPLING_ECHO = "Extension: as the request sent it; null leaves it to the model's generation config."
_IN_FORCE = "The value the generation uses: the request's, else the model's generation config's, else neutral."


@extend_schema_serializer(component_name="ConversationRef")
class ConversationRefSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`conv_` + ULID.")


@extend_schema_serializer(component_name="Response")
class ResponseSchema(serializers.Serializer):
    """The response object (PROFILE.md section 3), with every member OpenAI's and the Open Responses schema
    require (PROFILE.md 10.1)."""

    id = serializers.CharField(help_text="`resp_` + ULID.")
    object = serializers.ChoiceField(choices=["response"])
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    completed_at = serializers.IntegerField(allow_null=True, help_text="Unix seconds once finished, else null.")
    status = serializers.ChoiceField(choices=ResponseStatus.values)
    model = serializers.CharField()
    output = OUTPUT_ITEM
    usage = UsageSchema(help_text="Zeros until the response finishes.")
    error = ProblemSchema(allow_null=True, help_text="Set when `status` is `failed`.")
    incomplete_details = IncompleteDetailsSchema(allow_null=True)
    instructions = serializers.CharField(allow_null=True)
    max_output_tokens = serializers.IntegerField(allow_null=True)
    temperature = serializers.FloatField(help_text=_IN_FORCE)
    top_p = serializers.FloatField(help_text=_IN_FORCE)
    top_k = serializers.IntegerField(allow_null=True, help_text=_SAMPLING_ECHO)
    min_p = serializers.FloatField(allow_null=True, help_text=_SAMPLING_ECHO)
    repetition_penalty = serializers.FloatField(allow_null=True, help_text=_SAMPLING_ECHO)
    # PROFILE.md 10.1: what the request accepted, echoed with OpenAI's defaults for what it left out.
    previous_response_id = serializers.CharField(allow_null=True)
    conversation = ConversationRefSchema(
        required=False,
        help_text="The conversation it reads and adds to (PROFILE.md 12.1); absent when the request named none.",
    )
    tools = serializers.ListField(
        child=serializers.DictField(),
        help_text="The request's tools; function tools with `description`, `parameters` and `strict` filled in.",
    )
    tool_choice = serializers.JSONField(help_text="`auto` unless the request said otherwise.")
    parallel_tool_calls = serializers.BooleanField()
    max_tool_calls = serializers.IntegerField(allow_null=True)
    text = serializers.DictField(
        help_text='`format` (`{"type": "text"}`; a `json_schema` one with `description` and `strict` filled in) '
        "and `verbosity`."
    )
    truncation = serializers.ChoiceField(choices=["disabled", "auto"])
    top_logprobs = serializers.IntegerField()
    reasoning = serializers.DictField()
    service_tier = serializers.ChoiceField(choices=["auto", "default"])
    store = serializers.BooleanField()
    user = serializers.CharField(required=False, help_text="As the request gave it; absent when it gave none.")
    safety_identifier = serializers.CharField(allow_null=True)
    prompt_cache_key = serializers.CharField(allow_null=True)
    prompt_cache_retention = serializers.CharField(allow_null=True)
    prompt_cache_options = serializers.DictField(
        required=False, help_text="As the request gave it: a hint; absent when it gave none."
    )
    image = serializers.DictField(allow_null=True, help_text="As the request gave it.")
    frequency_penalty = serializers.FloatField(help_text="As the request sent it, else 0.")
    presence_penalty = serializers.FloatField(help_text="As the request sent it, else 0.")
    metadata = serializers.DictField(child=serializers.CharField(), help_text=f"At most {MAX_METADATA_PAIRS} pairs.")
    background = serializers.BooleanField(
        help_text="Extension: created with `background: true` (answered at once, followed by reads or webhooks)."
    )
    queue_position = serializers.IntegerField(
        allow_null=True,
        min_value=1,
        help_text="Extension: the place in the line while `queued` (1 = next to start), else null. "
        "Only a read knows it: the copies in events say null.",
    )
    stop_sequence = serializers.CharField(
        allow_null=True,
        help_text="Extension: the request's stop string that ended the output, if one did; else null.",
    )


@extend_schema_serializer(component_name="DeletedResponse")
class DeletedResponseSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`resp_` + ULID.")
    object = serializers.ChoiceField(choices=["response"])
    deleted = serializers.BooleanField()


@extend_schema_serializer(component_name="Task")
class TaskSchema(serializers.Serializer):
    """The task object (chapter 7.1)."""

    id = serializers.CharField(help_text="`task_` + ULID.")
    object = serializers.ChoiceField(choices=["task"])
    type = serializers.ChoiceField(choices=TaskType.values)
    status = serializers.ChoiceField(choices=TaskStatus.values)
    created_at = serializers.IntegerField(help_text="Unix seconds.")
    updated_at = serializers.IntegerField(help_text="Unix seconds.")
    response_id = serializers.CharField(help_text="`resp_` + ULID, fixed at creation.")
    events_url = serializers.CharField(help_text="Path of the task's event stream.")
    on_restart = serializers.ChoiceField(choices=RestartPolicy.values)
    response = ResponseSchema(allow_null=True, help_text="The response once `status` is `succeeded`, else null.")
    error = ProblemSchema(allow_null=True, help_text="Why the task failed once `status` is `failed`, else null.")
    queue_position = serializers.IntegerField(
        allow_null=True,
        min_value=1,
        help_text="Extension: the place in the line while `queued` (1 = next to start, in order of "
        "acceptance), else null.",
    )


class _PageSchema(serializers.Serializer):
    """The list envelope every page shares; subclasses add ``data``."""

    object = serializers.ChoiceField(choices=["list"])
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True, help_text="Pass as `after` for the next page.")
    has_more = serializers.BooleanField()


@extend_schema_serializer(component_name="TaskList")
class TaskListSchema(_PageSchema):
    data = TaskSchema(many=True)


@extend_schema_serializer(component_name="ModelCapabilities")
class ModelCapabilitiesSchema(serializers.Serializer):
    resumable_snapshots = serializers.BooleanField(help_text="`on_restart: resume` is accepted for this model.")
    chat_template = serializers.BooleanField()


@extend_schema_serializer(component_name="Model")
class ModelSchema(serializers.Serializer):
    id = serializers.CharField(help_text="`name` or `name:tag`.")
    object = serializers.ChoiceField(choices=["model"])
    created = serializers.IntegerField(help_text="Unix seconds.")
    owned_by = serializers.CharField()
    backend = serializers.CharField()
    digest = serializers.CharField(help_text="`sha256:` of the model's files.")
    size_bytes = serializers.IntegerField()
    capabilities = ModelCapabilitiesSchema()
    context_length = serializers.IntegerField(allow_null=True)
    layout = serializers.ChoiceField(
        choices=ModelLayout.values,
        help_text="How the model's folder is laid out (docs/models.md): `optimum`, `onnx-community`, `genai` "
        "or `optimum-merged`. An extension of LMSP 1.0.",
    )


@extend_schema_serializer(component_name="ModelList")
class ModelListSchema(_PageSchema):
    data = ModelSchema(many=True)


@extend_schema_serializer(component_name="Capabilities")
class CapabilitiesSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["capabilities"])
    lmsp_version = serializers.CharField()
    service_id = serializers.CharField(help_text="This installation's stable id.")
    event_resume = serializers.BooleanField()
    task_types = serializers.ListField(child=serializers.ChoiceField(choices=TaskType.values))
    on_restart = serializers.ListField(child=serializers.ChoiceField(choices=RestartPolicy.values))
    idempotency = serializers.BooleanField()
    pairing = serializers.BooleanField()
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES))
    max_request_bytes = serializers.IntegerField(help_text="Larger request bodies are refused with 413.")
    extensions = serializers.ListField(
        child=serializers.ChoiceField(choices=EXTENSIONS),
        help_text="This service's extensions beyond LMSP 1.0 (docs/openai.md, docs/webhooks.md).",
    )
    protocols = serializers.DictField(
        child=serializers.CharField(allow_blank=True),
        help_text="Each protocol this service speaks (lmsp, openai, anthropic, ollama) and the base URL its "
        "clients are given, relative to this host (docs/anthropic.md, docs/ollama.md).",
    )


@extend_schema_serializer(component_name="StreamToken")
class StreamTokenSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["stream_token"])
    token = serializers.CharField(help_text="Read-only, for this task's event stream only.")
    task_id = serializers.CharField()
    expires_at = serializers.IntegerField(help_text="Unix seconds.")
    events_url = serializers.CharField(help_text="The event stream's path with `?token=`, for `EventSource`.")


@extend_schema_serializer(component_name="PairedClient")
class PairedClientSchema(serializers.Serializer):
    object = serializers.ChoiceField(choices=["client"])
    name = serializers.CharField()
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=SCOPES))
    token = serializers.CharField(help_text="The bearer token. Shown this once; only its hash is stored.")


def stream_event_schema() -> dict[str, Any]:
    """One event as the ``data:`` line of a frame carries it (and as the event log stores it)."""

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    return {
        "type": "object",
        "description": "One event of a task's log: the JSON of an SSE frame's `data:` line.",
        "required": ["type", "sequence_number"],
        "properties": {
            "type": {"type": "string", "enum": list(EVENT_TYPES)},
            "sequence_number": {"type": "integer", "minimum": 0, "description": "0 for `response.created`, +1 each."},
            "response": {
                **ref("Response"),
                "description": "On `response.created`, `response.in_progress` and the terminal events.",
            },
            "item": {"oneOf": [ref("OutputMessage"), ref("OutputFunctionCall")]},
            "item_id": {"type": "string"},
            "output_index": {"type": "integer"},
            "content_index": {"type": "integer"},
            "delta": {
                "type": "string",
                "description": "On `response.output_text.delta`: the next text; on "
                "`response.function_call_arguments.delta`: the next piece of the call's arguments.",
            },
            "name": {"type": "string", "description": "On `response.function_call_arguments.done`: the tool."},
            "arguments": {
                "type": "string",
                "description": "On `response.function_call_arguments.done`: the whole arguments (JSON text).",
            },
            "text": {"type": "string", "description": "On `response.output_text.done`: the whole text."},
            "logprobs": {
                "type": "array",
                "items": {"type": "object"},
                "maxItems": 0,
                "description": "On the `output_text` events: always empty (no log probabilities are computed).",
            },
            "part": ref("OutputText"),
        },
    }


@extend_schema_serializer(component_name="ChatCompletionMessage")
class ChatCompletionMessageSchema(serializers.Serializer):
    role = serializers.ChoiceField(choices=["assistant"])
    content = serializers.CharField(allow_null=True)
    refusal = serializers.CharField(allow_null=True, help_text="Always null: the models here do not refuse apart.")
    tool_calls = serializers.ListField(child=serializers.DictField(), allow_null=True)


@extend_schema_serializer(component_name="ChatCompletionChoice")
class ChatCompletionChoiceSchema(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=0)
    message = ChatCompletionMessageSchema()
    logprobs = serializers.DictField(allow_null=True, help_text="Always null.")
    finish_reason = serializers.ChoiceField(
        choices=["stop", "length", "tool_calls"], help_text="`length`: the token limit or the context ended it."
    )


@extend_schema_serializer(component_name="PromptTokensDetails")
class PromptTokensDetailsSchema(serializers.Serializer):
    cached_tokens = serializers.IntegerField(
        min_value=0, help_text="Prompt tokens the worker's prefix cache held: their model calls were skipped."
    )


@extend_schema_serializer(component_name="CompletionTokensDetails")
class CompletionTokensDetailsSchema(serializers.Serializer):
    reasoning_tokens = serializers.IntegerField(min_value=0, help_text="0: no reasoning is counted apart.")


@extend_schema_serializer(component_name="ChatCompletionUsage")
class ChatCompletionUsageSchema(serializers.Serializer):
    prompt_tokens = serializers.IntegerField(min_value=0)
    completion_tokens = serializers.IntegerField(min_value=0)
    total_tokens = serializers.IntegerField(min_value=0)
    prompt_tokens_details = PromptTokensDetailsSchema()
    completion_tokens_details = CompletionTokensDetailsSchema()


@extend_schema_serializer(component_name="ChatCompletion")
class ChatCompletionSchema(serializers.Serializer):
    """A chat completion (PROFILE.md 10.3): the response of the same request, in Chat Completions' shape."""

    id = serializers.CharField(help_text="`chatcmpl-` + the response's ULID: `resp_` + the same ULID reads it.")
    object = serializers.ChoiceField(choices=["chat.completion"])
    created = serializers.IntegerField(help_text="Unix seconds.")
    model = serializers.CharField()
    choices = ChatCompletionChoiceSchema(many=True)
    usage = ChatCompletionUsageSchema()
    service_tier = serializers.ChoiceField(choices=["auto", "default"])
    system_fingerprint = serializers.CharField(allow_null=True)

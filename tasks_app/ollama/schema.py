"""Ollama's native API in the served OpenAPI schema: the requests, the answers, their NDJSON lines, the errors.

The serializers read ``format``, ``keep_alive``, ``think`` and a tool call's
``arguments`` as plain JSON and the translation (``translate.py``) decides
what each value asks for, refusing by name what this service cannot do; so
the request bodies are written out here, exactly as strict as the two
together, so that a request the schema allows is one the service takes
(apart from the rules across fields no schema states, listed in docs/api.md
"Schema conformance"). The views name these in their ``operation``
annotations; ``tasks_app/api/schema_generator.py`` adds the components
(``SCHEMA_COMPONENTS``) and writes each error answer with ``error_content``,
since these routes answer Ollama's ``{"error": "..."}``, not problem+json.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drf_spectacular.utils import OpenApiResponse

from tasks_app import exceptions as exc
from tasks_app.generation.tool_calls import NAME_RE
from tasks_app.ollama.errors import MODEL_NOT_FOUND, ollama_error
from tasks_app.ollama.serializers import MAX_REPETITION_PENALTY, MAX_SEED, MAX_TOP_K, MIN_REPETITION_PENALTY, ROLES

NDJSON = "application/x-ndjson"
ERROR_MEDIA_TYPE = "application/json"
TAG = "Ollama"
ANONYMOUS_NOTE = (
    " Without an `Authorization` header, a request from a loopback address acts as the client that "
    "`LMSP_OLLAMA_ANONYMOUS` names (with its scopes), when the setting is set; from any other address, or with "
    "the setting empty (the default), a token is required. A request with the header is checked whatever the "
    "setting says."
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


ANY = _ref("JsonValue")
ANY_OBJECT = {"type": "object", "additionalProperties": ANY}
# DRF's CharField trims whitespace before it checks a field is not blank: such a string needs one other character.
NON_BLANK = {"type": "string", "pattern": "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"}
TEXT = {"type": ["string", "null"]}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [{"type": "null"}, schema]}


def _only(*values: Any, why: str) -> dict[str, Any]:
    """A field whose other values are refused by name (``400 unsupported_parameter``)."""
    return {"enum": [*values, None], "description": why}


def _int(**bounds: Any) -> dict[str, Any]:
    return {"type": ["integer", "null"], **bounds}


def _number(**bounds: Any) -> dict[str, Any]:
    return {"type": ["number", "null"], **bounds}


def _flag() -> dict[str, Any]:
    return {"type": ["boolean", "null"]}


OPTIONS = {
    "type": ["object", "null"],
    "properties": {
        "num_predict": {
            "oneOf": [{"type": "null"}, {"type": "integer", "enum": [-1, -2]}, {"type": "integer", "minimum": 1}],
            "description": "The output limit; -1 and -2: none (the context still caps it).",
        },
        "temperature": _number(minimum=0),
        "top_p": _number(exclusiveMinimum=0, maximum=1),
        "top_k": _int(minimum=0, maximum=MAX_TOP_K),
        "min_p": _number(minimum=0, maximum=1),
        "typical_p": _only(1, why="Typical sampling is not implemented: only 1."),
        "tfs_z": _only(1, why="Tail-free sampling is not implemented: only 1."),
        "repeat_penalty": _number(minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY),
        "repeat_last_n": {
            **_int(),
            "description": "Only -1 (the whole context) with a `repeat_penalty` other than 1; else accepted.",
        },
        "presence_penalty": _number(minimum=-2, maximum=2),
        "frequency_penalty": _number(minimum=-2, maximum=2),
        "mirostat": _only(0, why="Mirostat sampling is not implemented: only 0."),
        "mirostat_tau": _number(),
        "mirostat_eta": _number(),
        "penalize_newline": _only(False, why="Newlines are not penalized apart."),
        "seed": _int(minimum=-1, maximum=MAX_SEED, description="-1: a random seed, as Ollama's default."),
        "stop": {
            "type": ["array", "null"],
            "items": {"type": "string"},
            "description": "Stop strings (empty ones are dropped); refused beside `format`, which a stop would cut.",
        },
        "num_ctx": {
            **_int(),
            "description": "At most the model's context (more is `400`); the model's whole context is used.",
        },
        **{name: _int() for name in ("num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread")},
        **{name: _flag() for name in ("numa", "low_vram", "use_mmap", "use_mlock")},
        **{
            name: _only(False, why="Refused by name when true.")
            for name in ("vocab_only", "logits_all", "embedding_only")
        },
    },
    "description": "Ollama's options. A runner's option that asks for nothing this service lacks is accepted "
    "(how a worker loads a model is its own settings); one it cannot honour is refused by name.",
}
FORMAT = {
    "oneOf": [
        {"enum": ["", "json", None], "description": "`json`: any JSON object; empty or null: free text."},
        {
            **ANY_OBJECT,
            "description": "A JSON Schema the answer is generated under (one the grammar engine "
            "cannot enforce is `400`).",
        },
    ],
    "description": "Enforced by constrained decoding.",
}
KEEP_ALIVE = {
    "oneOf": [{"type": "null"}, {"type": "string"}, {"type": "number"}],
    "description": "Accepted (a worker's model cache decides when a model unloads); 0 with nothing to "
    "generate answers `done_reason: unload`.",
}
# What a chat and a generate request share (serializers._GenerationSerializer).
COMMON = {
    "model": {**NON_BLANK, "description": "A registered model (`name` and `name:latest` are one); else `404`."},
    "stream": {**_flag(), "description": "Default true: NDJSON lines; false: one object."},
    "format": FORMAT,
    "options": OPTIONS,
    "keep_alive": KEEP_ALIVE,
    "think": _only(False, why="These models have no thinking mode: true or a level is refused."),
    "logprobs": _only(False, why="Log probabilities are not returned."),
    "top_logprobs": _only(0, why="Log probabilities are not returned."),
}
TOOL_CALL_IN = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": NON_BLANK,
                "arguments": {
                    "oneOf": [{"type": "string"}, ANY_OBJECT],
                    "description": "An object (a string is read as its JSON text).",
                },
                "index": {"type": "integer"},
            },
        },
        "id": NON_BLANK,
        "type": NON_BLANK,
    },
}
NO_IMAGES = {"type": ["array", "null"], "maxItems": 0, "description": "Only empty: text models only."}


def _message(roles: Sequence[str], *, calls: bool) -> dict[str, Any]:
    tool_calls = {"type": ["array", "null"], "items": TOOL_CALL_IN}
    return {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": list(roles)},
            "content": TEXT,
            "thinking": {**TEXT, "description": "An earlier answer's: accepted, left out of the prompt."},
            "images": NO_IMAGES,
            "tool_calls": tool_calls if calls else {**tool_calls, "maxItems": 0},
            "tool_name": {**TEXT, "description": "Role `tool`: the call it answers (else the first open call)."},
            "tool_call_id": TEXT,
        },
    }


TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": NAME_RE.pattern.replace("\\Z", "$"), "description": "Unique."},
                "description": TEXT,
                "parameters": {
                    "oneOf": [{"type": "null"}, ANY_OBJECT],
                    "description": "A JSON Schema the call's arguments are generated under (one the grammar "
                    "engine cannot enforce is `400`).",
                },
            },
        },
    },
}
CHAT_REQUEST = {
    "type": "object",
    "required": ["model"],
    "properties": {
        **COMMON,
        "messages": {
            "type": ["array", "null"],
            "items": {
                "oneOf": [
                    _message([role for role in ROLES if role != "assistant"], calls=False),
                    _message(["assistant"], calls=True),
                ]
            },
            "description": "None or empty: Ollama's load request, answered at once (`done_reason: load`).",
        },
        "tools": {"type": ["array", "null"], "items": TOOL, "description": "Offered under tool choice `auto`."},
    },
    "description": "Ollama's `POST /api/chat` request (PROFILE.md 11.2).",
}
_UNUSED = "Only empty: refused by name (the model's own template is always used, no token context is kept, "
GENERATE_REQUEST = {
    "type": "object",
    "required": ["model"],
    "properties": {
        **COMMON,
        "prompt": {**TEXT, "description": "One user turn; none or empty: a load request (`done_reason: load`)."},
        "system": {**TEXT, "description": "The instructions."},
        "suffix": {**TEXT, "maxLength": 0, "description": "Only empty: no fill-in-the-middle."},
        "template": {**TEXT, "maxLength": 0, "description": "Only empty: the model's own template is used."},
        "context": {
            "type": ["array", "null"],
            "maxItems": 0,
            "items": {"type": "integer"},
            "description": "Only empty: no token context is kept (send the conversation to `/api/chat`).",
        },
        "raw": _only(False, why="A raw prompt would bypass the chat template."),
        "images": NO_IMAGES,
        **{name: {"type": "null", "description": "No image generation."} for name in ("width", "height", "steps")},
    },
    "description": "Ollama's `POST /api/generate` request (PROFILE.md 11.2).",
}
SHOW_REQUEST = {
    "type": "object",
    "properties": {
        "model": NON_BLANK,
        "name": {**NON_BLANK, "description": "The older spelling of `model`."},
        "verbose": {**_flag(), "description": "Accepted: asks for nothing more here."},
    },
}
PULL_REQUEST = {
    "type": "object",
    "properties": {
        "model": {**NON_BLANK, "description": "`hf.co/<owner>/<repo>[:<variant>]` or `<owner>/<repo>[:<variant>]`."},
        "name": {**NON_BLANK, "description": "The older spelling of `model`."},
        "stream": {**_flag(), "description": "Default true: progress lines; false: one status at the end."},
        "insecure": {**_flag(), "description": "Accepted (the pull is over HTTPS)."},
    },
}

# --- answers ------------------------------------------------------------------------------------------

_COUNT = {"type": "integer", "minimum": 0}
_DETAILS = {
    "type": "object",
    "required": ["parent_model", "format", "family", "families", "parameter_size", "quantization_level"],
    "properties": {
        "parent_model": {"type": "string"},
        "format": {"type": "string", "enum": ["onnx"]},
        "family": {"type": "string", "description": "The config's `model_type`."},
        "families": {"type": ["array", "null"], "items": {"type": "string"}},
        "parameter_size": {"type": "string", "description": '"": not counted.'},
        "quantization_level": {"type": "string", "description": "From the graph's name: `model_q4.onnx` is `Q4`."},
    },
}
_ENTRY_PROPERTIES = {
    "name": {"type": "string"},
    "model": {"type": "string"},
    "modified_at": {"type": "string"},
    "size": _COUNT,
    "digest": {"type": "string"},
    "details": _ref("OllamaModelDetails"),
}
_ENTRY = {"type": "object", "required": list(_ENTRY_PROPERTIES), "properties": _ENTRY_PROPERTIES}
_RUNNING = {
    "type": "object",
    "required": [*_ENTRY_PROPERTIES, "expires_at", "size_vram", "context_length"],
    "properties": {
        **_ENTRY_PROPERTIES,
        "expires_at": {"type": "null", "description": "When it unloads is the worker's cache's choice."},
        "size_vram": {"type": "integer", "enum": [0]},
        "context_length": {"type": ["integer", "null"]},
    },
}
VERSION_ANSWER = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
TAGS_ANSWER = {"type": "object", "required": ["models"], "properties": {"models": {"type": "array", "items": _ENTRY}}}
PS_ANSWER = {"type": "object", "required": ["models"], "properties": {"models": {"type": "array", "items": _RUNNING}}}
SHOW_ANSWER = {
    "type": "object",
    "required": [
        "license",
        "modelfile",
        "parameters",
        "template",
        "details",
        "model_info",
        "capabilities",
        "modified_at",
    ],
    "properties": {
        "license": {"type": "string"},
        "modelfile": {"type": "string"},
        "parameters": {"type": "string", "description": "The generation config's defaults, Modelfile-style."},
        "template": {"type": "string", "description": 'The chat template\'s source ("": not readable here).'},
        "details": _ref("OllamaModelDetails"),
        "model_info": {"type": "object", "description": "`general.architecture`, `<arch>.context_length`, ..."},
        "capabilities": {"type": "array", "items": {"type": "string", "enum": ["completion", "tools"]}},
        "modified_at": {"type": "string"},
    },
}
_TOOL_CALL_OUT = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
        }
    },
}
_CHAT_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {"type": "string"},
        "tool_calls": {"type": "array", "items": _ref("OllamaToolCall")},
    },
}
_END = {
    "done_reason": {
        "type": "string",
        "enum": ["stop", "length", "load", "unload"],
        "description": "`length`: `num_predict` or the context cut it; `load`/`unload`: nothing was generated.",
    },
    **{
        name: {**_COUNT, "description": "Nanoseconds, measured on the task's log."}
        for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")
    },
    "prompt_eval_count": _COUNT,
    "eval_count": _COUNT,
}


def _answers(field: str, schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a line before the end, the last line or the one answer) of a chat (``message``) or generate."""
    base = {"model": {"type": "string"}, "created_at": {"type": "string"}, field: schema}
    chunk = {
        "type": "object",
        "required": ["model", "created_at", field, "done"],
        "properties": {**base, "done": {"type": "boolean", "enum": [False]}},
    }
    final = {
        "type": "object",
        "required": ["model", "created_at", field, "done", "done_reason"],
        "properties": {**base, "done": {"type": "boolean", "enum": [True]}, **_END},
        "description": "The counts and durations are absent only from a load or unload answer.",
    }
    return chunk, final


CHAT_CHUNK, CHAT_FINAL = _answers("message", _ref("OllamaChatMessage"))
GENERATE_CHUNK, GENERATE_FINAL = _answers("response", {"type": "string"})
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
    "description": "Every error of the `/api/...` routes (`Content-Type: application/json`), and a failure as "
    "a stream's last line.",
}
SCHEMA_COMPONENTS: dict[str, dict[str, Any]] = {
    "OllamaModelDetails": _DETAILS,
    "OllamaToolCall": {
        **_TOOL_CALL_OUT,
        "description": "A call: `arguments` is an object (text cut by the token "
        'limit comes as `{"_unparsed": "..."}`).',
    },
    "OllamaChatMessage": _CHAT_MESSAGE,
    "OllamaChatChunk": CHAT_CHUNK,
    "OllamaChatDone": CHAT_FINAL,
    "OllamaGenerateChunk": GENERATE_CHUNK,
    "OllamaGenerateDone": GENERATE_FINAL,
    "OllamaError": _ERROR,
}
_LINES = (
    "`stream` true (the default): `application/x-ndjson`, one JSON object a line (the schema is that of one "
    "line): {chunks} with `done: false` as the text comes{calls}, then the `done: true` line with the counts "
    'and durations; or, for a generation that failed or was cancelled, one `{{"error": "..."}}` line. A '
    "client that leaves before the end cancels the generation."
)


def _stream(chunk: str, done: str, description: str) -> OpenApiResponse:
    return OpenApiResponse(
        {"oneOf": [_ref(chunk), _ref(done), _ref("OllamaError")]},
        description=description,
    )


CHAT_STREAM = _stream(
    "OllamaChatChunk",
    "OllamaChatDone",
    _LINES.format(chunks="`message` lines", calls=" (a call whole, in one line's `message.tool_calls`)"),
)
GENERATE_STREAM = _stream(
    "OllamaGenerateChunk", "OllamaGenerateDone", _LINES.format(chunks="`response` lines", calls="")
)
CHAT_ANSWER = OpenApiResponse(
    _ref("OllamaChatDone"),
    description="`stream: false`: the whole text (and calls) with the counts; or a load request's answer.",
)
GENERATE_ANSWER = OpenApiResponse(
    _ref("OllamaGenerateDone"),
    description="`stream: false`: the whole text with the counts; or a load request's answer.",
)
_PULL_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
PULL_STREAM = OpenApiResponse(
    {"oneOf": [_PULL_STATUS, _ref("OllamaError")]},
    description='`stream` true (the default): `{"status": ...}` lines from `pulling manifest` through the '
    'pull\'s own to `{"status": "success"}`, or one `{"error": ...}` line for a pull that failed.',
)
PULL_ANSWER = OpenApiResponse(
    {"type": "object", "required": ["status"], "properties": {"status": {"type": "string", "enum": ["success"]}}},
    description="`stream: false`: the pull ended and the model is registered.",
)
# What a pull that fails after it was accepted answers (stream: false): the failure's text, as Ollama's.
PULL_FAILED = "The pull failed (the repository or a file is missing, the Hub cannot be reached...)."


def error_content(status: int, classes: Sequence[type[exc.LmspError]]) -> dict[str, Any]:
    """The ``content`` of one error status: Ollama's ``{"error": "..."}``, an example per code."""
    examples = {}
    for cls in classes:
        detail = "model 'nope' not found" if cls.code == MODEL_NOT_FOUND else None
        _, body = ollama_error(cls(detail).to_http_problem())
        examples[cls.code] = {"summary": cls.title, "value": body}
    return {ERROR_MEDIA_TYPE: {"schema": _ref("OllamaError"), "examples": examples}}

"""The generation spec: every request translated once, at accept, into what the worker runs (issue 42).

The translation of each OpenAI shape, the stored form, what an accept
stores, and the migration that gives tasks stored before the spec theirs.
"""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from tasks_app.generation.spec import (
    ANY_JSON_OBJECT,
    ASSISTANT,
    CHOICE_NONE,
    CHOICE_REQUIRED,
    JSON_SCHEMA,
    SYSTEM,
    TOOL,
    USER,
    GenerationSpec,
    Turn,
)
from tasks_app.models import Response
from tasks_app.openai.chat_completions.translate import chat_request_to_response
from tasks_app.openai.responses.translate import generation_spec_of
from tests.support.specs import spec_of

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}


def test_a_responses_request_becomes_turns_sampling_limits_and_its_constraint():
    spec = generation_spec_of(
        {
            "model": "demo",
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": "Answer in French."},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}],
                },
                CALL,
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
            "temperature": 0.2,
            "top_k": 5,
            "seed": 7,
            "stop": "END",
            "max_output_tokens": 40,
            "truncation": "auto",
            "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
            "prompt_cache_key": "session-1",
            "previous_response_id": "resp_1",
        }
    )
    assert spec.system == "Be brief."
    assert spec.turns == (
        Turn(SYSTEM, "Answer in French."),
        Turn(USER, "Weather ?"),
        Turn(ASSISTANT, call_id="call_1", name="weather", arguments='{"city": "Paris"}'),
        Turn(TOOL, "sunny", call_id="call_1"),
    )
    assert (spec.sampling.temperature, spec.sampling.top_k, spec.sampling.seed, spec.sampling.top_p) == (
        0.2,
        5,
        7,
        None,
    )
    assert (spec.stops, spec.max_output_tokens, spec.truncate, spec.droppable_turns) == (("END",), 40, True, 3)
    assert (spec.constraint.kind, spec.constraint.name, spec.constraint.schema) == (JSON_SCHEMA, "w", WEATHER)
    assert (spec.cache_key, spec.continues) == ("session-1", "resp_1")
    assert not spec.calls_tools


def test_tools_and_the_choice_are_normalized_namespaces_and_narrowing_included():
    spec = spec_of(
        {
            "input": "Hi",
            "tools": [
                {"type": "function", "name": "weather", "description": "The weather", "parameters": WEATHER},
                {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
                {"type": "web_search"},
            ],
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "spawn"}],
            },
            "parallel_tool_calls": False,
        }
    )
    assert [(tool.name, tool.namespace) for tool in spec.tools] == [("weather", None), ("spawn", "agents")]
    assert spec.tools[0].description == "The weather" and spec.tools[0].parameters == WEATHER
    assert (spec.tool_choice.mode, spec.tool_choice.allowed, spec.tool_choice.max_calls) == (
        CHOICE_REQUIRED,
        ("spawn",),
        1,
    )
    assert [tool.name for tool in spec.callable_tools] == ["spawn"]
    assert spec.namespaces == {"spawn": "agents"} and spec.calls_tools

    named = spec_of(
        {
            "input": "Hi",
            "tools": [{"type": "function", "name": "weather"}],
            "tool_choice": {"type": "function", "name": "weather"},
        }
    )
    assert (named.tool_choice.mode, named.tool_choice.allowed, named.tool_choice.parallel) == (
        CHOICE_REQUIRED,
        ("weather",),
        False,
    )
    assert spec_of({"input": "Hi", "tools": [{"type": "web_search"}]}).tool_choice.mode == CHOICE_NONE
    assert not spec_of({"input": "Hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}).calls_tools


def test_a_chat_request_reaches_the_same_spec_through_one_translation():
    chat = chat_request_to_response(
        {
            "model": "demo",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "response_format": {"type": "json_object"},
        }
    )
    spec = generation_spec_of(chat.response_request)
    assert spec.turns == (Turn(SYSTEM, "Be brief."), Turn(USER, "Hi"))
    assert (spec.max_output_tokens, spec.stops, spec.constraint.kind) == (12, (), ANY_JSON_OBJECT)


def test_the_stored_form_reads_back_as_the_same_spec_and_refuses_an_unknown_version():
    spec = spec_of(
        {
            "instructions": "x",
            "input": [CALL, {"type": "function_call_output", "call_id": "call_1", "output": "ok"}],
            "tools": [{"type": "function", "name": "weather", "parameters": WEATHER}],
            "text": {"format": {"type": "json_object"}},
            "context": [{"type": "message", "role": "user", "content": "Before"}],
        }
    )
    stored = json.loads(json.dumps(spec.to_json()))
    assert GenerationSpec.from_json(stored) == spec
    assert spec.context_turns == 1 and spec.turns[0] == Turn(USER, "Before")
    with pytest.raises(ValueError, match="version"):
        GenerationSpec.from_json({**stored, "version": 99})


def test_a_conversation_keeps_its_key_whichever_way_its_first_turn_is_spelled():
    first = spec_of({"instructions": "Be brief.", "input": "Hi"})
    spelled = spec_of(
        {
            "instructions": "Be brief.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        }
    )
    assert first.conversation_key() == spelled.conversation_key() != ""
    assert not first.continues_conversation()
    assert spec_of({"input": "And?", "context": [{"role": "user", "content": "Hi"}]}).continues_conversation()


def test_an_accepted_request_is_stored_as_sent_beside_its_spec(api):
    first = api.post("/lmsp/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": 5, "background": True})
    assert first.status_code == 200, first.content
    row = Response.objects.get(pk=first.json()["id"])
    assert row.request["max_output_tokens"] == 5 and "context" not in row.request
    spec = GenerationSpec.from_json(row.generation)
    assert (spec.model, spec.turns, spec.max_output_tokens) == ("demo", (Turn(USER, "Hi"),), 5)


MIGRATION_BEFORE = [("tasks_app", "0010_task_attempt_after")]
MIGRATION_AFTER = [("tasks_app", "0011_response_generation")]


@pytest.mark.django_db(transaction=True)
def test_the_migration_gives_every_response_stored_before_it_the_spec_of_its_request():
    executor = MigrationExecutor(connection)
    executor.migrate(MIGRATION_BEFORE)
    old = executor.loader.project_state(MIGRATION_BEFORE).apps
    OldResponse = old.get_model("tasks_app", "Response")
    OldClient = old.get_model("tasks_app", "Client")
    request = {
        "model": "demo",
        "input": "And now?",
        "instructions": "Be brief.",
        "max_output_tokens": 9,
        # How a continued conversation was stored before: copied items under a private key.
        "context": [
            {"type": "message", "role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": "Hello!"},
        ],
    }
    now = timezone.now()
    client = OldClient.objects.create(name="alice", token_hash="0" * 64, scopes=["read", "write"])
    OldResponse.objects.create(
        id="resp_old", client=client, model="demo", request=request, created_at=now, updated_at=now
    )
    executor = MigrationExecutor(connection)
    executor.migrate(MIGRATION_AFTER)
    # Read through the migration's own state: later migrations add columns this database has not yet.
    stored = executor.loader.project_state(MIGRATION_AFTER).apps.get_model("tasks_app", "Response")

    spec = GenerationSpec.from_json(stored.objects.get(pk="resp_old").generation)
    assert spec.turns == (Turn(USER, "Hi"), Turn(ASSISTANT, "Hello!"), Turn(USER, "And now?"))
    assert (spec.context_turns, spec.system, spec.max_output_tokens) == (2, "Be brief.", 9)
    assert spec == spec_of(request)
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

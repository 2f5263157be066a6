"""The agent frameworks users point at the service, driven through their public APIs (PROFILE.md section 10).

openai-agents (Responses and Chat Completions, run and streamed, multi-turn
by echoing its items and by ``previous_response_id``), langchain-openai's
``ChatOpenAI`` (both APIs, invoke and stream) and pydantic-ai (both models),
each against the session's real uvicorn and Celery worker. The demo model
writes word salad, so the checks are on what the service stored: the text a
framework hands its user is the stored response's text, its token counts the
stored usage.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import agents
import jsonschema
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.openai import OpenAIResponsesModel as PydanticResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tasks_app.models import Response
from tests.support.demo import DEMO_MODEL, ENDLESS_MODEL
from tests.support.server import REPO

# A client's protocol over the engine, whose writes the lifecycle's, recovery's and the adapters' own tests
# test on both databases: the SQLite pass only (pyproject.toml, the sqlite_pass marker).
pytestmark = pytest.mark.sqlite_pass

# openai-agents raises on a response that hit its token limit (`incomplete`, as
# OpenAI sends it), so its Responses runs use `demo`, which always ends by
# itself well within this many tokens (by the end of its EOS ramp,
# fixture_models.demo).
TO_THE_END = 2000
# Where a cut-off answer is fine: a few tokens of the endless model.
FEW = 8
INSTRUCTIONS = "Be brief."


@pytest.fixture(scope="module", autouse=True)
def _no_tracing() -> Iterator[None]:
    """openai-agents would export its traces to OpenAI's servers: nothing here may leave the machine."""
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


@pytest.fixture
def base_url(web_server) -> str:
    return f"{web_server.base}/lmsp/v1"


def stored_text(response_id: str) -> str:
    output = Response.objects.get(pk=response_id).output
    return "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])


def responses_of(api) -> list[Response]:
    """The client's responses, oldest first: what the framework's requests became."""
    return list(Response.objects.filter(client=api.client).order_by("created_at", "id"))


def response_id_of_chat(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def drive(coroutine_function, *args: Any) -> Any:
    """Run an async framework call to its end in a loop of its own (its client lives and dies in it)."""
    return asyncio.run(coroutine_function(*args))


# --------------------------------------------------------------------------- #
# openai-agents
# --------------------------------------------------------------------------- #


async def agents_run_then_stream(base_url: str, token: str, kind: str) -> tuple[Any, Any, str]:
    """``Runner.run`` then ``Runner.run_streamed`` with the model class of ``kind``; the streamed text as seen."""
    async with AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        if kind == "responses":
            model: Any = OpenAIResponsesModel(model=DEMO_MODEL, openai_client=client)
            settings = ModelSettings(max_tokens=TO_THE_END)
        else:
            # Streamed usage is sent only when asked for (openai-agents asks by itself only on OpenAI's own URL).
            model = OpenAIChatCompletionsModel(model=ENDLESS_MODEL, openai_client=client)
            settings = ModelSettings(max_tokens=FEW, include_usage=True)
        agent = Agent(name="assistant", instructions=INSTRUCTIONS, model=model, model_settings=settings)
        ran = await Runner.run(agent, "Hello")
        streamed = Runner.run_streamed(agent, "Tell me more")
        deltas = [
            event.data.delta
            async for event in streamed.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
    return ran, streamed, "".join(deltas)


def test_openai_agents_runs_and_streams_on_responses(api, base_url, running_worker):
    ran, streamed, streamed_text = drive(agents_run_then_stream, base_url, api.token, "responses")

    first, second = responses_of(api)
    assert [raw.response_id for raw in ran.raw_responses] == [first.id]
    assert [raw.response_id for raw in streamed.raw_responses] == [second.id]
    assert (first.status, second.status) == ("completed", "completed")
    assert ran.final_output == stored_text(first.id)
    assert streamed.final_output == streamed_text == stored_text(second.id)
    assert ran.raw_responses[0].usage.input_tokens == first.usage["input_tokens"]
    assert ran.raw_responses[0].usage.output_tokens == first.usage["output_tokens"]
    assert streamed.raw_responses[0].usage.output_tokens == second.usage["output_tokens"]
    # The agent's instructions reached the service as the request's own instructions.
    assert first.request["instructions"] == INSTRUCTIONS


def test_openai_agents_runs_and_streams_on_chat_completions(api, base_url, running_worker):
    ran, streamed, streamed_text = drive(agents_run_then_stream, base_url, api.token, "chat_completions")

    first, second = responses_of(api)
    assert ran.final_output == stored_text(first.id)
    assert streamed.final_output == streamed_text == stored_text(second.id)
    assert (first.status, second.status) == ("incomplete", "incomplete")
    for result, stored in ((ran, first), (streamed, second)):
        usage = result.raw_responses[0].usage
        assert (usage.input_tokens, usage.output_tokens) == (stored.usage["input_tokens"], FEW)
    # A chat completion is not kept for continuing: the framework resends the history itself.
    assert first.request["store"] is False


async def agents_conversation(base_url: str, token: str) -> tuple[Any, Any, Any]:
    """One turn, then the next twice: by echoing the run's items back, and by ``previous_response_id``."""
    async with AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        agent = Agent(
            name="assistant",
            instructions=INSTRUCTIONS,
            model=OpenAIResponsesModel(model=DEMO_MODEL, openai_client=client),
            model_settings=ModelSettings(max_tokens=TO_THE_END),
        )
        first = await Runner.run(agent, "Hello")
        echoed = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": "And then?"}])
        chained = await Runner.run(agent, "And then?", previous_response_id=first.last_response_id)
    return first, echoed, chained


def test_openai_agents_continues_a_conversation_by_echoing_its_items_or_by_previous_response_id(
    api, base_url, running_worker
):
    first, echoed, chained = drive(agents_conversation, base_url, api.token)

    one, two, three = responses_of(api)
    assert [one.id, two.id, three.id] == [first.last_response_id, echoed.last_response_id, chained.last_response_id]
    assert {one.status, two.status, three.status} == {"completed"}
    # Our own output item went back as the SDK returned it (id, status, annotations) and was taken as history.
    sent_back = first.to_input_list()[1]
    assert (sent_back["id"], sent_back["status"]) == (one.output[0]["id"], "completed")
    assert sent_back["content"][0]["annotations"] == []
    assert [item["role"] for item in two.request["input"]] == ["user", "assistant", "user"]
    assert two.request["input"][1]["content"][0]["text"] == stored_text(one.id)
    assert echoed.final_output == stored_text(two.id)
    assert chained.final_output == stored_text(three.id)
    first_usage = first.raw_responses[0].usage
    echoed_usage = echoed.raw_responses[0].usage
    chained_usage = chained.raw_responses[0].usage
    assert echoed_usage.input_tokens > first_usage.input_tokens + first_usage.output_tokens // 2
    # The same conversation (the same instructions, sent anew each turn) renders to the same prompt either way.
    assert chained_usage.input_tokens == echoed_usage.input_tokens
    assert three.request["previous_response_id"] == one.id


# --------------------------------------------------------------------------- #
# langchain-openai
# --------------------------------------------------------------------------- #


def test_langchain_chat_openai_invokes_and_streams_on_chat_completions(api, base_url, running_worker):
    llm = ChatOpenAI(base_url=base_url, api_key=api.token, model=ENDLESS_MODEL, max_tokens=FEW, max_retries=0)

    answer = llm.invoke([("system", INSTRUCTIONS), ("user", "Hello")])
    chunks = list(llm.stream("Tell me more"))
    whole = sum(chunks[1:], chunks[0])

    invoked, streamed = responses_of(api)
    assert response_id_of_chat(answer.response_metadata["id"]) == invoked.id
    assert answer.content == stored_text(invoked.id)
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata["input_tokens"] == invoked.usage["input_tokens"]
    assert answer.usage_metadata["output_tokens"] == FEW
    assert whole.content == stored_text(streamed.id)
    assert whole.response_metadata["finish_reason"] == "length"


def test_langchain_chat_openai_invokes_and_streams_on_responses(api, base_url, running_worker):
    llm = ChatOpenAI(
        base_url=base_url,
        api_key=api.token,
        model=ENDLESS_MODEL,
        max_tokens=FEW,
        max_retries=0,
        use_responses_api=True,
    )

    answer = llm.invoke([("system", INSTRUCTIONS), ("user", "Hello")])
    chunks = list(llm.stream("Tell me more"))
    whole = sum(chunks[1:], chunks[0])

    invoked, streamed = responses_of(api)
    assert answer.response_metadata["id"] == invoked.id
    assert answer.text == stored_text(invoked.id)
    assert answer.response_metadata["status"] == "incomplete"
    assert answer.usage_metadata["input_tokens"] == invoked.usage["input_tokens"]
    assert answer.usage_metadata["output_tokens"] == FEW
    assert invoked.request["max_output_tokens"] == FEW
    assert whole.text == stored_text(streamed.id)
    assert whole.response_metadata["id"] == streamed.id
    assert whole.usage_metadata["output_tokens"] == FEW


# --------------------------------------------------------------------------- #
# pydantic-ai
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("model_class", [OpenAIChatModel, PydanticResponsesModel], ids=["chat", "responses"])
def test_pydantic_ai_agent_runs_on_the_openai_models(api, base_url, running_worker, model_class):
    model = model_class(ENDLESS_MODEL, provider=OpenAIProvider(base_url=base_url, api_key=api.token))
    agent = PydanticAgent(model, instructions=INSTRUCTIONS, model_settings={"max_tokens": FEW})

    result = agent.run_sync("Hello")

    (stored,) = responses_of(api)
    assert result.output == stored_text(stored.id)
    assert result.usage.input_tokens == stored.usage["input_tokens"]
    assert result.usage.output_tokens == FEW


# --------------------------------------------------------------------------- #
# Structured output (PROFILE.md 10.5), as each framework asks for it
# --------------------------------------------------------------------------- #


class Weather(BaseModel):
    """Bounded fields: the demo model writes word salad, and would fill an unbounded string to the limit."""

    city: str = Field(max_length=24)
    temperature_c: int = Field(ge=-60, le=60)
    conditions: Literal["sunny", "cloudy", "rain"]


def stored_weather(response: Response) -> Weather:
    return Weather.model_validate_json(stored_text(response.id))


async def agents_forecast(base_url: str, token: str, kind: str, **options: Any) -> Any:
    """One ``Runner.run`` of a forecasting agent (``options``: the Agent's own) on the model class of ``kind``."""
    async with AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        model: Any = (
            OpenAIResponsesModel(model=DEMO_MODEL, openai_client=client)
            if kind == "responses"
            else OpenAIChatCompletionsModel(model=DEMO_MODEL, openai_client=client)
        )
        agent = Agent(name="forecaster", instructions=INSTRUCTIONS, model=model, **options)
        return await Runner.run(agent, "What is the weather in Paris?")


@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_openai_agents_output_type_comes_back_as_the_pydantic_model(api, base_url, running_worker, kind):
    result = drive(
        functools.partial(agents_forecast, output_type=Weather, model_settings=ModelSettings(max_tokens=TO_THE_END)),
        base_url,
        api.token,
        kind,
    )

    (stored,) = responses_of(api)
    assert isinstance(result.final_output, Weather)
    assert result.final_output == stored_weather(stored)
    # openai-agents asks with a strict json_schema named final_output (its own wrapper's name).
    text_format = stored.request["text"]["format"]
    assert (text_format["type"], text_format["name"], text_format["strict"]) == ("json_schema", "final_output", True)


def langchain_demo(base_url: str, token: str, use_responses_api: bool) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=base_url,
        api_key=token,
        model=DEMO_MODEL,
        max_tokens=TO_THE_END,
        max_retries=0,
        use_responses_api=use_responses_api,
    )


@pytest.mark.parametrize("use_responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_with_structured_output_returns_the_pydantic_model(api, base_url, running_worker, use_responses_api):
    llm = langchain_demo(base_url, api.token, use_responses_api)

    answer = llm.with_structured_output(Weather).invoke("What is the weather in Paris?")

    (stored,) = responses_of(api)
    assert isinstance(answer, Weather)
    assert answer == stored_weather(stored)
    assert stored.request["text"]["format"]["type"] == "json_schema"


@pytest.mark.parametrize("model_class", [OpenAIChatModel, PydanticResponsesModel], ids=["chat", "responses"])
def test_pydantic_ai_native_output_returns_the_pydantic_model(api, base_url, running_worker, model_class):
    model = model_class(DEMO_MODEL, provider=OpenAIProvider(base_url=base_url, api_key=api.token))
    agent = PydanticAgent(model, output_type=NativeOutput(Weather), model_settings={"max_tokens": TO_THE_END})

    result = agent.run_sync("What is the weather in Paris?")

    (stored,) = responses_of(api)
    assert isinstance(result.output, Weather)
    assert result.output == stored_weather(stored)
    assert stored.request["text"]["format"]["type"] == "json_schema"


# --------------------------------------------------------------------------- #
# Function tools (PROFILE.md 10.4), as each framework offers them
# --------------------------------------------------------------------------- #

CALLS: list[dict[str, str]] = []


@function_tool
def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["C", "F"]) -> str:
    """The forecast for a city.

    Args:
        city: The city.
        unit: Celsius or Fahrenheit.
    """
    CALLS.append({"city": city, "unit": unit})
    return f"sunny in {city}, 21 {unit}"


@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_openai_agents_calls_a_function_tool_and_stops_on_its_result(api, base_url, running_worker, kind):
    CALLS.clear()
    tool_run = functools.partial(
        agents_forecast,
        tools=[get_weather],
        # The SDK runs the tool the model called, and its result is the run's output.
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=TO_THE_END),
    )
    result = drive(tool_run, base_url, api.token, kind)

    (stored,) = responses_of(api)
    (call,) = stored.output
    assert (call["type"], call["name"]) == ("function_call", "get_weather")
    # The SDK ran the tool with the arguments the model wrote, and its result is the output.
    assert CALLS == [json.loads(call["arguments"])]
    assert result.final_output == f"sunny in {CALLS[0]['city']}, 21 {CALLS[0]['unit']}"
    assert stored.request["tool_choice"] == "required"
    assert stored.request["tools"][0]["strict"] is True


@pytest.mark.parametrize("use_responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_returns_the_tool_call(api, base_url, running_worker, use_responses_api):
    llm = langchain_demo(base_url, api.token, use_responses_api)

    def get_time(zone: Literal["Europe/Paris", "Asia/Tokyo"]) -> str:
        """The time in a zone."""
        return "noon"

    # strict: the schema gets additionalProperties false (left open, the demo model's word salad would
    # add properties until the token limit).
    answer = llm.bind_tools([get_time], tool_choice="get_time", strict=True).invoke("What time is it in Tokyo?")

    (stored,) = responses_of(api)
    (call,) = answer.tool_calls
    assert call["name"] == "get_time" and call["args"]["zone"] in ("Europe/Paris", "Asia/Tokyo")
    stored_call = next(item for item in stored.output if item["type"] == "function_call")
    assert call["id"] == stored_call["call_id"] and call["args"] == json.loads(stored_call["arguments"])


def test_chat_completions_with_tools_and_a_response_format_answer_one_or_the_other(api, base_url, running_worker):
    async def ask() -> Any:
        async with AsyncOpenAI(base_url=base_url, api_key=api.token, max_retries=0) as client:
            return await client.chat.completions.create(
                model=DEMO_MODEL,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[{"type": "function", "function": {"name": "get_weather", **_parameters(get_weather)}}],
                # One call at most: the demo model left to choose could call until the token limit.
                parallel_tool_calls=False,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "weather", "schema": to_strict_json_schema(Weather), "strict": True},
                },
                max_tokens=TO_THE_END,
            )

    completion = drive(ask)
    message = completion.choices[0].message
    if message.tool_calls:
        assert completion.choices[0].finish_reason == "tool_calls"
        arguments = json.loads(message.tool_calls[0].function.arguments)
        jsonschema.validate(arguments, get_weather.params_json_schema)
    else:
        assert completion.choices[0].finish_reason == "stop"
        Weather.model_validate_json(message.content)


def _parameters(tool: Any) -> dict[str, Any]:
    return {"parameters": tool.params_json_schema}


# --------------------------------------------------------------------------- #
# The README's first requests, as a newcomer copies them
# --------------------------------------------------------------------------- #

README_URL = "http://127.0.0.1:8000/lmsp/v1"


def readme_first_requests() -> list[tuple[str, str]]:
    """The README's "First requests" code blocks, in order, as (language, code)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("### First requests", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return re.findall(r"```(sh|python)\n(.*?)```", section, flags=re.DOTALL)


def test_the_readmes_first_requests_work_as_written(api, base_url, running_worker, tmp_path: Path, monkeypatch):
    blocks = readme_first_requests()
    assert [language for language, _ in blocks] == ["sh", "python", "python", "python", "python"]
    # The newcomer's checkout: the token where the quick start keeps it, this server where the README says 8000.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "local-token").write_text(api.token + "\n")
    monkeypatch.chdir(tmp_path)
    # What the README's first shell block exports, as the shell that runs the Python examples has it.
    monkeypatch.setenv("LMSP_BASE_URL", base_url)
    monkeypatch.setenv("LMSP_TOKEN", api.token)

    curl = subprocess.run(
        ["bash", "-c", blocks[0][1].replace(README_URL, base_url)], capture_output=True, text=True, timeout=60
    )
    namespace: dict[str, Any] = {}
    for _, code in blocks[1:]:
        exec(compile(code.replace(README_URL, base_url), "README.md", "exec"), namespace)

    assert curl.returncode == 0, curl.stderr
    by_curl = json.loads(curl.stdout)
    stored = responses_of(api)
    # curl, Chat Completions, the background response, then one request from each framework.
    assert [response.id for response in stored[:3]] == [
        by_curl["id"],
        response_id_of_chat(namespace["chat"].id),
        namespace["job"].id,
    ]
    assert len(stored) == 6
    # The first requests set no limit: each ends by itself, as a newcomer's first answer should.
    assert [response.status for response in stored] == ["completed"] * 6
    assert by_curl["status"] == "completed"
    assert by_curl["output"][0]["content"][0]["text"] == stored_text(by_curl["id"])
    assert namespace["job"].output_text == stored_text(namespace["job"].id)

"""Never a leaked or broken end (issue 41): an answer cut by its token limit ends on whole text.

A tool call's start that the limit cuts before its name is complete is
dropped, never message text; one whose name is known is an ``incomplete``
``function_call`` item (Chat: a ``tool_calls`` entry with ``finish_reason:
"length"``). A cut inside a multi-byte character drops the character's
bytes, never a U+FFFD. The stream and the stored object say the same.

The cuts are forced, not found by a lucky seed: a ``required`` call on the
demo model is written under its grammar from the first token, so a small
``max_output_tokens`` cuts its tag, its name or its arguments whatever the
weights; and a model scripted to write a given output
(``tests/support/scripted.py``) is cut at each place that matters: inside
the second of two parallel calls, inside each byte of a 3- and a 4-byte
character. All through the real uvicorn, Celery worker and ONNX Runtime,
with the ``openai`` package as the client.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from fixture_models.demo import _bytes_to_unicode
from tasks_app.registry.scan import model_scan
from tests.support.scripted import scripted_model
from tests.support.templates import family_template
from workers.backends.detokenizer import StreamDetokenizer

PROMPT = "What is the weather in Paris for three days?"
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS},
    {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in TOOLS]
# Text, then two calls in Qwen2.5's (Hermes') format, as a model answering with parallel calls writes them.
TIME_CALL = '{"name": "get_time", "arguments": {"zone":"Europe/Oslo"}}'
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city":"Paris","days":3}}'
PARALLEL = f"Checking.\n<tool_call>\n{TIME_CALL}\n</tool_call>\n<tool_call>\n{WEATHER_CALL}\n</tool_call>"
# A 3-byte and a 4-byte character, each a token per byte in the demo tokenizer.
WIDE = "Cost: 5\u20ac, clef \U0001d11e here."
WIDE_PROMPT = "Say the price."


@pytest.fixture
def sdk(api, web_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web_server.base}/lmsp/v1", api_key=api.token, max_retries=0, timeout=60)


def _scripted(sdk: openai.OpenAI, root: Path, name: str, script: str, probe: dict[str, Any], template: str | None):
    """The demo model (with ``template`` as its chat template), scripted to write ``script`` after ``probe``'s
    prompt; returns the script's token ids."""
    demo = root / "demo"
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    ids = tokenizer.encode(script, add_special_tokens=False).ids
    folder = root / name
    if not folder.exists():
        source = root / f"{name}-source"
        if not source.exists():
            staging = root / f".{name}-source"
            shutil.copytree(demo, staging, ignore=shutil.ignore_patterns("endless"))
            if template is not None:
                (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
            staging.rename(source)
            model_scan(models_dir=root)
        prompt_tokens = sdk.responses.create(model=f"{name}-source", max_output_tokens=1, **probe).usage.input_tokens
        eos = json.loads((demo / "generation_config.json").read_text())["eos_token_id"]
        staging = root / f".{name}"
        scripted_model(
            source, staging, prompt_tokens=prompt_tokens, script=ids, eos=eos[0] if isinstance(eos, list) else eos
        )
        staging.rename(folder)
    model_scan(models_dir=root)
    return ids, tokenizer


@pytest.fixture
def parallel(sdk, running_worker, worker_models_root: Path) -> tuple[str, list[str]]:
    """A Qwen2.5-template model scripted to write ``PARALLEL``, and the text after each of its tokens."""
    probe = {"input": PROMPT, "tools": TOOLS, "parallel_tool_calls": True}
    ids, tokenizer = _scripted(sdk, worker_models_root, "cut-parallel", PARALLEL, probe, family_template("qwen2.5"))
    return "cut-parallel", [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]


@pytest.fixture
def wide(sdk, running_worker, worker_models_root: Path) -> tuple[str, list[str]]:
    """The demo model scripted to write ``WIDE``, and the text after each of its tokens."""
    ids, tokenizer = _scripted(sdk, worker_models_root, "cut-wide", WIDE, {"input": WIDE_PROMPT}, None)
    return "cut-wide", [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]


def streamed(sdk: openai.OpenAI, **request: Any) -> tuple[Any, list[Any]]:
    """A streamed response's events and its final response, checked against the stored one."""
    events = list(sdk.responses.create(stream=True, **request))
    final = events[-1].response
    stored = sdk.responses.retrieve(final.id)
    assert stored.model_dump() == final.model_dump()
    # What the deltas said is what the items hold.
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert texts == stored.output_text
    for index, item in enumerate(stored.output):
        if item.type == "function_call":
            pieces = [
                e.delta
                for e in events
                if e.type == "response.function_call_arguments.delta" and e.output_index == index
            ]
            assert "".join(pieces) == item.arguments
    return stored, events


def first_cut(texts: list[str], inside: str, at: str) -> int:
    """The first token count whose text ends inside ``inside`` (itself found at or after ``at``), past ``at``."""
    start = PARALLEL.index(inside, PARALLEL.index(at))
    for n, text in enumerate(texts):
        if start < len(text) < start + len(inside):
            return n
    raise AssertionError(f"no token ends inside {inside!r}")


# --------------------------------------------------------------------------- #
# A call cut by the token limit
# --------------------------------------------------------------------------- #

NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 200, "maxLength": 200}},
    "required": ["note"],
    "additionalProperties": False,
}


def test_a_required_call_cut_anywhere_in_its_head_is_never_text(sdk, running_worker):
    """The demo model's own (generic) format: ``<tool_call>{"name": "write_note", "arguments": ...``."""
    seen = set()
    for limit in range(1, 41, 3):
        response, events = streamed(
            sdk,
            model="demo",
            input=PROMPT,
            tools=[{"type": "function", "name": "write_note", "parameters": NOTE}],
            tool_choice="required",
            parallel_tool_calls=True,
            max_output_tokens=limit,
            temperature=0,
        )
        assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
        assert not [e for e in events if e.type == "response.output_text.delta"], limit
        assert all(item.type == "function_call" for item in response.output), (limit, response.output)
        if response.output:
            (call,) = response.output
            assert (call.name, call.status) == ("write_note", "incomplete")
            assert '{"note":"'.startswith(call.arguments) or call.arguments.startswith('{"note":"')
        seen.add(len(response.output))
    assert seen == {0, 1}  # cut in the tag or the name: nothing; past the name: the incomplete call

    completion = sdk.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        tools=[{"type": "function", "function": {"name": "write_note", "parameters": NOTE}}],
        tool_choice="required",
        max_tokens=5,
        temperature=0,
    )
    (choice,) = completion.choices
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", "", None)


def test_the_second_of_two_parallel_calls_cut_in_its_name_is_dropped_not_text(sdk, parallel):
    model, texts = parallel
    request = {"model": model, "input": PROMPT, "tools": TOOLS, "parallel_tool_calls": True, "temperature": 0}
    # (where the limit cuts, the calls then shown and their statuses)
    cases = [
        (first_cut(texts, "<tool_call>", "Checking."), []),
        (first_cut(texts, "get_time", "Checking."), []),
        (first_cut(texts, "Europe/Oslo", "Checking."), [("get_time", "incomplete")]),
        (first_cut(texts, "</tool_call>", "Checking."), [("get_time", "completed")]),
        (first_cut(texts, "<tool_call>", "</tool_call>"), [("get_time", "completed")]),
        (first_cut(texts, "get_weather", "</tool_call>"), [("get_time", "completed")]),
        (first_cut(texts, '"Paris"', "</tool_call>"), [("get_time", "completed"), ("get_weather", "incomplete")]),
    ]
    for limit, calls in cases:
        response, _ = streamed(sdk, max_output_tokens=limit, **request)
        where = (limit, texts[limit])
        assert response.status == "incomplete", where
        assert response.output_text == "Checking.", where  # no marker, no name, no whitespace held before one
        shown = [(item.name, item.status) for item in response.output if item.type == "function_call"]
        assert shown == calls, where
        assert [item.type for item in response.output] == ["message"] + ["function_call"] * len(calls)
        for item in response.output[1:]:
            whole = TIME_CALL if item.name == "get_time" else WEATHER_CALL
            arguments = json.dumps(json.loads(whole)["arguments"], separators=(",", ":"))
            assert arguments.startswith(item.arguments) and (item.status == "incomplete") == (
                item.arguments != arguments
            )

    # Chat, streamed and not: the same cut inside the second call's name, then inside its arguments.
    messages = [{"role": "user", "content": PROMPT}]
    for limit, names in (
        (first_cut(texts, "get_weather", "</tool_call>"), ["get_time"]),
        (first_cut(texts, '"Paris"', "</tool_call>"), ["get_time", "get_weather"]),
    ):
        chat = {"model": model, "messages": messages, "tools": CHAT_TOOLS, "max_tokens": limit, "temperature": 0}
        (choice,) = sdk.chat.completions.create(**chat).choices
        assert (choice.finish_reason, choice.message.content) == ("length", "Checking.")
        assert [call.function.name for call in choice.message.tool_calls] == names
        chunks = list(sdk.chat.completions.create(stream=True, **chat))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
        fragments = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
        assert [f.function.name for f in fragments if f.function.name] == names
        arguments = ["".join(f.function.arguments or "" for f in fragments if f.index == i) for i in range(len(names))]
        assert arguments == [call.function.arguments for call in choice.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- #
# A text cut inside a character
# --------------------------------------------------------------------------- #


@pytest.mark.database_free
@pytest.mark.parametrize("char", ["\u20ac", "\U0001d11e"], ids=["3-bytes", "4-bytes"])
def test_the_detokenizer_drops_a_character_cut_at_any_byte(demo_models_root: Path, char: str):
    tokenizer = Tokenizer.from_file(str(demo_models_root / "demo" / "tokenizer.json"))
    table = _bytes_to_unicode()
    text = f"a{char}b{char}"
    ids = [tokenizer.token_to_id(table[byte]) for byte in text.encode()]  # a token per byte
    assert None not in ids
    for cut in range(len(ids) + 1):
        detokenizer = StreamDetokenizer(tokenizer)
        streamed = "".join(detokenizer.step(ids[: i + 1]) for i in range(cut))
        # A resumed run's detokenizer (its offsets from the snapshot) ends the same way.
        restored = StreamDetokenizer(tokenizer, **detokenizer.state())
        whole = text.encode()[:cut].decode(errors="ignore")
        assert streamed + detokenizer.flush(ids[:cut]) == whole, cut
        assert streamed + restored.flush(ids[:cut]) == whole, cut


def test_a_text_cut_inside_a_multibyte_character_drops_its_bytes(sdk, wide):
    model, texts = wide
    cuts = [n for n, text in enumerate(texts) if text.endswith("\ufffd")]
    assert len(cuts) == 5  # two bytes into the euro sign, one, two and three into the clef
    for limit in cuts:
        whole = texts[limit].rstrip("\ufffd")
        response, _ = streamed(sdk, model=model, input=WIDE_PROMPT, max_output_tokens=limit, temperature=0)
        assert (response.status, response.output_text) == ("incomplete", whole), limit
    # Chat, streamed and not, cut inside the clef.
    chat = {"model": model, "messages": [{"role": "user", "content": WIDE_PROMPT}], "max_tokens": cuts[-1]}
    (choice,) = sdk.chat.completions.create(temperature=0, **chat).choices
    assert (choice.finish_reason, choice.message.content) == ("length", texts[cuts[-1]].rstrip("\ufffd"))
    chunks = list(sdk.chat.completions.create(stream=True, temperature=0, **chat))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_the_demo_model_cut_by_max_tokens_never_ends_in_a_broken_character(sdk, running_worker):
    """The case the issue measured (chat, ``max_tokens`` 26, ``seed`` 1), and its neighbours."""
    for seed in range(6):
        chat = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 26, "seed": seed}
        (choice,) = sdk.chat.completions.create(**chat).choices
        assert "\ufffd" not in choice.message.content, (seed, choice.message.content)
        if seed == 1:
            chunks = list(sdk.chat.completions.create(stream=True, **chat))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content

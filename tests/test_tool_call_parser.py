"""Reading calls out of a model's text, per family (``tasks_app.generation.tool_call_parser``).

Texts in each family's real format (as its template tells the model to
write, and as its parser in llama.cpp and vLLM reads it): several calls,
text before a call, a marker split across pieces, arguments before the
name, malformed JSON. Every text is also fed cut into random pieces (as the
detokenizer releases it): the reading must not depend on the cuts, or a
resumed run would read its calls otherwise.
"""

from __future__ import annotations

import json
import random

import pytest

from tasks_app.generation.tool_call_parser import (
    CALL_ARGUMENTS,
    CALL_END,
    CALL_START,
    TEXT,
    MalformedToolCall,
    ToolCallParser,
)
from tasks_app.generation.tool_calls import FORMATS, tool_format_of_template


def read(family: str, text: str, *, seed: int | None = None, max_calls: int | None = None, cut: bool = False):
    """The ops a text gives (joined per kind), and whether a call was left open (``cut``: by the token limit)."""
    parser = ToolCallParser(FORMATS[family], max_calls=max_calls)
    rng = random.Random(seed)
    ops = []
    at = 0
    while at < len(text):
        size = rng.randint(1, 5) if seed is not None else len(text)
        ops += parser.feed(text[at : at + size])
        at += size
    ops += parser.finish(cut=cut)
    joined: list[tuple[str, str]] = []
    for kind, value in ops:
        if joined and joined[-1][0] == kind and kind in (TEXT, CALL_ARGUMENTS):
            joined[-1] = (kind, joined[-1][1] + value)
        else:
            joined.append((kind, value))
    return joined, parser.call_open


def calls(ops):
    """(name, parsed arguments) of each ended call, and the text."""
    names = [value for kind, value in ops if kind == CALL_START]
    ended = [json.loads(value) for kind, value in ops if kind == CALL_END]
    text = "".join(value for kind, value in ops if kind == TEXT)
    return list(zip(names, ended, strict=True)), text


WEATHER = {"city": "Paris", "days": 3}
TIME = {"zone": "Europe/Oslo"}

CASES = {
    "hermes": [
        (
            'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>',
            [("get_weather", WEATHER), ("get_time", TIME)],
            "Let me look.",
        ),
        ('<tool_call>{"arguments": {"zone": "Europe/Oslo"}, "name": "get_time"}</tool_call>', [("get_time", TIME)], ""),
        ("No call here: a < b, and <tool is not a marker.", [], "No call here: a < b, and <tool is not a marker."),
        # Not a call after all (no JSON object after the marker): the text is message text, as written.
        ("see <tool_call> in the docs", [], "see <tool_call> in the docs"),
    ],
    "generic": [
        (
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>',
            [("get_weather", WEATHER)],
            "Sure.",
        ),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', [("get_weather", WEATHER)], ""),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "Europe/Oslo"}}', [("get_time", TIME)], ""),
        ("The answer is {not a call}.", [], "The answer is {not a call}."),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}]',
            [("get_weather", WEATHER), ("get_time", TIME)],
            "",
        ),
    ],
    "mistral_args": [
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
            '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "Europe/Oslo"}',
            [("get_weather", WEATHER), ("get_time", TIME)],
            "",
        ),
        ('Sure.[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Oslo"}', [("get_time", TIME)], "Sure."),
        ("What [TOOL_CALLS] means is in the docs", [], "What [TOOL_CALLS] means is in the docs"),
    ],
    "phi4_mini": [
        (
            'Checking. <|tool_call|>[{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}]<|/tool_call|>',
            [("get_time", TIME)],
            "Checking.",
        ),
        # Arguments written as a JSON string holding JSON, as some models do: the string's JSON is the arguments.
        (
            '<|tool_call|>[{"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Oslo\\"}"}]<|/tool_call|>',
            [("get_time", TIME)],
            "",
        ),
    ],
    "functools": [
        (
            'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
            [("get_weather", WEATHER)],
            "",
        ),
    ],
}


@pytest.mark.parametrize(
    ("family", "text", "expected", "before"),
    [(family, *case) for family, cases in CASES.items() for case in cases],
    ids=[f"{family}-{i}" for family, cases in CASES.items() for i in range(len(cases))],
)
def test_each_familys_calls_are_read_whatever_the_cuts(family, text, expected, before):
    whole, left_open = read(family, text)
    assert not left_open
    assert calls(whole) == (expected, before)
    # No marker ever reaches the message text.
    fmt = FORMATS[family]
    if expected:
        assert fmt.start not in calls(whole)[1]
    for seed in range(30):
        assert read(family, text, seed=seed) == (whole, False)


def test_arguments_stream_as_the_model_writes_them():
    fmt = FORMATS["hermes"]
    parser = ToolCallParser(fmt)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    arguments = []
    for piece in pieces:
        for kind, value in parser.feed(piece):
            if kind == CALL_ARGUMENTS:
                arguments.append(value)
    parser.finish()
    assert len(arguments) > 5  # many pieces, not one at the end
    assert "".join(arguments) == json.dumps(WEATHER)


def test_text_that_may_begin_a_marker_is_held_back_and_never_taken_back():
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed("Hello <tool") == [(TEXT, "Hello")]
    # The held "<tool" (and the space before it) turns out to be text: released, not lost.
    assert parser.feed("box>") == [(TEXT, " <toolbox>")]
    assert parser.feed(" <tool_") == []
    assert parser.feed('call>{"name": "a", "arguments": {}}</tool_call>') == [
        (CALL_START, "a"),
        (CALL_ARGUMENTS, "{}"),
        (CALL_END, "{}"),
    ]


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = CASES["hermes"][0][0]
    ops, _ = read("hermes", text, max_calls=1)
    assert calls(ops) == ([("get_weather", WEATHER)], "Let me look.")


def test_a_call_that_breaks_once_opened_is_malformed():
    with pytest.raises(MalformedToolCall, match="malformed"):
        read("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "x"}} oops')
    with pytest.raises(MalformedToolCall, match="not JSON"):
        read("hermes", '<tool_call>{"name": "get_time", "arguments": "not json"}</tool_call>')


def test_a_call_cut_by_the_end_of_the_output_is_left_open():
    ops, left_open = read("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Eur')
    assert left_open
    assert ops == [(CALL_START, "get_time"), (CALL_ARGUMENTS, '{"zone": "Eur')]


def _arguments_per_call(ops) -> list[str]:
    out: list[str] = []
    for kind, value in ops:
        if kind == CALL_START:
            out.append("")
        elif kind == CALL_ARGUMENTS:
            out[-1] += value
    return out


CALL_CASES = [(family, *case) for family, cases in CASES.items() for case in cases if case[1]]


@pytest.mark.parametrize(
    ("family", "text", "expected", "before"),
    CALL_CASES,
    ids=[f"{family}-{i}" for i, (family, *_) in enumerate(CALL_CASES)],
)
def test_a_text_cut_by_the_limit_anywhere_shows_no_part_of_a_call_as_text(family, text, expected, before):
    """Every format, cut after every character (a marker split across pieces, a name half written): the text
    shown is the message's, never a marker's or a call's; the calls are the whole reading's, the last one
    perhaps open."""
    whole, _ = read(family, text)
    names = [value for kind, value in whole if kind == CALL_START]
    ends = [value for kind, value in whole if kind == CALL_END]
    arguments = _arguments_per_call(whole)
    for at in range(len(text)):
        ops, left_open = read(family, text[:at], seed=at, cut=True)
        shown = "".join(value for kind, value in ops if kind == TEXT)
        where = (at, text[:at], shown)
        assert before.startswith(shown.rstrip(" \n")), where
        started = [value for kind, value in ops if kind == CALL_START]
        ended = [value for kind, value in ops if kind == CALL_END]
        assert started == names[: len(started)] and ended == ends[: len(ended)], where
        assert left_open == (len(started) > len(ended)), where
        if left_open:
            assert arguments[len(started) - 1].startswith(_arguments_per_call(ops)[-1]), where


@pytest.mark.parametrize(
    ("family", "text", "cut", "ended"),
    [
        # A marker's start: dropped when the limit cut it, text when the model ended there.
        ("hermes", "Hello <tool", "Hello", "Hello <tool"),
        ("hermes", "Hello <tool_call>", "Hello", "Hello <tool_call>"),
        ("mistral_args", "Sure [TOOL_CA", "Sure", "Sure [TOOL_CA"),
        # Whitespace held before a marker that never came is text.
        ("hermes", "Hello \n", "Hello \n", "Hello \n"),
        # A call begun (the name not complete): never text.
        ("hermes", 'Hi <tool_call>\n{"name": "get_we', "Hi", "Hi"),
        ("generic", '<tool_call>{"na', "", ""),
        ("mistral", '[TOOL_CALLS][{"name": "get', "", ""),
        ("mistral_args", "[TOOL_CALLS]get_we", "", ""),
        ("mistral_args", "[TOOL_CALLS]get_time[CALL_", "", ""),
        ("llama3_json", '{"name": "get', "", ""),
        ("llama3_json", "<|python_tag|>", "", "<|python_tag|>"),
        ("phi4_mini", "<|tool_call|>[", "", ""),
        ("functools", "functools[{", "", ""),
        # A region that cannot be a call any more is text, cut or not.
        ("mistral_args", "What [TOOL_CALLS] means is", "What [TOOL_CALLS] means is", "What [TOOL_CALLS] means is"),
        # After a call: the end marker's start, or the next call's, is never text.
        ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_', "", ""),
        ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_c', "", ""),
    ],
)
def test_what_is_held_at_the_end_is_dropped_if_cut_and_text_only_if_it_is_no_call(family, text, cut, ended):
    for seed in (None, 1, 2, 3):
        for by_limit, expected in ((True, cut), (False, ended)):
            ops, left_open = read(family, text, seed=seed, cut=by_limit)
            assert not left_open
            assert "".join(value for kind, value in ops if kind == TEXT) == expected, (seed, by_limit)


def test_a_held_marker_start_that_turns_out_to_be_text_is_released_whole():
    parser = ToolCallParser(FORMATS["generic"])
    assert parser.feed("a <") == [(TEXT, "a")]
    assert parser.feed("too") == []
    assert parser.feed("lbox") == [(TEXT, " <toolbox")]
    assert parser.feed(" <tool_call") == []
    assert parser.feed("s>") == [(TEXT, " <tool_calls>")]
    assert parser.finish(cut=True) == []


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}", "mistral_args"),
        ("<tool_call>\\n{{ tool_call }}", "hermes"),
        ("{{- '<|python_tag|>' }}", "llama3_json"),
        ('{{- "Environment: ipython\\n" }}', "llama3_json"),
        ("{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}", "phi4_mini"),
        ("functools[", "functools"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ],
)
def test_the_family_is_read_off_the_template(template, family):
    assert tool_format_of_template(template).name == family


class _Model:
    chat_template_source = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_model_can_be_set_to_a_family_its_template_does_not_name(settings):
    from workers.generation_inputs import tool_format_of as _tool_format

    assert _tool_format(_Model(), "mine:q4").name == "generic"
    settings.LMSP_TOOL_FORMATS = {"mine": "llama3_json"}  # a name without a tag covers its tags
    assert _tool_format(_Model(), "mine:q4").name == "llama3_json"
    settings.LMSP_TOOL_FORMATS = {"mine:q4": "mistral", "mine": "llama3_json"}
    assert _tool_format(_Model(), "mine:q4").name == "mistral"

"""A tool-call marker that is one special token of the model, over a real ONNX Runtime session.

Phi-4-mini's ``<|tool_call|>``, Llama 3's ``<|python_tag|>`` and Mistral's
``[TOOL_CALLS]`` are special tokens: the grammar must name the token itself
(its text as a literal would let the mask allow the token and then refuse
it), and the detokenizer must keep its text for the parser while it still
leaves every other special token out. The phi3-tiny fixture's unused
``<unk>`` (id 384) becomes ``<|tool_call|>`` in a copy of its tokenizer.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import jsonschema
import pytest

from tasks_app.generation.tool_call_parser import CALL_END, CALL_START, ToolCallParser
from tasks_app.generation.tool_calls import FORMATS, template_tools, tools_grammar
from tests.support.specs import prompt_for, spec_of
from tests.test_backend_layouts import MODELS, REFERENCES
from workers.backends.base import FINISH_EOS, SamplingParams, ToolPrompt
from workers.backends.constraints import OutputConstraint
from workers.backends.onnx import OnnxRuntimeBackend
from workers.backends.onnx.model import OnnxModel

pytestmark = pytest.mark.database_free

MARKER_ID = 384
PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["Europe/Oslo", "Asia/Tokyo"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
REQUEST = {
    "input": "What time is it in Oslo?",
    "tools": [{"type": "function", "name": "get_time", "parameters": PARAMETERS}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
}
FMT = FORMATS["phi4_mini"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxModel]:
    reference = REFERENCES["phi3-tiny"]
    folder = tmp_path_factory.mktemp("marker") / "phi3-marker"
    shutil.copytree(MODELS / reference["folder"], folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    (added,) = [token for token in tokenizer["added_tokens"] if token["id"] == MARKER_ID]
    assert added["content"] == "<unk>" and added["special"]
    added["content"] = FMT.start
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    loaded = OnnxRuntimeBackend(prefill_chunk=8).load(folder, graph=reference["graph"], device="cpu")
    yield loaded
    loaded.close()


def test_the_marker_token_is_forced_kept_in_the_text_and_read_as_the_call(model: OnnxModel) -> None:
    markers = model.single_token_ids([FMT.start, FMT.end])
    assert markers == {FMT.start: MARKER_ID}  # the end marker is text in this tokenizer
    grammar = tools_grammar(spec_of(REQUEST), FMT, token_ids=markers)
    assert f"<[{MARKER_ID}]>" in grammar
    prompt = model.prompt_ids(
        prompt_for(REQUEST), tools=ToolPrompt(tuple(template_tools(spec_of(REQUEST))), in_system=True)
    )
    params = SamplingParams(max_output_tokens=200, grammar=grammar, kept_tokens=tuple(markers), temperature=0)

    generation = model.generate(prompt, params, should_stop=lambda: False)
    list(generation)

    assert generation.finish_reason == FINISH_EOS
    assert generation.generated_ids[0] == MARKER_ID  # the special token itself, not its text spelled out
    text = generation.text()
    assert text.startswith(FMT.start + "[")
    # Every other special token (the end of sequence here) is still left out of the text.
    assert text.endswith(FMT.end)
    parser = ToolCallParser(FMT, max_calls=1)
    ops = parser.feed(text) + parser.finish()
    assert [kind for kind, _ in ops if kind in (CALL_START, CALL_END)] == [CALL_START, CALL_END]
    assert dict(ops)[CALL_START] == "get_time"
    jsonschema.validate(json.loads(dict(ops)[CALL_END]), PARAMETERS)


def test_without_keeping_it_the_marker_is_left_out_like_any_special_token(model: OnnxModel) -> None:
    markers = model.single_token_ids([FMT.start])
    params = SamplingParams(
        max_output_tokens=200, grammar=tools_grammar(spec_of(REQUEST), FMT, token_ids=markers), temperature=0
    )
    generation = model.generate(model.prompt_ids(prompt_for(REQUEST)), params, should_stop=lambda: False)
    list(generation)
    assert generation.generated_ids[0] == MARKER_ID
    assert generation.text().startswith("[")


@pytest.mark.parametrize(
    ("choice", "second_call"),
    [("required", True), ({"type": "function", "name": "get_time"}, False)],
    ids=["required-allows-several", "named-is-one-call"],
)
def test_a_named_function_is_one_call_whatever_parallel_tool_calls_says(model: OnnxModel, choice, second_call):
    fmt = FORMATS["generic"]
    request = {**REQUEST, "tool_choice": choice, "parallel_tool_calls": True}
    constraint = OutputConstraint(model.constraint_tokenizer(), tools_grammar(spec_of(request), fmt, token_ids={}))
    call = '<tool_call>{"name": "get_time", "arguments": {"zone":"Asia/Tokyo"}}</tool_call>'
    assert constraint.matcher.consume_tokens(model.tokenizer.encode(call, add_special_tokens=False).ids)
    # After one call, another can start only where more than one is allowed.
    again = model.tokenizer.encode("\n" + call, add_special_tokens=False).ids
    assert constraint.matcher.try_consume_tokens(again) == (len(again) if second_call else 0)

"""A task's generation spec as a runtime takes it: the prompt, the sampler's values and the grammar.

The spec (``tasks_app.generation.spec``) is the request as the service
understands it, whatever protocol it came in; this module maps it onto the
runtime interface (``workers.backends.base``), which knows no task and no
protocol. Built again on every run and every resume of a task: the grammar is
not stored, the spec it comes from is.
"""

from __future__ import annotations

from dataclasses import replace

from django.conf import settings

from tasks_app.generation import structured_output, tool_calls
from tasks_app.generation.spec import GenerationSpec
from workers.backends.base import LoadedModel, Prompt, PromptTurn, SamplingParams, TemplateSource, ToolPrompt


def prompt_of(spec: GenerationSpec) -> Prompt:
    """The spec's system text and turns; a prompt over the context may drop all turns but the newest."""
    turns = tuple(
        PromptTurn(turn.role, turn.text, call_id=turn.call_id, name=turn.name, arguments=turn.arguments)
        for turn in spec.turns
    )
    return Prompt(turns, system=spec.system, droppable=spec.droppable_turns)


def sampling_params_of(spec: GenerationSpec, model: LoadedModel, model_name: str) -> SamplingParams:
    """What the sampler is asked for, with the grammar of the spec's tool choice or output constraint."""
    params = sampler_values_of(spec)
    if not spec.tools:
        return replace(params, grammar=structured_output.constraint_grammar(spec.constraint))
    fmt = tool_format_of(model, model_name)
    markers = model.single_token_ids(tool_calls.markers_of(fmt))
    grammar = tool_calls.tools_grammar(spec, fmt, token_ids=markers)
    return replace(params, grammar=grammar, kept_tokens=tuple(markers))


def sampler_values_of(spec: GenerationSpec) -> SamplingParams:
    """The spec's sampling values, stops and limit (None: the model's default), without a grammar."""
    sampling = spec.sampling
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        seed=sampling.seed,
        max_output_tokens=spec.max_output_tokens,
        stop=spec.stops,
    )


def tool_format_of(model: TemplateSource, model_name: str) -> tool_calls.ToolFormat:
    """The model's tool-call family: set for it (``LMSP_TOOL_FORMATS``), else read off its template."""
    chosen = settings.LMSP_TOOL_FORMATS.get(model_name) or settings.LMSP_TOOL_FORMATS.get(model_name.split(":")[0])
    if chosen:
        return tool_calls.tool_format_named(chosen)
    return tool_calls.tool_format_of_template(model.chat_template_source)


def tool_prompt_of(spec: GenerationSpec, model: TemplateSource, model_name: str) -> ToolPrompt | None:
    """How the spec's tools reach the prompt: through the template, or as a system instruction."""
    shown = tool_calls.template_tools(spec)
    if not shown:
        return None
    fmt = tool_format_of(model, model_name)
    if not fmt.template_tools:
        return ToolPrompt(tuple(shown), instruction=tool_calls.generic_instruction(shown))
    return ToolPrompt(tuple(shown), in_system=fmt.tools_in_system)

"""Requests as the service stores and runs them: their generation spec, and the prompt a runtime gets.

Through the real translation (``tasks_app.openai.responses.translate``), so a
test that builds a prompt from a request reads it as a task would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks_app.generation.spec import GenerationSpec
from tasks_app.openai.responses.translate import generation_spec_of, turns_of_items
from workers.backends.base import Prompt, SamplingParams
from workers.generation_inputs import prompt_of, sampler_values_of


def spec_of(request: Mapping[str, Any]) -> GenerationSpec:
    """``request`` (model ``demo`` unless it names one) as accepted; a ``context`` of items stands for the
    conversation a ``previous_response_id`` copied in."""
    full = {"model": "demo", **request}
    return generation_spec_of(full).continued(turns_of_items(full.get("context") or ()))


def spec_json(request: Mapping[str, Any]) -> dict[str, Any]:
    return spec_of(request).to_json()


def prompt_for(request: Mapping[str, Any]) -> Prompt:
    """The prompt a worker renders for ``request``."""
    return prompt_of(spec_of(request))


def sampler_values(request: Mapping[str, Any]) -> SamplingParams:
    """The sampler's values ``request`` sets (no grammar)."""
    return sampler_values_of(spec_of(request))

"""What one generation samples with (:class:`SamplingSettings`), and how a request's knobs resolve.

A request's value wins; else the model's ``generation_config.json``
(:class:`SamplingDefaults`); else the neutral value. Every resolved value is
checked against its domain here, and an error says where the bad one came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from workers.backends.base import SamplingParams
from workers.backends.errors import GenerationError

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
# Outside this range a penalised float32 score can overflow (or every repeated
# token vanish); transformers takes any positive number, no model ships one near these.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# OpenAI's range for the frequency and presence penalties.
MIN_OPENAI_PENALTY = -2.0
MAX_OPENAI_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingSettings:
    """What one generation samples with, every knob resolved; the neutral values switch a step off."""

    temperature: float = DEFAULT_TEMPERATURE
    """0 is greedy decoding (argmax), which skips every step below but the penalty."""
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    """0 keeps the whole vocabulary."""
    min_p: float = 0.0
    """0 keeps every token; else those at least ``min_p`` times as likely as the most likely one."""
    repetition_penalty: float = 1.0
    """1.0 is off; every id already in the context (the prompt too) gets ``score < 0 ? score * p : score / p``."""
    frequency_penalty: float = 0.0
    """0 is off; every generated id's score loses ``count * frequency_penalty`` (the prompt's ids are not counted)."""
    presence_penalty: float = 0.0
    """0 is off; every id generated at least once loses ``presence_penalty``."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a model's ``generation_config.json`` says when a request leaves a knob unset."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """The sampling keys of a ``generation_config.json``; a key of the wrong JSON type counts as unset."""
        top_k = _number(config.get("top_k"))
        do_sample = config.get("do_sample")
        return cls(
            temperature=_number(config.get("temperature")),
            top_p=_number(config.get("top_p")),
            top_k=int(top_k) if top_k is not None and top_k.is_integer() else None,
            min_p=_number(config.get("min_p")),
            repetition_penalty=_number(config.get("repetition_penalty")),
            do_sample=do_sample if isinstance(do_sample, bool) else None,
        )

    def resolve(self, params: SamplingParams) -> SamplingSettings:
        """The settings a generation uses.

        The request wins; else the model's generation config; a config that
        says ``do_sample: false`` means greedy unless the request asked for a
        temperature (its repetition penalty still applies, as in transformers);
        else the neutral value (temperature and top_p 1.0: plain sampling over
        the whole vocabulary; top_k, min_p and the penalties off). The
        frequency and presence penalties come from the request alone: a
        generation config has no such keys.
        """
        if params.temperature is not None:
            temperature = _Knob(params.temperature, "the request")
        elif self.do_sample is False:
            temperature = _Knob(0.0, "the model's generation_config.json")
        else:
            temperature = self._knob(None, self.temperature, DEFAULT_TEMPERATURE)
        top_p = self._knob(params.top_p, self.top_p, DEFAULT_TOP_P)
        top_k = self._knob(params.top_k, self.top_k, 0)
        min_p = self._knob(params.min_p, self.min_p, 0.0)
        penalty = self._knob(params.repetition_penalty, self.repetition_penalty, 1.0)
        frequency = self._knob(params.frequency_penalty, None, 0.0)
        presence = self._knob(params.presence_penalty, None, 0.0)
        temperature.check(
            "temperature", np.isfinite(temperature.value) and temperature.value >= 0, "a finite number >= 0"
        )
        top_p.check("top_p", 0 < top_p.value <= 1, "in (0, 1]")
        top_k.check("top_k", float(top_k.value).is_integer() and top_k.value >= 0, "an integer >= 0")
        min_p.check("min_p", 0 <= min_p.value <= 1, "in [0, 1]")
        penalty.check(
            "repetition_penalty",
            MIN_REPETITION_PENALTY <= penalty.value <= MAX_REPETITION_PENALTY,
            f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}]",
        )
        openai_range = f"in [{MIN_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}]"
        for name, knob in (("frequency_penalty", frequency), ("presence_penalty", presence)):
            knob.check(name, MIN_OPENAI_PENALTY <= knob.value <= MAX_OPENAI_PENALTY, openai_range)
        return SamplingSettings(
            temperature=float(temperature.value),
            top_p=float(top_p.value),
            top_k=int(top_k.value),
            min_p=float(min_p.value),
            repetition_penalty=float(penalty.value),
            frequency_penalty=float(frequency.value),
            presence_penalty=float(presence.value),
        )

    @staticmethod
    def _knob(requested: float | None, configured: float | None, neutral: float) -> _Knob:
        if requested is not None:
            return _Knob(requested, "the request")
        if configured is not None:
            return _Knob(configured, "the model's generation_config.json")
        return _Knob(neutral, "the default")


@dataclass(frozen=True)
class _Knob:
    """One resolved value and where it came from, so an error can say whom to fix."""

    value: float
    source: str

    def check(self, name: str, valid: bool | np.bool_, domain: str) -> None:
        if not valid:
            raise GenerationError(f"{name} must be {domain}, got {self.value} (from {self.source})")


def _number(value: Any) -> float | None:
    # bool is an int in Python, but ``true`` is no number in a JSON config.
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

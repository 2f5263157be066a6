"""What crosses the pipe between a worker and its engine process, both ways.

Messages are tuples whose first item names them (pickled by
``multiprocessing.connection``): a tuple pickles in microseconds, and nothing
here grows with a row's output but the ids and text of the steps it carries.

From the worker:

- ``(LOAD, request, key, backend, folder, load_kwargs)``: load a model folder
  as ``key``; the reply is its :class:`ModelInfo`.
- ``(ENGINE, key, engine_kwargs)``: the settings of ``key``'s batch engine,
  started with the first row.
- ``(OPEN, request, row, key, prompt_ids, snapshot, params)``: set a
  generation up (``prompt_ids`` for a new one, ``snapshot`` to resume one);
  the reply is its :class:`Opened`. Its rows run from ``SUBMIT``.
- ``(SUBMIT, row)``, ``(STOP, row)`` (end it before its next model call),
  ``(CANCEL, row)`` (its task is being cancelled: it ends ``cancelled``),
  ``(DRAIN, key, grace_seconds)``, ``(UNLOAD, key)``.

From the engine process:

- ``(HELLO, pid)`` once, when it is ready for messages;
- ``(REPLY, request, value, error)``;
- ``(BATCH, news, observed, waiting)``: what the rows made since the last
  batch (a list of :class:`RowNews`), the engines' observations to replay on
  the worker's metrics, and each engine's rows held back. One per engine
  step at most, and one every ``TICK_SECONDS`` when nothing happens: the
  worker's watch takes a silence as a frozen process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from workers.backends.base import Chunk

LOAD = "load"
ENGINE = "engine"
OPEN = "open"
SUBMIT = "submit"
STOP = "stop"
CANCEL = "cancel"
DRAIN = "drain"
UNLOAD = "unload"

HELLO = "hello"
REPLY = "reply"
BATCH = "batch"

TICK_SECONDS = 0.5
"""The engine process says something at least this often."""


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model as the worker needs to know it (the rest stays in the engine process)."""

    provider: str
    resumable: bool
    context_length: int
    vocab_size: int
    prompt_configs: Mapping[str, Mapping[str, Any]] | None
    """The configs the model's prompt side reads (``PromptText``), as the engine process read them: the
    worker renders prompts with them and reads no config file again."""


@dataclass(frozen=True)
class Opened:
    """A generation set up in the engine process, as it stands before its first step."""

    seed: int
    prompt_tokens: int
    generated_ids: list[int]
    state: Mapping[str, Any]
    """Its snapshot state (``Generation.snapshot_state``), without the prompt ids."""
    finish_reason: str | None
    stop_sequence: str | None


class RowNews(NamedTuple):
    """One row's chunk, with the ids it generated and how it stands."""

    row: int
    chunk: Chunk
    new_ids: list[int]
    """The ids generated since the row's last news (the worker's copy is append-only, as the engine's)."""
    finish_reason: str | None
    stop_sequence: str | None
    cached_tokens: int


class Observation(NamedTuple):
    """One call an engine made on its observer (``EngineObserver``), replayed on the worker's metrics."""

    key: str
    engine: int
    """Which of ``key``'s engines (a broken engine is replaced; each has its own metrics)."""
    method: str
    kwargs: dict[str, Any]

"""What an inference runtime raises. It knows nothing of HTTP or problem codes:
``workers.run_problems`` maps each class to the problem a task ends with.

The message (``str(exc)``) is written for a person reading the task's error:
it names the model, the file or the limit involved.
"""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Raised when an inference runtime cannot do what it was asked; the base of the errors below."""


class ModelLoadError(RuntimeFailure):
    """Raised when a model folder cannot be loaded: a missing or unreadable file, an unsupported graph or device."""


class PromptRejected(RuntimeFailure):
    """Raised when a model's chat template refuses a request's input (the request is at fault, not the model)."""


class GenerationError(RuntimeFailure):
    """Raised when prefill or decoding fails: a prompt over the context, a session error, a closed model."""


class ContextTooLong(GenerationError):
    """Raised when a prompt leaves the model no room for output (and the request may not be truncated)."""


class ConstraintFailed(GenerationError):
    """Raised when a row's output constraint fails (the grammar errs, or allows no token): the row fails,
    it never goes on unconstrained."""

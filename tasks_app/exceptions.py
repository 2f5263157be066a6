"""Every error the service raises on purpose.

An ``LmspError`` carries its HTTP status and problem code (PROFILE.md section
2); the API renders it as an RFC 9457 problem object. Other classes signal
programming errors and are never shown to clients as such.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PROBLEM_TYPE_BASE = "urn:lmsp:problem:"


class LmspError(Exception):
    """Raised when a request cannot be served; rendered as a problem object."""

    status: int = 500
    code: str = "internal_error"
    title: str = "Internal server error"

    def __init__(
        self,
        detail: str | None = None,
        *,
        errors: Sequence[Mapping[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.detail = detail or self.title
        self.errors = list(errors) if errors else None
        self.headers = dict(headers) if headers else {}
        super().__init__(self.detail)

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The RFC 9457 problem object; also what a failed task stores in ``error``."""
        body: dict[str, Any] = {
            "type": PROBLEM_TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if instance:
            body["instance"] = instance
        if self.errors:
            body["errors"] = self.errors
        return body

    def to_http_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The problem as an HTTP answer carries it: :meth:`to_problem` and its ``error`` member."""
        return with_sdk_error(self.to_problem(instance))


def with_sdk_error(problem: dict[str, Any]) -> dict[str, Any]:
    """``problem`` with ``error``: the same problem in the member the ``openai`` package reads.

    The package takes ``error`` as the exception's body and ``error.message``
    as its text (``str(exc)``), and ``code``, ``param`` and ``type`` as its
    attributes. Only HTTP answers carry it; a task's stored ``error`` stays
    the plain problem.
    """
    errors = problem.get("errors") or []
    problem["error"] = {
        "message": f"{problem['code']}: {problem['detail']}",
        "type": "server_error" if problem["status"] >= 500 else "invalid_request_error",
        "param": errors[0]["field"] if errors else None,
        "code": problem["code"],
    }
    return problem


class InvalidRequest(LmspError):
    """Raised when a request is malformed or breaks a protocol rule."""

    status, code, title = 400, "invalid_request", "Invalid request"


class UnsupportedCapability(LmspError):
    """Raised when a request asks for a capability the service or model lacks."""

    status, code, title = 400, "unsupported_capability", "Unsupported capability"


class UnsupportedParameter(LmspError):
    """Raised when a request field (or one of its values) asks for what this service does not do.

    ``param`` is the field's path as the client sent it (``tools[0].type``,
    ``text.format``); the problem carries it at the top level and in
    ``error.param``, where the ``openai`` package reads it.
    """

    status, code, title = 400, "unsupported_parameter", "Unsupported parameter"

    def __init__(
        self,
        detail: str | None = None,
        *,
        param: str = "tools",
        errors: Sequence[Mapping[str, str]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.param = param
        detail = detail or f"{param}: not supported by this service"
        super().__init__(detail, errors=errors or [{"field": param, "message": detail}], headers=headers)

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        return {**super().to_problem(instance), "param": self.param}


class StoredProblem(LmspError):
    """A failed task's stored problem, answered as it is (its status, code and members): what a client
    that waited for the end gets when the generation failed."""

    def __init__(self, problem: Mapping[str, Any]) -> None:
        self.problem = dict(problem)
        self.status = int(problem.get("status", 500))
        self.code = problem.get("code", "internal_error")
        self.title = problem.get("title", "Internal server error")
        super().__init__(problem.get("detail"), errors=problem.get("errors"))

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        return {**self.problem, **({"instance": instance} if instance else {})}


class ContextLengthExceeded(LmspError):
    """Raised when a request's prompt leaves the model no room for output (``truncation: disabled``)."""

    status, code, title = 400, "context_length_exceeded", "Context length exceeded"


class ResponseCancelled(LmspError):
    """Raised when a generation a client waits for (a chat completion) was cancelled before it ended."""

    status, code, title = 409, "response_cancelled", "Response cancelled"


class ModelNotFound(LmspError):
    """Raised when a request names a model that is not registered."""

    status, code, title = 400, "model_not_found", "Model not found"


class Unauthorized(LmspError):
    """Raised when a request has no valid, unrevoked bearer token."""

    status, code, title = 401, "unauthorized", "Unauthorized"


class InsufficientScope(LmspError):
    """Raised when the client's token lacks a scope the endpoint needs."""

    status, code, title = 403, "insufficient_scope", "Insufficient scope"


class LocalClientsOnly(LmspError):
    """Raised when a client not on this host asks for what is served only to loopback clients."""

    status, code, title = 403, "local_clients_only", "Local clients only"


class NotFound(LmspError):
    """Raised when no route or resource matches the request."""

    status, code, title = 404, "not_found", "Not found"


class TaskNotFound(NotFound):
    """Raised when a task does not exist or belongs to another client."""

    code, title = "task_not_found", "Task not found"


class ResponseNotFound(NotFound):
    """Raised when a response does not exist or belongs to another client."""

    code, title = "response_not_found", "Response not found"


class ModelNotRegistered(NotFound):
    """Raised when the model a path names is not registered (in a request body it is a 400 instead)."""

    code, title = "model_not_found", "Model not found"


class WebhookEndpointNotFound(NotFound):
    """Raised when a webhook endpoint does not exist or belongs to another client."""

    code, title = "webhook_endpoint_not_found", "Webhook endpoint not found"


class ConversationNotFound(NotFound):
    """Raised when a conversation does not exist or belongs to another client."""

    code, title = "conversation_not_found", "Conversation not found"


class ConversationItemNotFound(NotFound):
    """Raised when a conversation has no item with the id asked for."""

    code, title = "conversation_item_not_found", "Conversation item not found"


class FileNotFound(NotFound):
    """Raised when a file does not exist or belongs to another client."""

    code, title = "file_not_found", "File not found"


class BatchNotFound(NotFound):
    """Raised when a batch does not exist or belongs to another client."""

    code, title = "batch_not_found", "Batch not found"


class WebhookTestFailed(LmspError):
    """Raised when a test event sent to a webhook endpoint got no HTTP answer (refused target, network, timeout)."""

    status, code, title = 502, "webhook_test_failed", "Webhook test failed"


class MethodNotAllowed(LmspError):
    """Raised when a route exists but not for the request's method."""

    status, code, title = 405, "method_not_allowed", "Method not allowed"


class NotAcceptable(LmspError):
    """Raised when the client accepts no representation the endpoint has."""

    status, code, title = 406, "not_acceptable", "Not acceptable"


class TaskNotCancelable(LmspError):
    """Raised when a cancel reaches a task that already succeeded or failed."""

    status, code, title = 409, "task_not_cancelable", "Task not cancelable"


class TaskNotHandedBack(LmspError):
    """Raised when an operator's hand-back reaches a task that no silent worker holds (admin only)."""

    status, code, title = 409, "task_not_handed_back", "Task not handed back"


class TaskNotRerunnable(LmspError):
    """Raised when an operator asks to run again a task that did not fail or was not cancelled (admin only)."""

    status, code, title = 409, "task_not_rerunnable", "Task not rerunnable"


class BatchNotCancelable(LmspError):
    """Raised when a cancel reaches a batch that already ended (completed, failed, expired)."""

    status, code, title = 409, "batch_not_cancelable", "Batch not cancelable"


class FileInUse(LmspError):
    """Raised when a file is deleted while a batch that reads or writes it has not ended."""

    status, code, title = 409, "file_in_use", "File in use"


class ResponseNotFinished(LmspError):
    """Raised when a response is deleted before its task ended (PROFILE.md section 9)."""

    status, code, title = 409, "response_not_finished", "Response not finished"


class ConversationBusy(LmspError):
    """Raised when a response is started on a conversation while another response on it has not finished."""

    status, code, title = 409, "conversation_busy", "Conversation busy"


class IdempotencyKeyInUse(LmspError):
    """Raised when an idempotency key's first request is still being served."""

    status, code, title = 409, "idempotency_key_in_use", "Idempotency key in use"


class EventHistoryExpired(LmspError):
    """Raised when a stream cursor points before the retained events."""

    status, code, title = 410, "event_history_expired", "Event history expired"


class PayloadTooLarge(LmspError):
    """Raised when a request body exceeds the configured limit."""

    status, code, title = 413, "payload_too_large", "Payload too large"

    @classmethod
    def over(cls, limit: int) -> PayloadTooLarge:
        return cls(f"The request body exceeds {limit} bytes")


class UnsupportedMediaType(LmspError):
    """Raised when a request body is not ``application/json``."""

    status, code, title = 415, "unsupported_media_type", "Unsupported media type"


class IdempotencyKeyReused(LmspError):
    """Raised when an idempotency key comes back with a different body."""

    status, code, title = 422, "idempotency_key_reused", "Idempotency key reused"


class QueueFull(LmspError):
    """Raised when too many tasks wait in ``queued`` to accept another."""

    status, code, title = 429, "queue_full", "Queue full"


class TooManyStreams(LmspError):
    """Raised when the client, or the web process, already holds as many open event streams as allowed."""

    status, code, title = 429, "too_many_streams", "Too many streams"


class RequestHeaderTooLarge(LmspError):
    """Raised when a request's head (request line and headers) is longer than the HTTP server accepts."""

    status, code, title = 431, "request_header_too_large", "Request header fields too large"


class TooManyConnections(LmspError):
    """Raised when the web process already has as many connections open as allowed; retry after ``Retry-After``."""

    status, code, title = 503, "service_unavailable", "Service unavailable"


class RateLimited(LmspError):
    """Raised when a client calls a throttled endpoint too often."""

    status, code, title = 429, "rate_limited", "Too many requests"


class RateLimitUnavailable(LmspError):
    """Raised when a rate-limited request cannot be counted (Redis unreachable), so it is refused, not let through."""

    status, code, title = 503, "service_unavailable", "Service unavailable"


class DatabaseBusy(LmspError):
    """Raised when a lock (SQLite's write lock, a PostgreSQL row lock) was not granted in time; nothing was written."""

    status, code, title = 503, "service_unavailable", "Service unavailable"


class DatabaseUnavailable(LmspError):
    """Raised when the database cannot be reached or refuses writes (read-only) now; nothing was written."""

    status, code, title = 503, "service_unavailable", "Service unavailable"


class InsufficientStorage(LmspError):
    """Raised when the database's disk is full; nothing was written, and nothing accepted before is lost."""

    status, code, title = 507, "insufficient_storage", "Insufficient storage"


class InternalError(LmspError):
    """Raised when the service fails in a way the client cannot fix."""


class ServerRestarted(LmspError):
    """Raised when a task is ended by a restart or by the death of its worker, as its policy says."""

    status, code, title = 500, "server_restarted", "Server restarted"


class ModelLoadFailed(LmspError):
    """Raised when a worker cannot load the model a task names."""

    status, code, title = 500, "model_load_failed", "Model load failed"


class BackendError(LmspError):
    """Raised when the inference backend fails while generating."""

    status, code, title = 500, "backend_error", "Backend error"


class TransitionNotAllowed(Exception):
    """Raised when code asks the lifecycle for a move its table forbids."""


class ModelPullFailed(Exception):
    """Raised when ``lmsp_models pull`` cannot list, download, verify or place a model; the message says why."""

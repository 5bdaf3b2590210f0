"""Typed errors of the serving layer and the one table that maps them to OpenAI JSON.

Theory of operation: whoever detects a problem raises the matching subclass of
:class:`ServeError` (the request parser raises :class:`InvalidRequestError`, the engine
client raises :class:`PromptTooLongError`, :class:`EngineUnavailableError` ...). Failures
of the layers below that surface while a request is served keep their own types (the
engine's :class:`~meshnode.engine.ContextOverflowError`, a lost peer's
:class:`~meshnode.mesh.fabric.PeerUnavailableError` ...): :data:`ERROR_TABLE` has rows for
them too, so a session outgrowing its context is the caller's 400 and a peer gone is a
503, not one undifferentiated 500. The HTTP edge turns any exception with a row into
``{"error": {"message", "type", "param", "code"}}`` with the row's status code, or, once
an SSE stream has started, into an in-band error chunk followed by ``data: [DONE]``; an
exception without a row is a bug, reported as an internal error. Classification is by
type only (walking the MRO), never by message text.

The error shape follows OpenAI's API reference ("Error codes" and the error object):
``type`` is ``invalid_request_error`` for the caller's mistakes and ``server_error`` for
ours; ``code`` is a short machine-readable string or null; ``param`` names the offending
request field or is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from meshnode.engine.errors import ContextOverflowError, EngineBusyError, EngineError
from meshnode.errors import MeshnodeError
from meshnode.limits import MAX_STORED_RESPONSES
from meshnode.mesh.fabric import PeerUnavailableError
from meshnode.mesh.pipeline import PipelineFailedError, PipelineUnavailableError, StepFailedError

__all__ = [
    "ERROR_TABLE",
    "EngineFailedError",
    "EngineUnavailableError",
    "ErrorSpec",
    "ForbiddenRequestError",
    "InvalidRequestError",
    "MalformedRequestError",
    "MissingApiKeyError",
    "PayloadTooLargeError",
    "PromptTooLongError",
    "RequestTimeoutError",
    "ResponseNotFoundError",
    "ServeError",
    "ServerBusyError",
    "UnknownModelError",
    "UnsupportedMediaTypeError",
    "UnsupportedValueError",
    "error_body",
    "error_spec",
]


class ServeError(MeshnodeError):
    """Base of every error the OpenAI layer reports. ``param`` names the request field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --- the caller's fault (4xx) ---------------------------------------------------------


class InvalidRequestError(ServeError):
    """A request field has a bad value (``param`` names it)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message, param=param)


class UnsupportedValueError(InvalidRequestError):
    """A valid OpenAI parameter value this server does not implement (``n`` > 1 ...)."""


class MalformedRequestError(InvalidRequestError):
    """The body is not parseable JSON (or not a JSON object)."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class UnknownModelError(ServeError):
    """No model of that id is served by this node or its mesh; ``served``: the ids that
    are (named in the message, so whoever set up an editor sees what to write)."""

    SHOWN = 8   # served ids named in the message at most
    ECHOED = 128   # characters of the asked-for id the message repeats (it is the client's text)

    def __init__(self, model: str, served: Sequence[str] | None = None) -> None:
        shown = model if len(model) <= self.ECHOED else model[:self.ECHOED] + "..."
        message = f"The model '{shown}' does not exist or is not served by this mesh."
        if served:
            more = f" and {len(served) - self.SHOWN} more" if len(served) > self.SHOWN else ""
            message += f" Served: {', '.join(served[:self.SHOWN])}{more} (GET /v1/models lists them)."
        elif served is not None:
            message += " It serves no model yet."
        super().__init__(message, param="model")
        self.model = model
        self.served = None if served is None else tuple(served)


class ResponseNotFoundError(ServeError):
    """A Responses API id this node does not keep (never answered here, forgotten, or
    answered with ``store: false``)."""

    def __init__(self, response_id: str, param: str | None = None) -> None:
        cut = UnknownModelError.ECHOED   # (the client's text)
        shown = response_id if len(response_id) <= cut else response_id[:cut] + "..."
        super().__init__(f"Response with id '{shown}' not found (this node keeps the latest "
                         f"{MAX_STORED_RESPONSES} responses it answered with 'store' not false).", param=param)


class PromptTooLongError(ServeError):
    """The prompt does not fit the context: refused before prefill. (A session that
    outgrows its context later is the engine's :class:`~meshnode.engine.ContextOverflowError`.)

    ``param`` may stay None: the route fills in its prompt field (``messages``/``prompt``).
    """

    def __init__(self, prompt_tokens: int, n_ctx: int, *, param: str | None = None,
                 at_least: bool = False) -> None:
        # at_least: counted from the text's length without tokenizing (a lower bound)
        super().__init__(
            f"This model's maximum context length is {n_ctx} tokens. However, your request "
            f"resulted in {'at least ' if at_least else ''}{prompt_tokens} prompt tokens. "
            "Please reduce the length of the prompt.",
            param=param,
        )
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx


# --- refused at the door (the HTTP guard, meshnode/serve/http_guard.py) -----------------


class PayloadTooLargeError(ServeError):
    """The body is larger than the node's cap (``--max-body``)."""


class UnsupportedMediaTypeError(ServeError):
    """A request body that is not ``application/json`` (a web page's form or ``text/plain``
    POST, which a browser sends cross-site without asking)."""


class MissingApiKeyError(ServeError):
    """No ``Authorization: Bearer <key>``, or the wrong key."""


class ForbiddenRequestError(ServeError):
    """A Host the node does not answer to (DNS rebinding) or a foreign Origin (a web page)."""


class RequestTimeoutError(ServeError):
    """The body did not arrive in time (a slow sender holding a request slot)."""


class ServerBusyError(ServeError):
    """Every slot and the queue are taken: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# --- our fault (5xx) ------------------------------------------------------------------


class EngineUnavailableError(ServeError):
    """No route for the model right now (stages not ready, peer gone): retry later."""


class EngineFailedError(ServeError):
    """The engine or the pipeline failed while serving the request."""


class ErrorSpec(NamedTuple):
    status: int
    type: str
    code: str | None


# The one table, keyed by exception type: the serving layer's own errors and the failures
# of the layers below that can surface while a request is served. Lookup walks the
# exception's MRO, so a subclass without its own row inherits its parent's; the most
# specific row wins.
ERROR_TABLE: dict[type[Exception], ErrorSpec] = {
    # the caller's mistakes
    MalformedRequestError: ErrorSpec(400, "invalid_request_error", "invalid_json"),
    UnsupportedValueError: ErrorSpec(400, "invalid_request_error", "unsupported_value"),
    InvalidRequestError: ErrorSpec(400, "invalid_request_error", "invalid_value"),
    UnknownModelError: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    ResponseNotFoundError: ErrorSpec(404, "invalid_request_error", "not_found"),
    PromptTooLongError: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    # prompt + completion (+ drafts) grew past a stage's context: too long a request
    ContextOverflowError: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    # refused at the door
    MissingApiKeyError: ErrorSpec(401, "invalid_request_error", "invalid_api_key"),
    ForbiddenRequestError: ErrorSpec(403, "invalid_request_error", "forbidden"),
    RequestTimeoutError: ErrorSpec(408, "invalid_request_error", "request_timeout"),
    PayloadTooLargeError: ErrorSpec(413, "invalid_request_error", "payload_too_large"),
    UnsupportedMediaTypeError: ErrorSpec(415, "invalid_request_error", "unsupported_media_type"),
    # full: every slot and the queue taken (Retry-After says when to come back)
    ServerBusyError: ErrorSpec(429, "server_error", "server_busy"),
    # ours, and passing: the same request may succeed later
    EngineUnavailableError: ErrorSpec(503, "server_error", "engine_unavailable"),
    EngineBusyError: ErrorSpec(503, "server_error", "engine_unavailable"),
    PeerUnavailableError: ErrorSpec(503, "server_error", "engine_unavailable"),
    PipelineUnavailableError: ErrorSpec(503, "server_error", "engine_unavailable"),
    # ours
    EngineFailedError: ErrorSpec(500, "server_error", "engine_failed"),
    PipelineFailedError: ErrorSpec(500, "server_error", "engine_failed"),
    # one request's step failed alone (its sampling): that request's 500, not its batch's
    StepFailedError: ErrorSpec(500, "server_error", "engine_failed"),
    EngineError: ErrorSpec(500, "server_error", "engine_failed"),
    ServeError: ErrorSpec(500, "server_error", None),
}


def error_spec(exc: BaseException) -> ErrorSpec | None:
    """The table row for ``exc`` (most specific class first); None when no row covers it
    (a bug: the HTTP edge reports it as an internal error)."""
    for cls in type(exc).__mro__:
        spec = ERROR_TABLE.get(cls)
        if spec is not None:
            return spec
    return None


def error_body(exc: Exception) -> dict[str, Any]:
    """OpenAI's error object for ``exc``, which has a row in :data:`ERROR_TABLE`:
    ``{"error": {message, type, param, code}}``. A failure of a lower layer has no
    request field to name; its message is its own."""
    spec = error_spec(exc)
    if spec is None:
        raise TypeError(f"{type(exc).__name__} has no row in ERROR_TABLE")
    if isinstance(exc, ServeError):
        message, param = exc.message, exc.param
    else:
        message, param = str(exc), None
    return {"error": {"message": message, "type": spec.type, "param": param, "code": spec.code}}

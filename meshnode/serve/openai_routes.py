"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``;
llama.cpp server's ``/completion`` and ``/infill``; the tokenizer endpoints ``/tokenize``,
``/detokenize`` and ``/tokenizer_info`` (vLLM's shapes).

Theory of operation: :func:`make_openai_router` builds an ``APIRouter`` whose handlers
depend only on an :class:`~meshnode.serve.client.EngineClient` (fetched per request from
the getter, so the node can swap engines). A handler

1. parses the raw body itself (:func:`~meshnode.serve.schemas.parse_request`; a body
   over 64 KiB on a thread), so malformed JSON and bad fields become OpenAI error JSON
   without touching the app's global exception handlers. The body has already passed
   :mod:`meshnode.serve.http_guard` (size cap, content type, key); since FastAPI cannot
   see a body parsed by hand, each route declares its request body and its error
   responses for the OpenAPI document itself;
2. converts it to a :class:`GenerationRequest` (a batch of prompts: one each, merged by
   :mod:`meshnode.serve.batched`), checks the model id against ``models()``, and calls
   ``generate``;
3. pulls the *first* event before answering, so request errors the engine raises up front
   (context overflow, unknown model, no route) are real 4xx/503 responses even when
   ``stream`` is true;
4. returns one JSON body, or an SSE stream: role chunk, content deltas, a finish chunk,
   an optional usage chunk (``stream_options.include_usage``), then ``data: [DONE]``.
   Errors after the stream started go in-band (an ``{"error": ...}`` chunk, then
   ``[DONE]``); ``: keep-alive`` comments go out when the engine is silent for
   ``keepalive_s``.

Disconnects: non-streaming and pre-stream waits race the work against
``http.disconnect``; a streaming body is cancelled by Starlette when the client leaves
(ASGI < 2.4) or fails on its next write (>= 2.4; at worst one keep-alive interval later).
In every case the engine's generator is closed (cancelled and ``aclose()``d, shielded
from the surrounding cancellation) so the engine frees the session.

All errors map through :data:`meshnode.serve.errors.ERROR_TABLE`; the custom route class
turns any exception with a row there (every :class:`ServeError`, and the engine's and the
mesh's failures) into ``{"error": {...}}`` with the row's status code; anything else is
logged as a bug and answered as a 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from meshnode.serve.client import (
    Admitted,
    EngineClient,
    Finished,
    GenerationEvent,
    GenerationRequest,
    TextDelta,
    TimingsJSON,
    TokenLogprob,
)
from meshnode.serve.errors import (
    EngineFailedError,
    EngineUnavailableError,
    InvalidRequestError,
    PromptTooLongError,
    ResponseNotFoundError,
    UnknownModelError,
    error_body,
    error_spec,
)
from meshnode.serve.batched import batched_events
from meshnode.serve.http_guard import error_headers
from meshnode.serve.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    InfillRequest,
    InfillResponse,
    NativeCompletionRequest,
    ModelList,
    ModelObject,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    ToolCallOut,
    UsageInfo,
    parse_request,
)
from meshnode.serve.tools import CallDelta, ToolCallParser, split_tool_calls
from meshnode.serve.response_store import ResponseStore
from meshnode.serve.responses_api import ResponseEvents, ResponseObject, ResponsesRequest, usage_object
from meshnode.serve.sse import DONE, KEEP_ALIVE, EventPump, KeepAliveTick, sse_data, sse_event

log = logging.getLogger("meshnode.serve.openai")

__all__ = ["DEFAULT_KEEPALIVE_S", "OpenAIRoute", "error_response", "error_responses", "make_openai_router"]

DEFAULT_KEEPALIVE_S = 10.0
# Bodies up to this size are parsed inline (well under a millisecond); larger ones on a
# thread, so the Python parts of validation yield the loop to the mesh's heartbeats.
INLINE_PARSE_BYTES = 64 * 1024
_T = TypeVar("_T")

# What the OpenAPI document declares (the handlers parse bodies by hand, so FastAPI cannot
# see them): every error status a route can answer, in OpenAI's error shape.
_ERROR_DOCS = {
    400: "invalid request (bad JSON, a bad field, a prompt longer than the context)",
    401: "missing or wrong API key (the node was started with --api-key)",
    403: "a Host or Origin this node does not answer to",
    404: "unknown model",
    408: "the body did not arrive in time",
    413: "the body is larger than --max-body",
    415: "the body is not application/json",
    429: "every slot and queue place taken; see Retry-After",
    500: "the engine failed",
    503: "no route to the model right now",
}
GET_ERRORS = (400, 401, 403, 404, 500, 503)
POST_ERRORS = tuple(_ERROR_DOCS)


def error_responses(codes: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` entry of a route that can answer ``codes`` with an error."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _ERROR_DOCS[code]}
        if code == 429:
            entry["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
        if code == 401:
            entry["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[code] = entry
    return out


def _post_docs(request_model: type, response_model: type) -> dict[str, Any]:
    name = request_model.__name__
    return dict(
        responses={200: {"model": response_model, "description": "the answer; text/event-stream chunks "
                         "when stream is true",
                         "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                   **error_responses(POST_ERRORS)},
        # components/schemas/<name> is added by meshnode.serve.app (request_schemas)
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}},
    )


async def _parse(model: type[Any], request: Request) -> Any:
    body = await request.body()
    if len(body) <= INLINE_PARSE_BYTES:
        return parse_request(model, body)
    return await asyncio.to_thread(parse_request, model, body)


def error_response(exc: Exception) -> JSONResponse:
    """The HTTP response for ``exc``: OpenAI's error JSON with the table's status code
    (an exception without a row in the table is a bug: a 500 that says so)."""
    spec = error_spec(exc)
    if spec is None:
        exc = EngineFailedError("Internal server error.")
        spec = error_spec(exc)
    assert spec is not None
    return JSONResponse(error_body(exc), status_code=spec.status, headers=error_headers(exc))


class OpenAIRoute(APIRoute):
    """APIRoute whose failures come out in OpenAI's error shape, whatever raised them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:  # path/query params; bodies are parsed by hand
                first = e.errors()[0] if e.errors() else {}
                param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
                return error_response(InvalidRequestError(param, str(first.get("msg", "invalid request"))))
            except HTTPException:
                raise
            except Exception as e:
                if error_spec(e) is None:
                    log.exception("unexpected error serving %s %s", request.method, request.url.path)
                else:
                    log.info("%s %s -> %s: %s", request.method, request.url.path, type(e).__name__, e)
                return error_response(e)

        return guarded


def make_openai_router(
    get_client: Callable[[], EngineClient], *, keepalive_s: float = DEFAULT_KEEPALIVE_S,
    responses: ResponseStore | None = None,
) -> APIRouter:
    """Build the ``/v1`` router. ``get_client`` is called once per request; it may raise
    ``EngineUnavailableError`` (-> 503). ``responses``: where the Responses API keeps
    answers (a node's own, on disk; default a new one in memory). Include it with
    ``app.include_router(router)``."""
    router = APIRouter(prefix="/v1", route_class=OpenAIRoute, tags=["openai"])
    # llama.cpp server's own endpoints, at their paths
    llamacpp_router = APIRouter(route_class=OpenAIRoute, tags=["llama.cpp"])

    @router.get("/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(GET_ERRORS)})
    async def list_models() -> JSONResponse:
        cards = get_client().models()
        return _json(ModelList(data=[_model_object(c) for c in cards]))

    @router.get("/models/{model_id:path}", response_model=None,
                responses={200: {"model": ModelObject}, **error_responses(GET_ERRORS)})
    async def retrieve_model(model_id: str) -> JSONResponse:
        cards = get_client().models()
        for card in cards:
            if card.id == model_id:
                return _json(_model_object(card))
        raise UnknownModelError(model_id, [c.id for c in cards])

    @router.post("/chat/completions", response_model=None, **_post_docs(ChatCompletionRequest, ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        body = await _parse(ChatCompletionRequest, request)
        chunks = _ChatChunks(body.model, body.include_usage, body.tool_names(), body.legacy_functions)
        return await _serve(request, body, [body.to_generation_request(chunks.id)], chunks, "messages")

    # the Responses API's answers, for previous_response_id and GET
    kept = responses if responses is not None else ResponseStore()

    @router.post("/responses", response_model=None, **_post_docs(ResponsesRequest, ResponseObject))
    async def responses(request: Request) -> Response:
        body = await _parse(ResponsesRequest, request)
        previous: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            before = kept.get(body.previous_response_id)
            if before is None:
                raise ResponseNotFoundError(body.previous_response_id, "previous_response_id")
            previous = before.messages
        chat = body.to_chat(previous)
        chunks = _ResponsesChunks(body, chat.tool_names(), kept if body.store is not False else None,
                                  [*previous, *body.conversation()])
        return await _serve(request, body, [chat.to_generation_request(chunks.id)], chunks, "input")

    @router.get("/responses/{response_id}", response_model=None,
                responses={200: {"model": ResponseObject}, **error_responses(GET_ERRORS)})
    async def get_response(response_id: str) -> JSONResponse:
        found = kept.get(response_id)
        if found is None:
            raise ResponseNotFoundError(response_id)
        return JSONResponse(found.response)

    @router.delete("/responses/{response_id}", response_model=None, responses=error_responses(GET_ERRORS))
    async def delete_response(response_id: str) -> JSONResponse:
        if not kept.delete(response_id):
            raise ResponseNotFoundError(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @router.post("/completions", response_model=None, **_post_docs(CompletionRequest, CompletionResponse))
    async def completions(request: Request) -> Response:
        body = await _parse(CompletionRequest, request)
        chunks = _TextChunks(body.model, body.include_usage)
        return await _serve(request, body, body.to_generation_requests(chunks.id), chunks, "prompt")

    @llamacpp_router.post("/infill", response_model=None, **_post_docs(InfillRequest, InfillResponse))
    async def infill(request: Request) -> Response:
        return await _serve_llamacpp(request, await _parse(InfillRequest, request), "input_prefix")

    @llamacpp_router.post("/completion", response_model=None,
                          **_post_docs(NativeCompletionRequest, InfillResponse))
    async def completion(request: Request) -> Response:
        return await _serve_llamacpp(request, await _parse(NativeCompletionRequest, request), "prompt")

    async def _serve_llamacpp(request: Request, body: InfillRequest | NativeCompletionRequest,
                              prompt_param: str) -> Response:
        """A llama.cpp-shaped body: for ``model``, or the node's first model."""
        cards = get_client().models()
        if body.model is None and not cards:
            raise UnknownModelError("(none)", [])
        chunks = _LlamaCppChunks(body.model or cards[0].id)
        return await _serve(request, body, [body.to_generation_request(chunks.id, chunks.model)], chunks,
                            prompt_param)

    async def _serve(
        request: Request,
        body: ChatCompletionRequest | CompletionRequest | InfillRequest | NativeCompletionRequest | ResponsesRequest,
        gen_requests: list[GenerationRequest], chunks: _Chunks, prompt_param: str
    ) -> Response:
        """``gen_requests``: one, or the prompts of a batch (completions), whose choices
        are numbered prompt by prompt."""
        caller = _caller(request)
        gen_requests = [replace(g, client=caller) for g in gen_requests]
        first_request = gen_requests[0]
        chunks.per_prompt = first_request.n
        chunks.n = first_request.n * len(gen_requests)
        chunks.logprobs = first_request.logprobs is not None
        client = get_client()
        # The engine client decides which names it serves (ids, aliases, file names) and
        # raises UnknownModelError before its first event.
        log.debug("%s: model=%s stream=%s prompts=%d", chunks.id, first_request.model, bool(body.stream),
                  len(gen_requests))
        events = client.generate(first_request) if len(gen_requests) == 1 else batched_events(client, gen_requests)
        pump: EventPump[GenerationEvent] = EventPump(events, keepalive_s)
        handed_over = False
        try:
            if not body.stream:
                choices = await _unless_disconnected(request, _collect(pump, chunks.n))
                return _json(chunks.full_response(choices))
            first = await _unless_disconnected(request, _first_event(pump))
            handed_over = True
            return _SSEResponse(_stream(request, pump, first, chunks), pump.aclose)
        except PromptTooLongError as e:
            if e.param is None:
                e.param = prompt_param
            raise
        except UnknownModelError as e:
            if e.served is not None:
                raise
            raise UnknownModelError(e.model, [c.id for c in client.models()]) from None
        except _ClientGone:
            log.debug("%s: client went away before the response", chunks.id)
            return Response(status_code=499)
        finally:
            if not handed_over:
                with anyio.CancelScope(shield=True):
                    await pump.aclose()

    outer = APIRouter()
    outer.include_router(router)
    outer.include_router(llamacpp_router)
    outer.include_router(_tokenizer_router(get_client))
    return outer


def _tokenizer_router(get_client: Callable[[], EngineClient]) -> APIRouter:
    """vLLM's (and llama.cpp server's) tokenizer endpoints, at the server's root, for the
    node's own model (``model`` optional): what an evaluation harness needs to tokenize
    as the node does (lm-evaluation-harness's ``tokenizer_backend=remote``)."""
    router = APIRouter(route_class=OpenAIRoute, tags=["tokenizer"])

    def engine() -> Any:
        client = get_client()
        local = getattr(client, "local", client)     # the mesh client's own model server
        if not hasattr(local, "tokenize"):
            raise EngineUnavailableError("No model of this node is ready (the tokenizer endpoints serve the "
                                         "model this node coordinates).")
        return local

    @router.post("/tokenize", response_model=None, **_post_docs(TokenizeRequest, TokenizeResponse))
    async def tokenize(request: Request) -> JSONResponse:
        body = await _parse(TokenizeRequest, request)
        local = engine()
        chat = body.chat_request()
        if chat is not None:
            tokens = await local.tokenize_chat(chat, body.add_generation_prompt)
        else:
            text, add_bos = body.text_and_bos()
            tokens = await local.tokenize(body.model, text, add_bos)
        return _json(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=local.settings.n_ctx))

    @router.post("/detokenize", response_model=None, **_post_docs(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(request: Request) -> JSONResponse:
        body = await _parse(DetokenizeRequest, request)
        text = await engine().detokenize(body.model, body.tokens)
        return _json(DetokenizeResponse(prompt=text, content=text))

    @router.get("/tokenizer_info", response_model=None, responses=error_responses(GET_ERRORS))
    async def tokenizer_info(model: str | None = None) -> JSONResponse:
        return JSONResponse(engine().tokenizer_info(model))

    return router


# --- helpers ---------------------------------------------------------------------------


class _ClientGone(Exception):
    pass


def _caller(request: Request) -> str:
    """Who sent ``request``, for drafting from the same caller's recent requests: its
    address, plus a hash of the API key it sent (the key itself is not kept), so callers
    behind one address with keys of their own, and users of one shared key at different
    addresses, stay apart."""
    import hashlib

    addr = request.client.host if request.client else ""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return f"{addr}/" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:16]
    return addr


def _json(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


# Every feature a model object reports, supported or not (serve.model_server.model_capabilities)
FEATURES = ("chat", "completions", "stream", "logprobs", "n", "fim", "tools", "structured_output")


def _model_object(card: Any) -> ModelObject:
    meta = {"n_ctx": card.n_ctx} if card.n_ctx is not None else None
    where = None
    if card.coordinator_id:
        where = {"coordinator": {"id": card.coordinator_id, "name": card.coordinator_name},
                 "context_length": card.n_ctx, "local": card.local}
    caps = set(getattr(card, "capabilities", ()))
    if not caps:   # an engine that does not say
        return ModelObject(id=card.id, created=card.created, owned_by=card.owned_by, meta=meta,
                           context_length=card.n_ctx, meshnode=where)
    unsupported = dict(getattr(card, "unsupported", ()))
    for name in FEATURES:
        if name not in caps:
            unsupported.setdefault(name, "not implemented by this node")
    return ModelObject(id=card.id, created=card.created, owned_by=card.owned_by, meta=meta,
                       context_length=card.n_ctx, capabilities={f: f in caps for f in FEATURES},
                       unsupported=unsupported or None, meshnode=where)


async def _wait_disconnect(request: Request) -> None:
    # Only used once the body has been read: the next ASGI message is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work`` unless the client disconnects first (then raise _ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone
    finally:
        for t in (task, watch):
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watch, return_exceptions=True)


async def _first_event(pump: EventPump[GenerationEvent]) -> GenerationEvent:
    while True:
        try:
            event = await pump.next()
        except StopAsyncIteration:
            raise EngineFailedError("The engine ended the request without a result.") from None
        if not isinstance(event, KeepAliveTick):
            return event


class _Choice:
    """One choice collected for a non-streaming answer."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finished: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def _collect(pump: EventPump[GenerationEvent], n: int) -> list[_Choice]:
    choices = [_Choice() for _ in range(n)]
    left = n
    while True:
        event = await _first_event(pump)
        match event:
            case Admitted():
                pass
            case TextDelta():
                c = choices[event.index]
                c.parts.append(event.text)
                c.logprobs.extend(event.logprobs)
            case Finished():
                choices[event.index].finished = event
                left -= 1
                if not left:
                    return choices


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body generator, even after a disconnect.

    Starlette cancels the streaming task when the client leaves; the generator may then be
    parked at a ``yield`` and would only be finalized by the garbage collector.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body_gen = content
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._body_gen, "aclose", None)
                if aclose is not None:
                    await aclose()
                # If the body never started (client gone before the first chunk), its
                # own finally never ran: close the engine's generator here. Idempotent.
                await self._cleanup()


async def _stream(
    request: Request, pump: EventPump[GenerationEvent], first: GenerationEvent, chunks: _Chunks
) -> AsyncIterator[bytes]:
    """The SSE body. Owns ``pump`` and closes it on every exit path."""
    try:
        for head in chunks.head():
            yield chunks.encode(head)
        event: GenerationEvent | KeepAliveTick = first
        finished: list[Finished] = []
        while True:
            match event:
                case KeepAliveTick():
                    if await request.is_disconnected():
                        log.debug("%s: client disconnected", chunks.id)
                        return
                    yield KEEP_ALIVE
                case Admitted():
                    pass
                case TextDelta():
                    if event.text or event.logprobs:
                        for chunk in chunks.deltas(event):
                            yield chunks.encode(chunk)
                case Finished():
                    finished.append(event)
                    for tail in chunks.tail(event, finished):
                        yield chunks.encode(tail)
                    if len(finished) == chunks.n:
                        if chunks.done_marker:
                            yield DONE
                        return
            event = await pump.next()
    except StopAsyncIteration:
        yield sse_data(error_body(EngineFailedError("The engine ended the request without a result.")))
        yield DONE
    except Exception as e:
        if error_spec(e) is None:
            log.exception("%s: engine failed mid-stream", chunks.id)
            e = EngineFailedError("Internal server error.")
        else:
            log.info("%s: in-band error %s: %s", chunks.id, type(e).__name__, e)
        yield sse_data(error_body(e))
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):
            await pump.aclose()


# --- response bodies -------------------------------------------------------------------


def _total_usage(finished: list[Finished], per_prompt: int = 1) -> UsageInfo:
    """Each prompt once (it was prefilled once for its ``per_prompt`` choices), every
    choice's completion tokens; the prompt tokens whose KV a kept session supplied as
    ``cached_tokens``."""
    firsts = [f for f in finished if f.index % per_prompt == 0]     # a prompt's first choice
    prompt = sum(f.usage.prompt_tokens for f in firsts)
    cached = sum(f.timings.cache_n for f in firsts)
    completion = sum(f.usage.completion_tokens for f in finished)
    details = None
    if finished and finished[0].usage.accepted_prediction_tokens is not None:
        details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(f.usage.accepted_prediction_tokens or 0 for f in finished),
            rejected_prediction_tokens=sum(f.usage.rejected_prediction_tokens or 0 for f in finished))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)


class _Chunks:
    """Builds one endpoint's response objects; ``id`` doubles as the engine request id.
    ``n`` choices; ``logprobs``: whether they were asked for."""

    prefix = ""           # the ids' start, as OpenAI spells it
    done_marker = True    # the stream ends with ``data: [DONE]``

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = f"{self.prefix}{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.n = 1              # choices in all
        self.per_prompt = 1     # ... of each prompt (a batch of prompts: completions)
        self.logprobs = False

    def head(self) -> list[dict[str, Any]]:
        return []

    def encode(self, chunk: dict[str, Any]) -> bytes:
        """One chunk as the stream's bytes."""
        return sse_data(chunk)

    def delta(self, event: TextDelta) -> dict[str, Any]:
        raise NotImplementedError

    def deltas(self, event: TextDelta) -> list[dict[str, Any]]:
        """The chunks that carry ``event`` (none while a tool call's start is held back)."""
        return [self.delta(event)]

    def finish(self, event: Finished, timings: TimingsJSON | None) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo, timings: TimingsJSON) -> dict[str, Any]:
        raise NotImplementedError

    def full_response(self, choices: list[_Choice]) -> Any:
        raise NotImplementedError

    def tail(self, event: Finished, finished: list[Finished]) -> list[dict[str, Any]]:
        """The choice's finish chunk; after the last choice, the usage chunk if asked
        for. Timings ride on the request's last chunk."""
        last = len(finished) == self.n
        timings = event.timings.to_json() if last else None
        if not self.include_usage or not last:
            return [self.finish(event, timings)]
        return [self.finish(event, None),
                self.usage_chunk(_total_usage(finished, self.per_prompt), event.timings.to_json())]

    def _parts(self, choices: list[_Choice]) -> tuple[list[Finished], UsageInfo, TimingsJSON]:
        finished = [c.finished for c in choices if c.finished is not None]
        return finished, _total_usage(finished, self.per_prompt), finished[-1].timings.to_json()


class _ChatChunks(_Chunks):
    """Chat chunks; with ``tool_names`` the answer is read for tool calls
    (:class:`~meshnode.serve.tools.ToolCallParser`): they stream in OpenAI's delta shape
    and the finish reason of an answer that made calls is ``tool_calls``."""

    prefix = "chatcmpl-"

    def __init__(self, model: str, include_usage: bool, tool_names: list[str] | None = None,
                 legacy: bool = False) -> None:
        super().__init__(model, include_usage)
        self.tool_names = tool_names
        # the request named its tools `functions`: its one call is the message's function_call
        self.legacy = legacy
        self._parsers: dict[int, ToolCallParser] = {}   # per choice, when tools are read back
        # per choice, the logprobs of tokens whose text the reader holds back (a possible
        # call's start, whitespace next to a call): they ride on the choice's next chunk
        self._held: dict[int, list[TokenLogprob]] = {}

    def _parser(self, index: int) -> ToolCallParser | None:
        if not self.tool_names:
            return None
        if index not in self._parsers:
            self._parsers[index] = ToolCallParser(self.tool_names)
        return self._parsers[index]

    def deltas(self, event: TextDelta) -> list[dict[str, Any]]:
        parser = self._parser(event.index)
        if parser is None:
            return [self.delta(event)]
        return self._parsed(event, *parser.feed(event.text))

    def _parsed(self, event: TextDelta, content: str, calls: list[CallDelta]) -> list[dict[str, Any]]:
        # logprobs ride on the first chunk this event produces, with those held before it
        entries = list(event.logprobs) if self.logprobs else []
        if not content and not calls:
            self._held.setdefault(event.index, []).extend(entries)
            return []
        entries[:0] = self._held.pop(event.index, ())
        out = []
        if content:
            out.append(self.delta(replace(event, text=content, logprobs=tuple(entries))))
            entries = []
        if self.legacy:   # (one call: a later one is not part of the answer)
            calls = [c for c in calls if c.index == 0]
        if calls:
            lp = ChatLogprobs.of(entries) if entries else None
            out.append(self._chunk([ChatChunkChoice(index=event.index, logprobs=lp, delta=self._calls_delta(calls))]))
        return out

    def _calls_delta(self, calls: list[CallDelta]) -> ChatDelta:
        if self.legacy:
            return ChatDelta(function_call=FunctionCallDelta(name=calls[0].name, arguments="".join(
                c.arguments for c in calls)))
        return ChatDelta(tool_calls=[ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                                                   function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                                     for c in calls])

    def tail(self, event: Finished, finished: list[Finished]) -> list[dict[str, Any]]:
        parser = self._parser(event.index)
        if parser is None:
            return super().tail(event, finished)
        head = self._parsed(TextDelta("", (), index=event.index), *parser.finish())
        if held := self._held.pop(event.index, None):   # tokens whose text was not content
            head.append(self._chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(),
                                                     logprobs=ChatLogprobs.of(held))]))
        if parser.calls and event.finish_reason == "stop":
            event = replace(event, finish_reason=self._called)
        return head + super().tail(event, finished)

    @property
    def _called(self) -> str:
        """The finish reason of an answer that made calls."""
        return "function_call" if self.legacy else "tool_calls"

    def _message(self, c: _Choice) -> tuple[ChatMessageOut, str]:
        message, reason = ChatMessageOut(content=c.text), c.finished.finish_reason if c.finished else "stop"
        if self.tool_names:
            content, calls, _ = split_tool_calls(c.text, self.tool_names)
            if calls and self.legacy:
                message = ChatMessageOut(content=content or None, function_call=FunctionCallOut(
                    name=calls[0].name, arguments=calls[0].arguments))
            elif calls:
                message = ChatMessageOut(content=content or None, tool_calls=[
                    ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                    for t in calls])
            if calls:
                reason = self._called if reason == "stop" else reason
        return message, reason

    def _chunk(self, choices: list[ChatChunkChoice], **extra: Any) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
        return chunk.model_dump(mode="json")

    def head(self) -> list[dict[str, Any]]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def delta(self, event: TextDelta) -> dict[str, Any]:
        lp = ChatLogprobs.of(event.logprobs) if self.logprobs else None
        return self._chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(content=event.text), logprobs=lp)])

    def finish(self, event: Finished, timings: TimingsJSON | None) -> dict[str, Any]:
        return self._chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(),
                                            finish_reason=event.finish_reason)], timings=timings)

    def usage_chunk(self, usage: UsageInfo, timings: TimingsJSON) -> dict[str, Any]:
        return self._chunk([], usage=usage, timings=timings)

    def full_response(self, choices: list[_Choice]) -> ChatCompletionResponse:
        _, usage, timings = self._parts(choices)
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(index=i, message=message,
                                logprobs=ChatLogprobs.of(c.logprobs) if self.logprobs else None,
                                finish_reason=reason)
                     for i, c in enumerate(choices) for message, reason in [self._message(c)]],
            usage=usage,
            timings=timings,
        )


class _TextChunks(_Chunks):
    prefix = "cmpl-"

    def __init__(self, model: str, include_usage: bool = False) -> None:
        super().__init__(model, include_usage)
        self._offsets: dict[int, int] = {}   # per choice: characters streamed so far

    def _chunk(self, choices: list[CompletionChoice], **extra: Any) -> dict[str, Any]:
        chunk = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
        return chunk.model_dump(mode="json")

    def delta(self, event: TextDelta) -> dict[str, Any]:
        lp = None
        if self.logprobs:
            lp = CompletionLogprobs.of(event.logprobs, self._offsets.get(event.index, 0))
        self._offsets[event.index] = self._offsets.get(event.index, 0) + len(event.text)
        return self._chunk([CompletionChoice(index=event.index, text=event.text, logprobs=lp)])

    def finish(self, event: Finished, timings: TimingsJSON | None) -> dict[str, Any]:
        return self._chunk([CompletionChoice(index=event.index, text="", finish_reason=event.finish_reason)],
                           timings=timings)

    def usage_chunk(self, usage: UsageInfo, timings: TimingsJSON) -> dict[str, Any]:
        return self._chunk([], usage=usage, timings=timings)

    def full_response(self, choices: list[_Choice]) -> CompletionResponse:
        _, usage, timings = self._parts(choices)
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(index=i, text=c.text,
                                      logprobs=CompletionLogprobs.of(c.logprobs) if self.logprobs else None,
                                      finish_reason=c.finished.finish_reason if c.finished else "stop")
                     for i, c in enumerate(choices)],
            usage=usage,
            timings=timings,
        )


class _ResponsesChunks(_Chunks):
    """The Responses API's objects and typed events (:class:`~meshnode.serve.responses_api.ResponseEvents`);
    with ``tool_names`` the answer is read for tool calls as a chat answer is, each call a
    ``function_call`` item."""

    prefix = "resp_"
    done_marker = False

    def __init__(self, body: ResponsesRequest, tool_names: list[str] | None, store: ResponseStore | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        super().__init__(body.model)
        self.events = ResponseEvents(body, body.model, self.id)
        self.tool_names = tool_names
        self._parser = ToolCallParser(tool_names) if tool_names else None
        # with tools: the logprobs of tokens whose text the parser holds back
        self._held: list[TokenLogprob] = []
        # where the answer is kept (None: store false), after the conversation it follows
        self._store = store
        self._history = history or []

    def _keep(self, response: dict[str, Any]) -> None:
        if self._store is not None:
            self._store.put(self.id, [*self._history, self.events.assistant_message()], response)

    def encode(self, chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk["type"], chunk)

    def head(self) -> list[dict[str, Any]]:
        return self.events.start()

    def deltas(self, event: TextDelta) -> list[dict[str, Any]]:
        if self._parser is None:
            return self.events.text(event.text, event.logprobs if self.logprobs else ()) \
                if event.text or event.logprobs else []
        if self.logprobs:
            self._held += event.logprobs
        return self._emit(*self._parser.feed(event.text))

    def _emit(self, content: str, calls: list[CallDelta]) -> list[dict[str, Any]]:
        # The text held back rides on the content that comes out of it; what went into a
        # call (the parser gives content first) has no logprobs in this API: text only.
        out = self.events.text(content, tuple(self._held)) if content else []
        if content or calls:
            self._held = []
        for c in calls:
            out += self.events.call(c)
        return out

    def tail(self, event: Finished, finished: list[Finished]) -> list[dict[str, Any]]:
        out = []
        if self._parser is not None:
            out = self._emit(*self._parser.finish())
            self.events.set_calls(self._parser.calls)
        out += self.events.finish(_responses_usage(finished), _incomplete(event))
        self._keep(out[-1]["response"])
        return out

    def full_response(self, choices: list[_Choice]) -> ResponseObject:
        c = choices[0]
        lp = c.logprobs if self.logprobs else None
        finished = [x.finished for x in choices if x.finished is not None]
        reason = _incomplete(finished[0]) if finished else None
        if reason and self._parser is not None:
            self._replay(c.text, lp or [])
        else:
            content, calls, at = split_tool_calls(c.text, self.tool_names) if self.tool_names else (c.text, [], 0)
            if not calls:   # (as chat's answer: a text that only looks like a call is the text)
                content = c.text
            self.events.set_calls(calls)
            self.events.set_text(content, _text_logprobs(lp, content) if lp and self.tool_names else lp, at)
        response = self.events.response("incomplete" if reason else "completed", _responses_usage(finished), reason)
        self._keep(response)
        return ResponseObject.model_validate(response)


    def _replay(self, text: str, logprobs: list[TokenLogprob]) -> None:
        """A whole answer cut short at max_output_tokens, read as its stream was: a call
        the stream had announced when the answer stopped is an ``incomplete``
        function_call item with the arguments written so far, here as there (read whole,
        such a call is no call and its text would be the message)."""
        content, calls = self._parser.feed(text)
        more, rest = self._parser.finish()
        lp = tuple(_text_logprobs(logprobs, content + more))
        # (the items in the stream's order: a text after the calls opens the message there)
        if content:
            self.events.text(content + more, lp)
        for d in calls:
            self.events.call(d)
        if more and not content:
            self.events.text(more, lp)
        for d in rest:
            self.events.call(d)
        self.events.set_calls(self._parser.calls)


def _text_logprobs(entries: list[TokenLogprob], content: str) -> list[TokenLogprob]:
    """The entries of the tokens that make up ``content``, an answer's text read for tool
    calls: its leading tokens while their text begins ``content`` (a call's tokens have
    no logprobs in the Responses API)."""
    out, text = [], ""
    for e in entries:
        text += e.token
        if not content.startswith(text):
            break
        out.append(e)
    return out


def _incomplete(event: Finished) -> str | None:
    """Why a Responses answer is incomplete (None: it is complete)."""
    return "max_output_tokens" if event.finish_reason == "length" else None


def _responses_usage(finished: list[Finished]) -> dict[str, Any]:
    u = _total_usage(finished)
    return usage_object(u.prompt_tokens, u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0,
                        u.completion_tokens)


class _LlamaCppChunks(_Chunks):
    """llama.cpp server's ``/completion`` and ``/infill`` shape: ``{"content", "stop"}``
    objects; its stream has no ``[DONE]``."""

    prefix = "llamacpp-"
    done_marker = False

    def _obj(self, content: str, stop: bool, **extra: Any) -> InfillResponse:
        return InfillResponse(content=content, stop=stop, model=self.model, **extra)

    def _probs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """llama.cpp's ``completion_probabilities`` (with ``n_probs``) of ``entries``."""
        if not self.logprobs:
            return {}
        return {"completion_probabilities": [
            {"id": e.id, "token": e.token, "bytes": list(e.bytes), "logprob": e.logprob,
             "top_logprobs": [{"id": t.id, "token": t.token, "bytes": list(t.bytes), "logprob": t.logprob}
                              for t in e.top]} for e in entries]}

    def delta(self, event: TextDelta) -> dict[str, Any]:
        return self._obj(event.text, False, **self._probs(event.logprobs)).model_dump(mode="json")

    def finish(self, event: Finished, timings: TimingsJSON | None) -> dict[str, Any]:
        return self._obj("", True, tokens_predicted=event.usage.completion_tokens,
                         tokens_evaluated=event.usage.prompt_tokens,
                         stop_type="limit" if event.finish_reason == "length" else "eos",
                         timings=timings or event.timings.to_json()).model_dump(mode="json")

    def full_response(self, choices: list[_Choice]) -> InfillResponse:
        c = choices[0]
        f = c.finished
        assert f is not None
        return self._obj(c.text, True, tokens_predicted=f.usage.completion_tokens,
                         tokens_evaluated=f.usage.prompt_tokens,
                         stop_type="limit" if f.finish_reason == "length" else "eos",
                         timings=f.timings.to_json(), **self._probs(c.logprobs))

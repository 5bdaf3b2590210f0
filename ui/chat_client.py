"""Streaming client for the node's local OpenAI endpoint (used by the Chat screen).

``stream_chat`` POSTs ``{base_url}/chat/completions`` with ``stream: true`` and yields
:class:`ChatDelta` for each piece of text, then exactly one :class:`ChatFinished` or
:class:`ChatFailed`. It never raises for HTTP, network or protocol trouble: those become
a ``ChatFailed`` whose message is fit to show the user (the server's OpenAI error
message when it sent one). Cancelling the consumer closes the connection.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class ChatDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ChatFinished:
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class ChatFailed:
    message: str


ChatChunk = ChatDelta | ChatFinished | ChatFailed


def error_message(body: bytes | str, status: int | None = None) -> str:
    """The ``error.message`` of an OpenAI error body, else a short description."""
    prefix = f"HTTP {status}: " if status is not None else ""
    try:
        obj = json.loads(body)
    except (ValueError, TypeError):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
        text = text.strip()
        return prefix + (text[:200] if text else "no details")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return prefix + str(err["message"])
        if isinstance(err, str):
            return prefix + err
        if "detail" in obj:  # FastAPI's default error shape
            return prefix + str(obj["detail"])
    return prefix + "no details"


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    messages: Sequence[dict[str, str]],
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
) -> AsyncIterator[ChatChunk]:
    url = base_url.rstrip("/") + "/chat/completions"
    body: dict[str, object] = {"model": model, "messages": list(messages), "stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    finish: str | None = None
    try:
        async with client.stream(
            "POST", url, json=body, headers={"Accept": "text/event-stream"}
        ) as resp:
            if resp.status_code >= 400:
                yield ChatFailed(error_message(await resp.aread(), resp.status_code))
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (keep-alives), event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    yield ChatFinished(finish)
                    return
                try:
                    obj = json.loads(payload)
                except ValueError:
                    yield ChatFailed("the server sent a malformed stream chunk")
                    return
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:  # in-band error after the stream started
                    yield ChatFailed(error_message(payload))
                    return
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content")
                    if text:
                        yield ChatDelta(text)
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
            yield ChatFinished(finish)  # stream closed without [DONE]: keep what came
    except httpx.TimeoutException:
        yield ChatFailed(f"timed out talking to {url}")
    except httpx.HTTPError as exc:
        yield ChatFailed(f"cannot reach {url}: {exc or type(exc).__name__}")

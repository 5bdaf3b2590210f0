"""The door of the HTTP endpoint: what a request must pass before any route sees it.

Theory of operation. The endpoint listens on the machine that runs the user's browser
and, when bound off loopback, on a LAN with strangers on it. Three kinds of caller are
hostile (docs/security.md): a web page in the user's browser, which can send requests
to 127.0.0.1 but is bound by the browser's rules; a page on a domain that an attacker
re-points at 127.0.0.1 (DNS rebinding), which then reads answers as if same-origin; and
a stranger on the LAN. :class:`HttpGuard`, a plain ASGI middleware outside every route,
checks in this order, cheapest first, and answers a refusal in OpenAI's error shape:

1. **Host** (403): a loopback name, an IP literal (a rebound *name* is what rebinding
   needs; an address cannot be re-pointed), the bound host, or a name the user allowed
   (``--allow-host``; ``*`` turns the check off).
2. **Origin** (403): a request a browser marks as coming from another page is refused
   unless ``--cors-origin`` names that origin (same-origin requests pass). CORS headers
   are only sent for those origins (Starlette's ``CORSMiddleware``, inside this one).
3. **API key** (401): with a key set, every route but ``/health`` needs
   ``Authorization: Bearer <key>`` (compared in constant time); ``/status`` stays open to
   loopback clients so ``meshnode status`` works on the node's own machine.
4. **Content type** (415): a POST body must be ``application/json``. A browser sends
   ``text/plain``, form and multipart bodies cross-site without a preflight, so this is
   what keeps a web page from POSTing to the node (CSRF); ``application/json`` needs a
   preflight the node refuses unless the origin is allowed.
5. **Admission** (429 + ``Retry-After``): at most ``max_requests`` POSTs in flight (their
   bodies, queue places and streams); more are refused before their body is read, so
   memory is bounded by ``max_requests * max_body``.
6. **Body** (413, 408): a declared ``Content-Length`` over ``max_body`` is refused before
   reading; a chunked body is counted while it arrives and refused the moment it passes
   the cap; the whole body must arrive within ``body_timeout_s``. The body then reaches
   the route from memory, so routes never see more than the cap.

Which hosts count as loopback, and whether a bind address needs a key, is
:func:`is_loopback_host` / :func:`check_binding` (the node refuses to start bound off
loopback without a key).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnode.errors import MeshnodeError
from meshnode.serve.errors import (
    ForbiddenRequestError,
    InvalidRequestError,
    MissingApiKeyError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServeError,
    ServerBusyError,
    UnsupportedMediaTypeError,
    error_body,
    error_spec,
)

log = logging.getLogger("meshnode.serve.http")

__all__ = [
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_REQUESTS",
    "HttpGuard",
    "HttpSecurity",
    "check_binding",
    "error_headers",
    "is_loopback_host",
]

# A chat request is text: 4 MiB is a million tokens of English, far past any context a
# node serves, and small enough that max_requests bodies in memory at once stay modest.
DEFAULT_MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_REQUESTS = 32
# Requests a model server lets wait for a slot beyond --parallel (serve/model_server.py;
# here so the CLI reads it without importing the engine).
DEFAULT_MAX_QUEUE = 16
BODY_TIMEOUT_S = 30.0
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost", "ip6-loopback"})
OPEN_PATHS = frozenset({"/health"})               # liveness probe: never needs the key
LOOPBACK_OPEN_PATHS = frozenset({"/status"})      # `meshnode status` on the node's machine
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True, slots=True)
class HttpSecurity:
    """The endpoint's protections (CLI flags over ``MESHNODE_API_KEY`` over ``[http]``)."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()   # more Host names to answer to; "*" = any
    cors_origins: tuple[str, ...] = ()    # origins whose pages may call the API; "*" = any
    max_body: int = DEFAULT_MAX_BODY
    max_requests: int = DEFAULT_MAX_REQUESTS
    body_timeout_s: float = BODY_TIMEOUT_S
    bound_host: str = "127.0.0.1"


def is_loopback_host(host: str) -> bool:
    """True for a loopback address or name; the wildcard ("" / 0.0.0.0 / ::) is not."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, api_key: str | None) -> None:
    """Refuse to serve a non-loopback address without an API key (MeshnodeError)."""
    if api_key or is_loopback_host(host):
        return
    shown = host or "all addresses"
    raise MeshnodeError(
        f"the HTTP endpoint on {shown} would be reachable from the network, so it needs an API "
        "key: pass --api-key KEY, set MESHNODE_API_KEY, or set [http] api_key in config.toml "
        "(clients then send 'Authorization: Bearer KEY')")


def error_headers(exc: BaseException) -> dict[str, str]:
    """Headers a refusal carries: when to retry (429), how to authenticate (401)."""
    if isinstance(exc, ServerBusyError):
        return {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, MissingApiKeyError):
        return {"WWW-Authenticate": "Bearer"}
    return {}


def _host_name(host_header: str) -> str:
    """'example.com:8642' -> 'example.com'; '[::1]:8642' -> '::1'."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Refused(Exception):
    def __init__(self, error: ServeError) -> None:
        self.error = error


class HttpGuard:
    """ASGI middleware enforcing :class:`HttpSecurity` (see the module docstring)."""

    def __init__(self, app: ASGIApp, security: HttpSecurity) -> None:
        self.app = app
        self.security = security
        names = {n.lower() for n in security.allowed_hosts} | LOOPBACK_NAMES
        if security.bound_host:
            names.add(_host_name(security.bound_host))
        self._hosts = frozenset(names)
        self._any_host = "*" in security.allowed_hosts
        self._origins = frozenset(o.rstrip("/").lower() for o in security.cors_origins)
        self._key = security.api_key.encode() if security.api_key else None
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_headers(scope)
        except _Refused as r:
            await _refuse(r.error, scope, receive, send)
            return
        if scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.security.max_requests:
            await _refuse(ServerBusyError(
                f"The server is busy ({self.in_flight} requests in flight); retry shortly."), scope, receive, send)
            return
        self.in_flight += 1
        try:
            try:
                body = await self._read_body(scope, receive)
            except _Refused as r:
                await _refuse(r.error, scope, receive, send)
                return
            await self.app(scope, replay_body(body, receive), send)
        finally:
            self.in_flight -= 1

    # ---- checks ---------------------------------------------------------------------

    def _check_headers(self, scope: Scope) -> None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if host is not None and not self._any_host:
            name = _host_name(host)
            if name not in self._hosts and not _is_ip(name):
                log.info("refused a request for Host %r (not a name this node answers to)", host[:100])
                raise _Refused(ForbiddenRequestError(
                    f"This node does not answer to the host name {host[:100]!r}. Use its address, "
                    "or allow the name with --allow-host."))
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            log.info("refused a request from origin %r", origin[:100])
            raise _Refused(ForbiddenRequestError(
                f"Requests from web pages of {origin[:100]!r} are not allowed. "
                "Allow the origin with --cors-origin."))
        path = scope["path"]
        # a CORS preflight carries no credentials by design; it only ever reaches here for
        # an allowed origin (CORSMiddleware, outside this guard, answers it)
        if self._key is not None and scope["method"] != "OPTIONS" and path not in OPEN_PATHS and not (
                path in LOOPBACK_OPEN_PATHS and _client_is_loopback(scope)):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                raise _Refused(MissingApiKeyError(
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>' with the key "
                    "the node was started with." if auth else
                    "This node needs an API key: send 'Authorization: Bearer <key>'."))
        if scope["method"] in BODY_METHODS:
            ctype = headers.get("content-type", "")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                raise _Refused(UnsupportedMediaTypeError(
                    f"The request body must be JSON sent as 'Content-Type: application/json' "
                    f"(got {ctype[:100]!r})."))

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        o = origin.rstrip("/").lower()
        if "*" in self._origins or o in self._origins:
            return True
        # same-origin: a page served from this very host and port
        return host is not None and o.split("://", 1)[-1] == host.strip().lower()

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        cap = self.security.max_body
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _Refused(InvalidRequestError(None, "Invalid Content-Length header."))
            if int(declared) > cap:
                raise _Refused(_too_large(cap))
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.security.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise _Refused(_too_large(cap))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise _Refused(RequestTimeoutError(
                f"The request body did not arrive within {self.security.body_timeout_s:g} s.")) from None
        return b"".join(chunks)


def _too_large(cap: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"The request body is larger than this node accepts ({cap} bytes; "
                                "see --max-body).")


def _client_is_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    return bool(client) and is_loopback_host(str(client[0]))


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the already-read body over once, then the real one (whose next
    message is ``http.disconnect``, which the routes watch for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(exc: ServeError, scope: Scope, receive: Receive, send: Send) -> None:
    spec = error_spec(exc)
    assert spec is not None
    response: Any = JSONResponse(error_body(exc), status_code=spec.status, headers=error_headers(exc))
    await response(scope, receive, send)

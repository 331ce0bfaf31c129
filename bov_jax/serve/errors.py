"""OpenAI's error shape for every failure: {"error": {"message", "type", "param", "code"}}.

`install` puts two things on the application:

- exception handlers: a request that fails validation or a `BadRequest` is a 400 naming the
  field; an unknown path a 404, a known path with another method a 405 (Starlette's
  HTTPExceptions, which FastAPI would answer as {"detail"});
- `BodyChecks`, an ASGI middleware in front of the routes. It reads a request's body before
  any route does and answers, without the route running: 503 while the server drains
  (`app.state.refusing` holds why), 413 past `app.state.max_body_bytes` (from Content-Length
  before reading a byte, else as the body arrives), 415 for a body whose Content-Type is not
  JSON, 400 for a body that is not UTF-8 or whose JSON strings hold a lone surrogate (text
  no tokenizer can encode: "\\ud800"), naming the field. Any exception a route raises
  before its answer starts is a 500 in the same shape; the traceback goes to the log, and
  the client's keep-alive connection stays open (uvicorn closes a connection whose
  application raised).

The checks of a large body (UTF-8, JSON for surrogates) run on a worker thread: the event
loop, which every stream and /health share, never spends more than a slice of a large body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from bov_jax.serve.engine_loop import ServerStopping

log = logging.getLogger("bov_jax.serve")
MAX_BODY_BYTES = 1 << 20  # the default body-size limit (`--max_body_mib`)
DISCARD_BODIES = 64  # a refused body is read (and dropped) up to this many limits
ON_THREAD_BYTES = 1 << 16  # bodies larger than this are checked on a worker thread
WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None, kind: str) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse(error_body(message, param, kind), status_code=status)


def field_of(message: str) -> str | None:
    """The field a ValueError's message starts with ("max_tokens=...", "prompt: ...")."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.isidentifier() else None


def lone_surrogate(value: object, path: str = "") -> tuple[str, int, str] | None:
    """(field path, character index, the surrogate as an escape) of the first string in a
    parsed JSON value holding a lone surrogate; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return path or "body", err.start, f"\\u{ord(value[err.start]):04x}"
        return None
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), v) for key, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = lone_surrogate(item, where)
        if found:
            return found
    return None


def body_problem(body: bytes) -> tuple[str, str | None] | None:
    """(message, param) of a body that is not UTF-8 or holds a lone surrogate; else None.
    Malformed JSON is left to the route's validation (its own 400)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"the body is not valid UTF-8 (byte {err.start}: {body[err.start]:#04x})", None
    if not SURROGATE_ESCAPE.search(body):
        return None
    try:
        found = lone_surrogate(json.loads(body))
    except ValueError:
        return None
    if found is None:
        return None
    where, index, escape = found
    param = re.split(r"[.\[]", where, maxsplit=1)[0]
    message = f"{where}: a lone surrogate ({escape}) at character {index}; text must be Unicode"
    return message, param


def media_type(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return None


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyChecks:
    """The checks of the module doc, in front of the routes (an ASGI middleware)."""

    def __init__(self, app: ASGIApp, settings: object):
        self.app, self.settings = app, settings  # settings: the FastAPI app's state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.checked(scope, receive, tracked)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                answer = error_response(500, "the server failed; see its log", None, "server_error")
                await answer(scope, receive, send)

    async def checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusing = getattr(self.settings, "refusing", None)
        if refusing and scope["path"].startswith("/v1/"):
            await error_response(503, refusing, None, "server_error")(scope, receive, send)
            return
        if scope["method"] not in WITH_BODY:
            await self.app(scope, receive, send)
            return
        limit = self.settings.max_body_bytes
        length = content_length(scope)
        if length is not None and length > limit:
            await self.too_large(length, limit, scope, receive, send, True)
            return
        kind = media_type(scope)
        if kind is not None and kind != "application/json" and not kind.endswith("+json"):
            message = f"Content-Type {kind!r}; send the body as application/json"
            await error_response(415, message, None, "invalid_request_error")(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk, more = message.get("body", b""), message.get("more_body", False)
            size += len(chunk)
            if size > limit:
                await self.too_large(size, limit, scope, receive, send, more)
                return
            chunks.append(chunk)
        body = b"".join(chunks)
        if len(body) > ON_THREAD_BYTES:
            problem = await asyncio.to_thread(body_problem, body)
        else:
            problem = body_problem(body)
        if problem is not None:
            await error_response(400, *problem, "invalid_request_error")(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    async def too_large(
        size: int, limit: int, scope: Scope, receive: Receive, send: Send, more: bool
    ) -> None:
        """413, after reading what the client still sends (up to DISCARD_BODIES limits):
        a client that is refused mid-upload would see a broken pipe, not the answer."""
        discarded = 0
        while more and discarded < DISCARD_BODIES * limit:
            message = await receive()
            discarded += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        message = f"the body has {size:,} bytes or more; this server takes at most {limit:,}"
        await error_response(413, message, None, "invalid_request_error")(scope, receive, send)


def install(app: FastAPI, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Every failure in OpenAI's error shape, and `BodyChecks` in front of the routes."""
    app.state.max_body_bytes = max_body_bytes
    app.state.refusing = None
    app.add_middleware(BodyChecks, settings=app.state)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        if first["type"] == "json_invalid":
            return error_response(400, "the body is not valid JSON", None, "invalid_request_error")
        if first["type"] == "model_attributes_type":
            return error_response(
                400, "the body must be a JSON object", None, "invalid_request_error"
            )
        param = where[0] if where else None
        message = f"{'.'.join(where) or 'body'}: {first['msg']}"
        return error_response(400, message, param, "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def refused(_: Request, err: BadRequest) -> JSONResponse:
        return error_response(400, str(err), err.param, "invalid_request_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"no route {request.url.path}; the API is under /v1 (GET /v1/models)"
        elif err.status_code == 405:
            allowed = err.headers.get("Allow", "") if err.headers else ""
            message = f"{request.method} {request.url.path} is not allowed; use {allowed}"
        else:
            message = str(err.detail)
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        answer = error_response(err.status_code, message, None, kind)
        answer.headers.update(err.headers or {})
        return answer


def failure(err: Exception) -> tuple[int, str]:
    """(status, message) of a request a failure cut: 503 when the server is stopping (a
    drain's end), else 500 (the engine failed)."""
    if isinstance(err, ServerStopping):
        return 503, str(err)
    return 500, f"the engine failed: {err}"


def stream_error(err: Exception) -> dict:
    """The error event that ends a stream a failure cut (`failure`)."""
    status, message = failure(err)
    return {"message": message, "type": "server_error", "code": status}

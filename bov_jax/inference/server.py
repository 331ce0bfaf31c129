"""An OpenAI-compatible HTTP server over the engine: FastAPI routes, uvicorn, one engine thread.

    POST /v1/completions   OpenAI's completions (stream: true as server-sent events)
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"} while the engine thread runs
    GET  /metrics          Prometheus text: requests, pages, tokens/s, preemptions

A request is validated at the edge (pydantic, strict types, unknown fields refused) and
against the engine (`Engine.check`: prompt length, max_tokens, ranges); any failure is a
400 with one JSON error naming the field, as OpenAI's API answers. Accepted requests go to
the engine through `EngineLoop`, whose thread steps the engine while it has work and hands
each request's outputs to the asyncio queue of the handler waiting for them. A client that
disconnects (stream or not) aborts its request: its pages are freed at the next step. A
failure inside a step fails the requests in flight (500), resets the engine's cache and
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from bov_jax.inference.engine import Engine, Output
from bov_jax.inference.sampling import SamplingParams
from bov_jax.inference.texts import Tokenizer

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting handler checks its client is still there
IDLE_WAIT_S = 0.05  # the engine thread's wait for work


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request this server takes (top_k and ignore_eos
    as vLLM's extensions); any other field is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: int | None = None
    n: int = 1
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    user: str | None = None

    def sampling(self) -> SamplingParams:
        """The engine's parameters; ValueError naming a field this server cannot honour."""
        unsupported = [
            ("n", self.n != 1, "1 (one completion a request)"),
            ("echo", self.echo, "false"),
            ("presence_penalty", self.presence_penalty != 0, "0"),
            ("frequency_penalty", self.frequency_penalty != 0, "0"),
        ]
        for name, bad, expected in unsupported:
            if bad:
                raise ValueError(f"{name}={getattr(self, name)!r}; this server takes {expected}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=self.temperature,
            top_k=max(self.top_k, 0) if self.top_k != -1 else 0,
            top_p=self.top_p,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop=stop,
            logprobs=self.logprobs,
            ignore_eos=self.ignore_eos,
        )


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    body = {"message": message, "type": kind, "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


def field_of(message: str) -> str | None:
    """The field a ValueError's message starts with ("max_tokens=...", "prompt: ...")."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head.isidentifier() else None


class EngineLoop:
    """The engine on its own thread; outputs routed to the submitting handlers' queues."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request (from a handler on the event loop); its outputs arrive in the
        returned queue, the last with a finish reason. ValueError if the engine refuses it."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._routes[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add(request_id, prompt, params)
        except ValueError:
            with self._lock:
                del self._routes[request_id]
            raise
        self._wake.set()
        return queue

    def cancel(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _deliver(self, output: Output | BaseException, request_id: str) -> None:
        with self._lock:
            route = self._routes.get(request_id)
            done = isinstance(output, BaseException) or output.finish_reason is not None
            if done:
                self._routes.pop(request_id, None)
        if route is not None:
            loop, queue = route
            loop.call_soon_threadsafe(queue.put_nowait, output)

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a failed step must not end the server
                log.exception("engine step failed; failing the requests in flight")
                self.failures += 1
                for request_id in self.engine.reset():
                    self._deliver(err, request_id)
                continue
            for output in outputs:
                self._deliver(output, output.request_id)


def prometheus(stats: dict[str, float], prefix: str = "bov") -> str:
    """Stats as Prometheus text exposition (gauges, and counters for the *_total names)."""
    meaning = {
        "running": ("requests_running", "gauge", "Requests prefilling or decoding."),
        "waiting": ("requests_waiting", "gauge", "Requests queued for pages or a slot."),
        "pages_used": ("pages_used", "gauge", "Cache pages held by requests (all groups)."),
        "pages_free": ("pages_free", "gauge", "Cache pages free (all groups)."),
        "tokens_per_second": ("tokens_per_second", "gauge", "Generated tokens a second."),
        "generated_tokens": ("generated_tokens_total", "counter", "Tokens generated."),
        "preemptions": ("preemptions_total", "counter", "Sequences preempted for pages."),
        "aborted": ("requests_aborted_total", "counter", "Requests aborted (client gone)."),
        "steps": ("engine_steps_total", "counter", "Engine steps run."),
    }
    lines = []
    for key, (name, kind, help_text) in meaning.items():
        lines += [
            f"# HELP {prefix}_{name} {help_text}",
            f"# TYPE {prefix}_{name} {kind}",
            f"{prefix}_{name} {stats[key]:g}",
        ]
    return "\n".join(lines) + "\n"


def create_app(loop: EngineLoop, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    """The routes (module doc) over a started `EngineLoop`."""
    app = FastAPI(title="bov_jax", docs_url=None, redoc_url=None)

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

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(loop.engine.stats()), media_type="text/plain")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "bov_jax"}
        return JSONResponse({"object": "list", "data": [card]})

    def accept(body: CompletionRequest) -> tuple[str, asyncio.Queue, list[int]]:
        if body.model != model_name:
            raise BadRequest(f"model={body.model!r}; this server serves {model_name!r}", "model")
        try:
            params = body.sampling()
            if isinstance(body.prompt, str):
                prompt = [tokenizer.bos_id, *tokenizer.encode_one(body.prompt)]
            else:
                prompt = list(body.prompt)
            request_id = f"cmpl-{uuid.uuid4().hex}"
            return request_id, loop.submit(request_id, prompt, params), prompt
        except ValueError as err:
            raise BadRequest(str(err), field_of(str(err))) from err

    def choice(out: Output, offset: int) -> dict:
        logprobs = None
        if out.logprobs:
            pieces = [tokenizer.decode([e.token]) for e in out.logprobs]
            offsets = [offset + sum(map(len, pieces[:i])) for i in range(len(pieces))]
            logprobs = {
                "tokens": pieces,
                "token_logprobs": [e.logprob for e in out.logprobs],
                "top_logprobs": [
                    {tokenizer.decode([t]): lp for t, lp in e.top} for e in out.logprobs
                ],
                "text_offset": offsets,
            }
        return {
            "text": out.text,
            "index": 0,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }

    async def outputs(request: Request, request_id: str, queue: asyncio.Queue) -> AsyncIterator:
        """The request's outputs until the last; aborts it if the client goes away."""
        finished = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(queue.get(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if isinstance(out, BaseException):
                    raise out
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                loop.cancel(request_id)

    def usage(out: Output) -> dict:
        total = out.prompt_tokens + out.completion_tokens
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": total,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        request_id, queue, _ = accept(body)
        created = int(time.time())
        head = {"id": request_id, "object": "text_completion", "created": created}
        head["model"] = model_name
        if body.stream:

            async def events() -> AsyncIterator[str]:
                offset = 0
                try:
                    async for out in outputs(request, request_id, queue):
                        if not (out.text or out.logprobs or out.finish_reason):
                            continue
                        chunk = {**head, "choices": [choice(out, offset)]}
                        if out.finish_reason is not None:
                            chunk["usage"] = usage(out)
                        offset += len(out.text)
                        yield f"data: {json.dumps(chunk)}\n\n"
                except Exception as err:
                    body = {"message": f"the engine failed: {err}", "type": "server_error"}
                    yield f"data: {json.dumps({'error': body})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        parts: list[Output] = []
        try:
            async for out in outputs(request, request_id, queue):
                parts.append(out)
        except Exception as err:
            return error_response(500, f"the engine failed: {err}", None, "server_error")
        if not parts or parts[-1].finish_reason is None:  # the client left
            return error_response(499, "client closed the request", None, "invalid_request_error")
        merged = Output(
            request_id,
            tuple(t for p in parts for t in p.token_ids),
            "".join(p.text for p in parts),
            tuple(e for p in parts for e in p.logprobs),
            parts[-1].finish_reason,
            parts[-1].prompt_tokens,
            parts[-1].completion_tokens,
        )
        return JSONResponse({**head, "choices": [choice(merged, 0)], "usage": usage(merged)})

    return app


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def running_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[str]:
    """Serve in this process on a background thread; yields the base URL, and stops the
    server and the engine thread on exit (tests and the serving benchmark)."""
    loop = EngineLoop(engine)
    loop.start()
    app = create_app(loop, tokenizer, model_name)
    sock = bound_socket(host, port)
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server thread ended before it started")
            time.sleep(0.01)
        name, bound = sock.getsockname()[:2]
        yield f"http://{'[' + name + ']' if ':' in name else name}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        loop.stop()


def serve(engine: Engine, tokenizer: Tokenizer, model_name: str, host: str, port: int) -> None:
    """Serve until interrupted (`python -m bov_jax.serve`)."""
    loop = EngineLoop(engine)
    loop.start()
    try:
        app = create_app(loop, tokenizer, model_name)
        uvicorn.run(app, host=host, port=port, log_level="info", lifespan="off")
    finally:
        loop.stop()

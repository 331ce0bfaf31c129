"""The FastAPI application: the routes over a started `EngineLoop`.

    POST /v1/completions   OpenAI's completions (stream: true as server-sent events)
    GET  /v1/models        the one model served
    GET  /health           {"status": "ok"} while the engine thread runs
    GET  /metrics          Prometheus text

A request is validated at the edge (pydantic, strict types, unknown fields refused) and
against the engine (`Engine.check`: prompt length, max_tokens, ranges); any failure is a
400 with one JSON error naming the field, as OpenAI's API answers. A client that
disconnects (stream or not) aborts its request: its pages are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from bov_jax.inference.engine import Output
from bov_jax.inference.texts import Tokenizer
from bov_jax.serve import errors
from bov_jax.serve.engine_loop import EngineLoop
from bov_jax.serve.errors import BadRequest, error_response, field_of
from bov_jax.serve.metrics import prometheus
from bov_jax.serve.protocol import CompletionRequest

POLL_S = 0.25  # how often a waiting handler checks its client is still there


def create_app(loop: EngineLoop, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    """The routes (module doc) over a started `EngineLoop`."""
    app = FastAPI(title="bov_jax", docs_url=None, redoc_url=None)

    errors.install(app)

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

"""The FastAPI application: the routes over a started `EngineLoop`.

    POST /v1/completions       OpenAI's completions as vLLM speaks them (`completions`)
    POST /v1/chat/completions  chat in nanochat's conversation format (`chat`)
    GET  /v1/models            the one model served, with max_model_len; /v1/models/{id}
    POST /tokenize, POST /detokenize, GET /tokenizer_info   as vLLM's (`tokens`)
    GET  /health               {"status": "ok"} once warm; 503 while warming up, draining or stopped
    GET  /metrics              Prometheus (`metrics`)

A request is validated at the edge (pydantic types, `protocol`'s policy for fields) and
against the engine (`Engine.check`: prompt length, max_tokens, ranges); any failure is a
400 with one JSON error naming the field, as OpenAI's API answers. A client that
disconnects (stream or not) aborts its requests: their pages are freed at the next step.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from bov_jax.inference.texts import Tokenizer
from bov_jax.interop.hf_tokenizer import CHAT_TEMPLATE
from bov_jax.serve import chat, completions, errors, tokens
from bov_jax.serve.engine_loop import EngineLoop
from bov_jax.serve.errors import BadRequest, field_of
from bov_jax.serve.fanout import Served
from bov_jax.serve.metrics import CONTENT_TYPE, Metrics
from bov_jax.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


def create_app(loop: EngineLoop, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    """The routes (module doc) over a started `EngineLoop`."""
    app = FastAPI(title="bov_jax", docs_url=None, redoc_url=None)
    engine = loop.engine
    served = Served(
        loop=loop,
        tokenizer=tokens.ServedTokenizer(tokenizer),
        model_name=model_name,
        max_model_len=engine.max_context,
        vocab_size=engine.spec.vocab_size,
        metrics=Metrics(engine.stats, model_name),
    )
    app.state.served = served
    errors.install(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    def card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "bov_jax",
            "root": model_name,
            "max_model_len": served.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> JSONResponse:
        if name != model_name:
            message = f"model {name!r} does not exist; this server serves {model_name!r}"
            return errors.error_response(404, message, "model", "not_found_error")
        return JSONResponse(card())

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create(body, request, served)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request, served)

    def answer(work, *args) -> JSONResponse:
        try:
            return JSONResponse(work(*args))
        except ValueError as err:
            raise BadRequest(str(err), field_of(str(err))) from err

    def render(messages, add_generation_prompt: bool, continue_final: bool) -> list[int]:
        return chat.render(served.tokenizer, messages, add_generation_prompt, continue_final)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        work = tokens.tokenize
        return await asyncio.to_thread(
            answer, work, body, served.tokenizer, served.max_model_len, render
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        work = tokens.detokenize
        return await asyncio.to_thread(answer, work, body, served.tokenizer, served.vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        info = tokens.tokenizer_info(served.tokenizer, served.max_model_len, CHAT_TEMPLATE)
        return JSONResponse(info)

    return app

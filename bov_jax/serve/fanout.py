"""A client request as engine requests, one per prompt and per sample (n): submitted
together, their outputs merged into one stream of (part, output) or collected whole, each
observed by the metrics; all of them aborted when the client goes away or one fails."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from bov_jax.inference.engine import Output, TokenLogprob
from bov_jax.inference.sampling import SamplingParams
from bov_jax.serve import errors
from bov_jax.serve.engine_loop import EngineLoop
from bov_jax.serve.metrics import Metrics, RequestTimer
from bov_jax.serve.tokens import ServedTokenizer

POLL_S = 0.25  # how often a waiting handler checks its client is still there


@dataclasses.dataclass(frozen=True)
class Served:
    """What every route shares."""

    loop: EngineLoop
    tokenizer: ServedTokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics


@dataclasses.dataclass(frozen=True)
class Part:
    """One engine request of a client request: choice `index` (prompt i, sample j: i * n + j)."""

    index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    request_id: str


def parts(prompts: Sequence[Sequence[int]], n: int, params: Sequence[SamplingParams]) -> list[Part]:
    """The engine requests of `prompts` (params: one each), n samples of each; sample j of a
    seeded request has seed + j, as vLLM's."""
    base = uuid.uuid4().hex
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        for j in range(n):
            seeded = p if p.seed is None else dataclasses.replace(p, seed=p.seed + j)
            out.append(Part(i * n + j, tuple(prompt), seeded, f"cmpl-{base}-{i * n + j}"))
    return out


def submit(served: Served, todo: Sequence[Part]) -> list[tuple[Part, asyncio.Queue, RequestTimer]]:
    """Queue every part in the engine (from a handler); ValueError, none left queued, if the
    engine refuses one."""
    arrived, queued = time.monotonic(), []
    try:
        for part in todo:
            queued.append(
                (part, served.loop.submit(part.request_id, list(part.prompt), part.params))
            )
    except ValueError:
        for part, _ in queued:
            served.loop.cancel(part.request_id)
        raise
    return [(p, q, served.metrics.request(len(p.prompt), arrived)) for p, q in queued]


async def _outputs(
    request: Request, loop: EngineLoop, request_id: str, queue: asyncio.Queue
) -> AsyncIterator[Output]:
    """One engine request's outputs until its last; aborted if the client goes away."""
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


async def merged(
    request: Request, served: Served, submitted: list[tuple[Part, asyncio.Queue, RequestTimer]]
) -> AsyncIterator[tuple[Part, Output]]:
    """Every part's outputs as they come; raises the engine's failure; ends early if the
    client left. Closing it aborts the parts still running."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(part: Part, queue: asyncio.Queue, timer: RequestTimer) -> None:
        try:
            async for out in _outputs(request, served.loop, part.request_id, queue):
                timer.observe(out)
                await inbox.put((part, out))
        except Exception as err:  # delivered to the handler, which answers 500
            await inbox.put((part, err))
        finally:
            await inbox.put((part, None))

    tasks = [asyncio.create_task(pump(*s)) for s in submitted]
    try:
        running = len(tasks)
        while running:
            part, item = await inbox.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield part, item
    finally:
        for task in tasks:
            task.cancel()


@dataclasses.dataclass
class Whole:
    """A part's outputs joined: its completion."""

    part: Part
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, out: Output) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


async def collected(
    request: Request, served: Served, submitted: list[tuple[Part, asyncio.Queue, RequestTimer]]
) -> list[Whole] | JSONResponse:
    """Every part's whole completion, by index; or the error answer: 499 if the client left
    first, 503 / 500 if a failure cut the request (`errors.failure`)."""
    wholes = {part.index: Whole(part) for part, _, _ in submitted}
    try:
        async for part, out in merged(request, served, submitted):
            wholes[part.index].add(out)
    except Exception as err:
        status, message = errors.failure(err)
        return errors.error_response(status, message, None, "server_error")
    if any(w.finish_reason is None for w in wholes.values()):
        return errors.error_response(
            499, "client closed the request", None, "invalid_request_error"
        )
    return [wholes[i] for i in sorted(wholes)]

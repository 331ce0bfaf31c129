"""POST /v1/completions as vLLM answers it.

A prompt is a string, a list of strings, token ids or a list of token-id lists; each gets n
choices (index i * n + j). Strings are encoded off the event loop, BOS first unless
add_special_tokens is false (`tokens`), after a bound on their token count from their byte
length refuses a prompt that cannot fit without encoding the whole of it.

echo: each choice's text starts with its prompt's (the string given, or the ids decoded),
and with logprobs the logprobs object covers prompt + completion, aligned: tokens,
token_logprobs (null for the first prompt token, which nothing predicts), top_logprobs
(the k likeliest and the token itself), text_offset. max_tokens 0 with echo scores the
prompt and decodes nothing; max_tokens null decodes up to the context's end.

stream: server-sent events, a chunk per engine output and choice, then `data: [DONE]`;
stream_options.include_usage adds a last chunk with no choices and the usage,
continuous_usage_stats puts each choice's usage so far in every chunk (vLLM's).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from bov_jax.inference.engine import Output, TokenLogprob
from bov_jax.serve import fanout
from bov_jax.serve.errors import BadRequest, field_of, stream_error
from bov_jax.serve.fanout import Part, Served
from bov_jax.serve.protocol import CompletionRequest, completion_logprobs
from bov_jax.serve.tokens import check_text


def prompt_ids(body: CompletionRequest, served: Served) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt (the text of token ids only for echo); ValueError
    naming prompt. Runs off the event loop."""
    prompt, tokenizer, context = body.prompt, served.tokenizer, served.max_model_len
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        for i, text in enumerate(texts):
            least = tokenizer.least_tokens(text) + body.add_special_tokens
            if least > context:
                raise ValueError(
                    f"prompt: prompt {i} has at least {least} tokens; the context holds {context}"
                )
            check_text(text, f"prompt: prompt {i}")
        ids = [tokenizer.encode(text, body.add_special_tokens) for text in texts]
        return ids, texts
    ids = [prompt] if prompt and isinstance(prompt[0], int) else [list(p) for p in prompt]
    if not ids or not all(ids):
        raise ValueError("prompt: expected at least one non-empty prompt")
    if any(not 0 <= t < served.vocab_size for p in ids for t in p):
        raise ValueError(f"prompt: token ids must lie in [0, {served.vocab_size})")
    return ids, [tokenizer.decode(p, specials=False) if body.echo else "" for p in ids]


def engine_parts(body: CompletionRequest, served: Served, ids: list[list[int]]) -> list[Part]:
    """The engine requests of a completions request; ValueError naming a field."""
    if body.max_tokens == 0 and not body.echo:
        raise ValueError("max_tokens=0; expected >= 1 (0 only with echo: score the prompt)")
    params = []
    for prompt in ids:
        room = max(served.max_model_len - len(prompt), 0)
        max_tokens = room if body.max_tokens is None else body.max_tokens
        scored = body.logprobs if body.echo else None
        params.append(body.sampling(max_tokens, body.logprobs, scored))
    return fanout.parts(ids, body.n, params)


class Choices:
    """The choices' JSON, built as outputs arrive (echo, logprobs offsets per choice)."""

    def __init__(self, body: CompletionRequest, served: Served, ids, texts):
        self.body, self.served, self.ids, self.texts = body, served, ids, texts
        self.offsets: dict[int, int] = {}  # characters of each choice's text sent

    def piece(self, token: int) -> str:
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token}"
        return self.served.tokenizer.piece(token)

    def choice(
        self,
        part: Part,
        text: str,
        tokens: list[int],
        entries: list[TokenLogprob],
        prompt_entries: list[TokenLogprob | None] | None,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> dict:
        """Choice `part.index`'s next text (the whole, or a stream's delta)."""
        body, i = self.body, part.index // self.body.n
        start = self.offsets.get(part.index)
        if start is None and body.echo:  # the first text of an echoing choice
            text, start = self.texts[i] + text, 0
            tokens = [*self.ids[i], *tokens]
            if body.logprobs is not None:
                entries = [*(prompt_entries or [None] * len(self.ids[i])), *entries]
        start = start or 0
        logprobs = None
        if body.logprobs is not None:
            pieces = [self.piece(t) for t in tokens]
            logprobs = completion_logprobs(pieces, entries, start, self.piece)
        self.offsets[part.index] = start + len(text)
        return {
            "index": part.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def create(body: CompletionRequest, request: Request, served: Served):
    """The route's body (module doc)."""
    try:
        body.refuse_unimplemented()
        if body.model != served.model_name:
            raise ValueError(f"model={body.model!r}; this server serves {served.model_name!r}")
        ids, texts = await asyncio.to_thread(prompt_ids, body, served)
        todo = engine_parts(body, served, ids)
        echo_only = body.max_tokens == 0 and body.logprobs is None  # nothing to compute
        submitted = [] if echo_only else fanout.submit(served, todo)
    except ValueError as err:
        raise BadRequest(str(err), field_of(str(err))) from err
    head = {
        "id": todo[0].request_id.rsplit("-", 1)[0],
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.model_name,
    }
    choices = Choices(body, served, ids, texts)
    prompt_tokens = sum(map(len, ids))
    if echo_only:
        out = [choices.choice(part, "", [], [], None, "length", None) for part in todo]
        return JSONResponse({**head, "choices": out, "usage": usage(prompt_tokens, 0)})
    if body.stream:
        return StreamingResponse(
            _events(body, request, served, submitted, head, choices, prompt_tokens),
            media_type="text/event-stream",
        )
    wholes = await fanout.collected(request, served, submitted)
    if isinstance(wholes, JSONResponse):  # no completion: the error's answer
        return wholes
    out = [
        choices.choice(
            w.part, w.text, w.token_ids, w.logprobs, w.prompt_logprobs, w.finish_reason,
            w.stop_reason,
        )
        for w in wholes
    ]  # fmt: skip
    completion_tokens = sum(len(w.token_ids) for w in wholes)
    return JSONResponse({**head, "choices": out, "usage": usage(prompt_tokens, completion_tokens)})


async def _events(
    body: CompletionRequest,
    request: Request,
    served: Served,
    submitted,
    head: dict,
    choices: Choices,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    options = body.stream_options
    generated: dict[int, int] = {}
    try:
        async for part, out in fanout.merged(request, served, submitted):
            generated[part.index] = out.completion_tokens
            if not _worth_a_chunk(out, body.echo and part.index not in choices.offsets):
                continue
            choice = choices.choice(
                part, out.text, list(out.token_ids), list(out.logprobs), _prompt(out),
                out.finish_reason, out.stop_reason,
            )  # fmt: skip
            chunk = {**head, "choices": [choice]}
            if options is not None and options.continuous_usage_stats:
                chunk["usage"] = usage(len(part.prompt), out.completion_tokens)
            yield f"data: {json.dumps(chunk)}\n\n"
        if options is not None and options.include_usage:
            total = usage(prompt_tokens, sum(generated.values()))
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': total})}\n\n"
    except Exception as err:
        yield f"data: {json.dumps({'error': stream_error(err)})}\n\n"
    yield "data: [DONE]\n\n"


def _prompt(out: Output) -> list[TokenLogprob | None] | None:
    return None if out.prompt_logprobs is None else list(out.prompt_logprobs)


def _worth_a_chunk(out: Output, echo_due: bool) -> bool:
    return bool(out.text or out.logprobs or out.finish_reason or echo_due)

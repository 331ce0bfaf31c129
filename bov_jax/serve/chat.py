"""Chat messages as token ids, in nanochat's conversation format (the reference tokenizer's
`render_conversation`), for /v1/chat/completions and /tokenize:

    <|bos|> <|user_start|> user <|user_end|> <|assistant_start|> reply <|assistant_end|> ...
    <|assistant_start|>                                  (the generation prompt)

A system (or developer) message is joined to the next user message with a blank line, as
nanochat does; after it, messages alternate user / assistant starting with a user. Message
text is encoded as plain text: a special-token string inside a message stays text. The
assistant's turn ends at <|assistant_end|>, which the chat route adds to the stop tokens.

A base model was not tuned on conversations: it continues them as it continues any text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from bov_jax.serve import fanout
from bov_jax.serve.completions import usage
from bov_jax.serve.errors import BadRequest, field_of, stream_error
from bov_jax.serve.fanout import Served
from bov_jax.serve.protocol import ChatCompletionRequest, ChatMessage, chat_logprobs
from bov_jax.serve.tokens import ServedTokenizer, check_text

USER = ("<|user_start|>", "<|user_end|>")
ASSISTANT = ("<|assistant_start|>", "<|assistant_end|>")


def turns(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """(role, text) of each turn: system messages joined to the next user message; ValueError
    (naming messages) unless the turns alternate user / assistant from a user."""
    out: list[tuple[str, str]] = []
    system = ""
    for message in messages:
        if message.role in ("system", "developer"):
            system += message.text() + "\n\n"
            continue
        text = message.text()
        if message.role == "user":
            text, system = system + text, ""
        out.append((message.role, text))
    if system:
        raise ValueError("messages: a system message must be followed by a user message")
    for i, (role, _) in enumerate(out):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(
                f"messages: turn {i} is from the {role}; expected the {expected} "
                "(turns alternate user / assistant, starting with a user)"
            )
    if not out:
        raise ValueError("messages: expected at least one user message")
    return out


def render(
    tokenizer: ServedTokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The conversation's token ids (module doc). continue_final_message: the last (an
    assistant's) message is left open for the model to continue."""
    specials = tokenizer.specials
    missing = [s for s in (*USER, *ASSISTANT) if s not in specials]
    if missing:
        raise ValueError(f"messages: the tokenizer has no chat tokens ({', '.join(missing)})")
    conversation = turns(messages)
    if continue_final_message and conversation[-1][0] != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's")
    ids = [tokenizer.bos_id]
    for i, (role, text) in enumerate(conversation):
        start, end = USER if role == "user" else ASSISTANT
        ids += [specials[start], *tokenizer.base.encode_one(text)]
        if not (continue_final_message and i == len(conversation) - 1):
            ids.append(specials[end])
    if add_generation_prompt and not continue_final_message:
        ids.append(specials[ASSISTANT[0]])
    return ids


def end_of_turn(tokenizer: ServedTokenizer) -> int:
    """The id that ends the assistant's turn (a stop token of every chat request)."""
    return tokenizer.specials[ASSISTANT[1]]


async def create(body: ChatCompletionRequest, request: Request, served: Served):
    """POST /v1/chat/completions: the conversation rendered (`render`), completed by the
    engine up to the end of the assistant's turn; n choices; streamed as OpenAI's chunks
    (a first delta with the role, then the content)."""
    tokenizer = served.tokenizer
    try:
        body.refuse_unimplemented()
        if body.model != served.model_name:
            raise ValueError(f"model={body.model!r}; this server serves {served.model_name!r}")
        for message in body.messages:
            check_text(message.text(), "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs: only with logprobs: true")
        ids = await asyncio.to_thread(
            render, tokenizer, body.messages, body.add_generation_prompt,
            body.continue_final_message,
        )  # fmt: skip
        limit = body.max_completion_tokens or body.max_tokens
        max_tokens = max(served.max_model_len - len(ids), 0) if limit is None else limit
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling(max_tokens, logprobs, None)
        stops = (*params.stop_token_ids, end_of_turn(tokenizer))
        params = dataclasses.replace(params, stop_token_ids=stops)
        todo = fanout.parts([ids], body.n, [params])
        submitted = fanout.submit(served, todo)
    except ValueError as err:
        raise BadRequest(str(err), field_of(str(err))) from err
    head = {
        "id": "chat" + todo[0].request_id.rsplit("-", 1)[0],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.model_name,
    }

    def logprobs_of(entries) -> dict | None:
        return chat_logprobs(list(entries), tokenizer.piece) if body.logprobs else None

    if body.stream:
        return StreamingResponse(
            _events(body, request, served, submitted, head, len(ids), logprobs_of),
            media_type="text/event-stream",
        )
    wholes = await fanout.collected(request, served, submitted)
    if isinstance(wholes, JSONResponse):  # no completion: the error's answer
        return wholes
    choices = [
        {
            "index": w.part.index,
            "message": {"role": "assistant", "content": w.text},
            "logprobs": logprobs_of(w.logprobs),
            "finish_reason": w.finish_reason,
            "stop_reason": w.stop_reason,
        }
        for w in wholes
    ]
    completion = sum(len(w.token_ids) for w in wholes)
    return JSONResponse({**head, "choices": choices, "usage": usage(len(ids), completion)})


async def _events(body, request, served, submitted, head, prompt_tokens, logprobs_of):
    head = {**head, "object": "chat.completion.chunk"}
    options, started, generated = body.stream_options, set(), {}

    def chunk(choice: dict, usage_now: dict | None = None) -> str:
        data = {**head, "choices": [choice]}
        if usage_now is not None:
            data["usage"] = usage_now
        return f"data: {json.dumps(data)}\n\n"

    try:
        async for part, out in fanout.merged(request, served, submitted):
            generated[part.index] = out.completion_tokens
            now = None
            if options is not None and options.continuous_usage_stats:
                now = usage(prompt_tokens, out.completion_tokens)
            if part.index not in started:
                started.add(part.index)
                role = {"role": "assistant", "content": ""}
                yield chunk({"index": part.index, "delta": role, "finish_reason": None}, now)
            if out.text or out.logprobs or out.finish_reason:
                choice = {
                    "index": part.index,
                    "delta": {"content": out.text} if out.text else {},
                    "logprobs": logprobs_of(out.logprobs),
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
                yield chunk(choice, now)
        if options is not None and options.include_usage:
            total = usage(prompt_tokens * len(submitted), sum(generated.values()))
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': total})}\n\n"
    except Exception as err:
        yield f"data: {json.dumps({'error': stream_error(err)})}\n\n"
    yield "data: [DONE]\n\n"

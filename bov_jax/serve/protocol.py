"""Request models of the OpenAI-compatible API as vLLM speaks it (pydantic), apart from the
routes, and the logprobs objects of its responses.

Policy for fields: every field of OpenAI's completions and chat requests and of vLLM's
sampling extensions that this server implements is validated here (types) and by
`SamplingParams.validate` (ranges); a field of those protocols that it does not implement
(`suffix`, `best_of` other than n, `tools`, `response_format`, ...) is refused with a 400
naming it, since ignoring it would change the answer silently; a field that belongs to
neither protocol is accepted and ignored with a warning in the log, as vLLM does, so that
clients sending their own extras still connect.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bov_jax.inference.engine import TokenLogprob
from bov_jax.inference.sampling import SamplingParams

log = logging.getLogger(__name__)
LOGPROB_FLOOR = -9999.0  # -inf as OpenAI's and vLLM's JSON writes it

# Fields of OpenAI's or vLLM's protocols that this server does not implement, and the value
# (or values) under which a request naming them is still answered exactly.
NOT_IMPLEMENTED = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
}
_warned: set[str] = set()


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # the usage so far in every chunk (vLLM)


class SamplingFields(BaseModel):
    """The fields completions and chat share: OpenAI's and vLLM's sampling extensions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None

    def refuse_unimplemented(self) -> None:
        """ValueError naming a protocol field this server does not implement; a warning in
        the log for each field of no protocol (once per name)."""
        extra = dict(self.model_extra or {})
        for name, value in extra.items():
            if name in NOT_IMPLEMENTED:
                if value not in NOT_IMPLEMENTED[name]:
                    raise ValueError(f"{name}={value!r}; this server does not implement {name}")
            elif name not in _warned:
                _warned.add(name)
                log.warning("ignoring the field %r: no protocol this server speaks has it", name)
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of={self.best_of}; this server takes best_of equal to n")
        if self.n < 1:
            raise ValueError(f"n={self.n}; expected an integer >= 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None):
        """The engine's parameters (max_tokens and the logprobs resolved by the caller);
        ValueError naming the first field out of range."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias: key {key!r} is not a token id")
            bias.append((int(key), value))
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(bias),
        )
        return params


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, token ids, or a list of
    token-id lists (a choice per prompt and per n)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: BOS before a string prompt
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs' tokens as "token_id:N"


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions (nanochat's conversation format, `chat.render`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM: the last message's content before the completion


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM's: a prompt, or chat messages rendered as the chat route does."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    tokens: list[int]


def finite(value: float) -> float:
    """A log probability as JSON can carry it (-inf as OpenAI's floor)."""
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


def completion_logprobs(
    pieces: list[str],
    entries: list[TokenLogprob | None],
    text_start: int,
    piece_of,
) -> dict[str, Any]:
    """The completions `logprobs` object over tokens whose strings are `pieces` (the first
    at character text_start of the choice's text) and whose entries are `entries` (None:
    nothing predicts that token). top_logprobs holds each entry's alternatives and the token
    itself, as vLLM's. piece_of: token id -> its string."""
    offsets, at = [], text_start
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops: list[dict[str, float] | None] = []
    for piece, entry in zip(pieces, entries, strict=True):
        if entry is None:
            tops.append(None)
            continue
        top = {piece_of(token): finite(value) for token, value in entry.top}
        top.setdefault(piece, finite(entry.logprob))
        tops.append(top)
    return {
        "tokens": pieces,
        "token_logprobs": [None if e is None else finite(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], piece_of) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token: int, value: float) -> dict[str, Any]:
        piece = piece_of(token)
        return {"token": piece, "logprob": finite(value), "bytes": list(piece.encode())}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
            for e in entries
        ]
    }

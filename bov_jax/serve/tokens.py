"""Text and token ids at the server's edge, and the tokenize endpoints as vLLM's.

    POST /tokenize        {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len",
                          "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  {"tokenizer_class", "bos_token", "eos_token", "pad_token",
                          "chat_template", "model_max_length", ...}

BOS: a string prompt is encoded as BOS + its tokens (the model was trained on documents that
start with BOS) unless `add_special_tokens` is false; a token-id prompt is taken as it is.
Special-token strings in a text ("<|user_start|>") become their ids, as Hugging Face
tokenizers parse them; in the other direction /detokenize and the logprobs' token strings
write special tokens by name, while a completion's text leaves them out. The end of a
document, the model's EOS, is its next BOS.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np

from bov_jax.data.tokenizer import SPECIALS
from bov_jax.inference.texts import Tokenizer
from bov_jax.serve.protocol import DetokenizeRequest, TokenizeRequest

SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str) -> None:
    """ValueError (`where` first) for text that is no Unicode: a lone UTF-16 surrogate, which
    JSON's \\ud800 escapes can carry and no encoder takes."""
    if SURROGATE.search(text):
        raise ValueError(f"{where} holds a lone UTF-16 surrogate (not Unicode text)")


class ServedTokenizer:
    """The run's tokenizer with the server's conventions (module doc)."""

    def __init__(self, tokenizer: Tokenizer):
        self.base = tokenizer
        self.bos_id = tokenizer.bos_id
        self.specials = {
            name: i for name in SPECIALS if (i := tokenizer.special_id(name)) is not None
        }
        self.names = {i: name for name, i in self.specials.items()}
        self._split = re.compile("(" + "|".join(map(re.escape, self.specials)) + ")")
        # the most UTF-8 bytes one token stands for: a text of b bytes is >= b / this tokens
        self.max_token_bytes = max(1, int(np.max(tokenizer.token_bytes())))

    def encode(self, text: str, add_bos: bool) -> list[int]:
        """Token ids of `text`, special-token strings as their ids; BOS first if add_bos."""
        ids = [self.bos_id] if add_bos else []
        for part in self._split.split(text):
            if part in self.specials:
                ids.append(self.specials[part])
            elif part:
                ids += self.base.encode_one(part)
        return ids

    def least_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without encoding it (utf-8 bytes / the most
        bytes a token stands for)."""
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def decode(self, ids: Sequence[int], specials: bool = True) -> str:
        """The text of ids; special tokens by name if `specials`, else left out."""
        if not specials:
            return self.base.decode(list(ids))
        out, run = [], []
        for i in ids:
            if i in self.names:
                out += [self.base.decode(run), self.names[i]]
                run = []
            else:
                run.append(i)
        return "".join([*out, self.base.decode(run)])

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one instance per server)
    def piece(self, token: int) -> str:
        """One token's string in logprobs (a special token by name)."""
        return self.names.get(token) or self.base.decode([token])


def tokenize(body: TokenizeRequest, tokenizer: ServedTokenizer, max_model_len: int, render) -> dict:
    """POST /tokenize's answer; ValueError naming a bad field. render: chat messages ->
    ids (`chat.render`)."""
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("prompt: give one of prompt or messages")
    if body.messages is not None:
        ids = render(body.messages, body.add_generation_prompt, body.continue_final_message)
    else:
        ids = tokenizer.encode(body.prompt, body.add_special_tokens)
    strs = [tokenizer.piece(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: DetokenizeRequest, tokenizer: ServedTokenizer, vocab_size: int) -> dict:
    """POST /detokenize's answer; ValueError for ids outside the vocabulary."""
    if any(not 0 <= i < vocab_size for i in body.tokens):
        raise ValueError(f"tokens: ids must lie in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer: ServedTokenizer, max_model_len: int, chat_template: str) -> dict:
    """GET /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads (eos, bos,
    pad tokens and the chat template) and vLLM's other keys."""
    bos = tokenizer.names.get(tokenizer.bos_id) or tokenizer.piece(tokenizer.bos_id)
    return {
        "tokenizer_class": type(tokenizer.base).__name__,
        "bos_token": bos,
        "eos_token": bos,
        "pad_token": bos,
        "chat_template": chat_template,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.base.vocab_size,
        "add_bos_token": True,
        "additional_special_tokens": [n for n in tokenizer.specials if n != bos],
    }

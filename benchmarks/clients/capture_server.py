"""A stand-in OpenAI-compatible server that records every request a client sends.

    python benchmarks/clients/capture_server.py --tokenizer=HF_DIR --log=requests.jsonl \
        [--port=8765] [--model=bov]

Binds 127.0.0.1. Each request becomes one JSON line of the log: method, path, query, headers
and the JSON body (or the raw text when it is not JSON). Answers are vLLM-shaped and plausible,
not a model's: every completion is the same few tokens (" the people of the United States",
cut at max_tokens), every token's logprob a fixed function of its id, and each position's
top_logprobs holds only the token itself, so lm-eval reads every continuation as greedy.
Routes: GET /health, /v1/models, /tokenizer_info; POST /v1/completions (prompt as a string,
a list of strings, a list of ids or a list of lists of ids; echo, logprobs, n, stream with
stream_options), /v1/chat/completions (stream too), /tokenize, /detokenize. Anything else is
logged and answered 404. HF_DIR is a folder written by `python -m bov_jax.interop.hf_tokenizer`
(needs the `tokenizers` package).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

COMPLETION = " the people of the United States"


class Recorder:
    """The tokenizer, the model name and the log file the handler shares across threads."""

    def __init__(self, tokenizer_dir: Path, log: Path, model: str):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
        self.model = model
        self.log = log.open("a", encoding="utf-8")
        self.lock = threading.Lock()

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.log.write(json.dumps(entry) + "\n")
            self.log.flush()

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def logprob(token: int) -> float:
    """The stand-in logprob of a token: -1.0 to -1.6 by its id."""
    return -1.0 - (token % 7) / 10


def prompt_ids(recorder: Recorder, prompt: Any) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions body's `prompt` field."""
    if isinstance(prompt, str):
        return [recorder.encode(prompt)]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [recorder.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def logprobs_block(recorder: Recorder, ids: list[int], first_is_prompt: bool) -> dict:
    """OpenAI's legacy completions logprobs (tokens, token_logprobs, top_logprobs, offsets)."""
    tokens = [recorder.decode([t]) for t in ids]
    values: list[float | None] = [logprob(t) for t in ids]
    tops: list[dict | None] = [{s: v} for s, v in zip(tokens, values, strict=True)]
    if first_is_prompt:
        values[0] = tops[0] = None
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return dict(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class Handler(BaseHTTPRequestHandler):
    recorder: Recorder
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode("utf-8") if length else ""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw

    def _record(self, body: Any) -> None:
        path, _, query = self.path.partition("?")
        self.recorder.record(
            dict(
                time=time.time(),
                method=self.command,
                path=path,
                query=query,
                headers=dict(self.headers.items()),
                body=body,
            )
        )

    def _json(self, payload: Any, status: int = 200) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _not_found(self) -> None:
        message = f"no route {self.command} {self.path} on the capture server"
        self._json(dict(error=dict(message=message, type="NotFoundError", code=404)), 404)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._record(None)
        path = self.path.partition("?")[0]
        r = self.recorder
        if path == "/health":
            self._json({})
        elif path == "/v1/models":
            model = dict(id=r.model, object="model", created=0, owned_by="bov_jax", root=r.model)
            self._json(dict(object="list", data=[dict(model, max_model_len=2048)]))
        elif path == "/tokenizer_info":
            self._json(dict(r.config, tokenizer_class=r.config["tokenizer_class"]))
        else:
            self._not_found()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self._body()
        self._record(body)
        path = self.path.partition("?")[0]
        routes = {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat,
            "/tokenize": self.tokenize,
            "/detokenize": self.detokenize,
        }
        if path in routes and isinstance(body, dict):
            routes[path](body)
        else:
            self._not_found()

    def tokenize(self, body: dict) -> None:
        r = self.recorder
        if "messages" in body:
            text = "".join(str(m.get("content")) for m in body["messages"])
        else:
            text = body.get("prompt", "")
        ids = r.encode(text, special=body.get("add_special_tokens", True))
        self._json(dict(count=len(ids), max_model_len=2048, tokens=ids, token_strs=None))

    def detokenize(self, body: dict) -> None:
        self._json(dict(prompt=self.recorder.decode(body.get("tokens", []))))

    def _generated(self, body: dict, limit_key: str) -> list[int]:
        ids = self.recorder.encode(COMPLETION)
        limit = body.get(limit_key) or body.get("max_tokens") or 16
        return (ids * (limit // len(ids) + 1))[:limit]

    def completions(self, body: dict) -> None:
        r = self.recorder
        prompts = prompt_ids(r, body.get("prompt", ""))
        generated = self._generated(body, "max_tokens")
        n, echo, want_logprobs = body.get("n") or 1, body.get("echo"), body.get("logprobs")
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        head = dict(id=rid, object="text_completion", created=created, model=r.model)
        total_prompt = sum(len(p) for p in prompts) * n
        if body.get("stream"):
            options = body.get("stream_options") or {}
            events = []
            for step, token in enumerate(generated):
                last = step == len(generated) - 1
                choices = [
                    dict(
                        index=i,
                        text=r.decode([token]),
                        logprobs=None,
                        finish_reason="length" if last else None,
                    )
                    for i in range(len(prompts) * n)
                ]
                event = dict(head, choices=choices)
                if options.get("continuous_usage_stats"):
                    event["usage"] = usage(total_prompt, (step + 1) * len(choices))
                events.append(event)
            if options.get("include_usage"):
                done = usage(total_prompt, len(generated) * len(prompts) * n)
                events.append(dict(head, choices=[], usage=done))
            self._stream(events)
            return
        choices = []
        for ids in prompts:
            for _ in range(n):
                shown = (ids if echo else []) + generated
                choice = dict(
                    index=len(choices),
                    text=r.decode(shown),
                    logprobs=None,
                    finish_reason="length",
                    stop_reason=None,
                    prompt_logprobs=None,
                )
                if want_logprobs is not None:
                    choice["logprobs"] = logprobs_block(r, shown, bool(echo and ids))
                choices.append(choice)
        used = usage(total_prompt, len(generated) * len(choices))
        self._json(dict(head, choices=choices, usage=used))

    def chat(self, body: dict) -> None:
        r = self.recorder
        text = "".join(str(m.get("content")) for m in body.get("messages", []))
        prompt_tokens = len(r.encode(text)) + 2 * len(body.get("messages", [])) + 2
        generated = self._generated(body, "max_completion_tokens")
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        head = dict(id=rid, created=created, model=r.model)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            head = dict(head, object="chat.completion.chunk")
            first = dict(index=0, delta=dict(role="assistant", content=""), finish_reason=None)
            events = [dict(head, choices=[first])]
            for step, token in enumerate(generated):
                last = step == len(generated) - 1
                delta = dict(content=r.decode([token]))
                choice = dict(index=0, delta=delta, logprobs=None)
                event = dict(head, choices=[dict(choice, finish_reason="length" if last else None)])
                if options.get("continuous_usage_stats"):
                    event["usage"] = usage(prompt_tokens, step + 1)
                events.append(event)
            if options.get("include_usage"):
                events.append(dict(head, choices=[], usage=usage(prompt_tokens, len(generated))))
            self._stream(events)
            return
        message = dict(role="assistant", content=r.decode(generated))
        choice = dict(index=0, message=message, logprobs=None, finish_reason="length")
        used = usage(prompt_tokens, len(generated))
        self._json(dict(head, object="chat.completion", choices=[choice], usage=used))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer folder")
    parser.add_argument("--log", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--model", default="bov")
    args = parser.parse_args()
    Handler.recorder = Recorder(args.tokenizer, args.log, args.model)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"capturing on http://127.0.0.1:{args.port} into {args.log}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

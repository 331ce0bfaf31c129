"""Serving throughput and latency, baseline against BoV, through the HTTP server.

    python -m bov_jax.inference.bench_serve                  # a small model, CPU-sized
    python -m bov_jax.inference.bench_serve --depth=12 --model_dim=768 --head_dim=128 \\
        --seq_len=2048 --requests=512 --clients=64 --cache_mib=4096      # d12 on a GPU

Each run serves the baseline (--baseline preset) and BoV (--bov preset) in turn, at the
same sizes with random weights, each on its own in-process server (127.0.0.1, FastAPI +
uvicorn, `server.running_server`) over a cache of the same --cache_mib of pages: BoV's
layers without V pages fit more sequences in it. --clients concurrent streaming clients
(httpx) send the same fixed mix of --requests completions: the prompts are documents of
the embedded corpus' val split cut at a seeded length, and each output length is the
token count of that document's next paragraph (clipped), generated with ignore_eos so the
mix is the same for both models. Measured per model and run: throughput (generated tokens
over the wall time of the mix), time to first token and inter-token latency (p50, p99),
pages in use (mean and peak, polled from /metrics) and preemptions; and per run the
BoV / baseline ratios. Runs alternate the two models (--runs of each); the table gives
the median and range over runs, with n. A warm-up pass of the mix compiles first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import statistics
import time
from collections.abc import Sequence

import httpx
import numpy as np
import pyarrow.parquet as pq
from absl import flags

from bov_jax import cli
from bov_jax.data.config import EMBEDDED_DIR
from bov_jax.data.shards import split_files
from bov_jax.data.tokenizer import load_tokenizer
from bov_jax.errors import UserError
from bov_jax.files import write_json_atomic
from bov_jax.inference.engine import Engine, EngineConfig
from bov_jax.inference.layout import CacheLayout
from bov_jax.model.gpt import GPT
from bov_jax.model.spec import ModelSpec
from bov_jax.presets import config_for
from bov_jax.serve.running import running_server

MIB = 2**20
METRICS_POLL_S = 0.1


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def request_mix(tokenizer, count: int, seed: int, max_prompt: int, max_output: int):
    """`count` requests from the val split: a document's first p tokens (p seeded, at least
    8), and as many new tokens as the document's next paragraph has (8 .. max_output)."""
    [val] = split_files(EMBEDDED_DIR, "val")
    texts = pq.read_table(val, columns=["text"]).column("text").to_pylist()
    rng = np.random.default_rng(seed)
    mix = []
    while len(mix) < count:
        text = texts[int(rng.integers(len(texts)))]
        ids = tokenizer.encode_one(text)
        if len(ids) < 24:
            continue
        cut = int(rng.integers(8, min(max_prompt, len(ids) - 8)))
        rest = tokenizer.decode(ids[cut:])
        paragraph = rest.split("\n\n")[0] or rest
        length = len(tokenizer.encode_one(paragraph))
        output = int(np.clip(length, 8, max_output))
        mix.append(Request(tokenizer.decode(ids[:cut]), cut, output))
    return mix


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def metric(text: str, name: str) -> float:
    """The value of the one sample of `name` in Prometheus text (the server's one model)."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    if found is None:
        raise ValueError(f"/metrics has no {name}")
    return float(found.group(1))


async def drive(url: str, model: str, mix: Sequence[Request], clients: int) -> dict:
    """Send the mix through `clients` concurrent streams; the run's figures."""
    queue: asyncio.Queue = asyncio.Queue()
    for request in mix:
        queue.put_nowait(request)
    first_token, gaps, tokens = [], [], 0
    pages: list[float] = []
    done = asyncio.Event()

    async def poll(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            text = (await http.get(f"{url}/metrics")).text
            pages.append(metric(text, "bov:pages_used"))
            await asyncio.sleep(METRICS_POLL_S)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            request = queue.get_nowait()
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.max_tokens,
                "temperature": 1.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
            last, first = time.perf_counter(), True
            async with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
                answer.raise_for_status()
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
                    if chunk["choices"]:  # not the usage chunk
                        (first_token if first else gaps).append(now - last)
                        last, first = now, False

    async with httpx.AsyncClient(timeout=600) as http:
        before = await http.get(f"{url}/metrics")
        poller = asyncio.create_task(poll(http))
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - start
        done.set()
        await poller
        after = await http.get(f"{url}/metrics")
    preempted = [metric(m.text, "bov:num_preemptions_total") for m in (before, after)]
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "ttft_p50_ms": 1e3 * percentile(first_token, 50),
        "ttft_p99_ms": 1e3 * percentile(first_token, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "pages_mean": float(np.mean(pages)) if pages else 0.0,
        "pages_peak": max(pages, default=0.0),
        "preemptions": preempted[1] - preempted[0],
    }


def bench_model(preset: str, args: flags.FlagValues) -> GPT:
    config = config_for(preset)
    config.model.update(
        depth=args.depth,
        model_dim=args.model_dim,
        head_dim=args.head_dim,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
    )
    return GPT(ModelSpec.from_config(config.model), seed=0)


def engine_for(model: GPT, tokenizer, args: flags.FlagValues) -> Engine:
    """An engine whose pages take --cache_mib (all groups), as many sequences of the
    model's context as fit."""
    layout = CacheLayout.build(model.spec, args.page_size)
    context, chunk = model.spec.seq_len, min(args.chunk, model.spec.seq_len)
    fits = layout.sequences_within(int(args.cache_mib * MIB), context, chunk)
    if fits < 1:
        raise UserError(f"--cache_mib={args.cache_mib} holds no sequence of {context} tokens")
    config = EngineConfig(
        page_size=args.page_size,
        max_seqs=args.max_seqs,
        chunk=chunk,
        pages=layout.pages_for(fits, context, chunk),
        seed=args.seed,
    )
    return Engine(model, config, tokenizer)


SUMMARY_KEYS = (  # (figure, column, format)
    ("tokens_per_second", "tokens/s", "{:,.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:,.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:,.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:,.1f}"),
    ("pages_mean", "pages mean", "{:,.0f}"),
    ("pages_peak", "pages peak", "{:,.0f}"),
    ("preemptions", "preemptions", "{:,.0f}"),
)
RATIO_KEYS = ("tokens_per_second", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def per_run_ratios(runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """BoV / baseline of each RATIO_KEYS figure, run by run (runs alternate the models)."""
    pairs = list(zip(runs["baseline"], runs["BoV"], strict=True))
    return {key: [b[key] / a[key] for a, b in pairs] for key in RATIO_KEYS}


def summary(runs: dict[str, list[dict]], ratios: dict[str, list[float]]) -> str:
    """The table: median (min-max) over runs, with n; a last row of per-run ratios."""

    def cell(values: Sequence[float], form: str) -> str:
        mid, low, high = statistics.median(values), min(values), max(values)
        return f"{form.format(mid)} ({form.format(low)}-{form.format(high)})"

    n = len(runs["baseline"])
    lines = [
        f"| model (n = {n} runs) | " + " | ".join(label for _, label, _ in SUMMARY_KEYS) + " |",
        "|---|" + "---:|" * len(SUMMARY_KEYS),
    ]
    for name, rows in runs.items():
        cells = [cell([r[key] for r in rows], form) for key, _, form in SUMMARY_KEYS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [cell(ratios[key], "{:.3f}") if key in ratios else "" for key, _, _ in SUMMARY_KEYS]
    lines.append("| BoV / baseline, per run | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: flags.FlagValues) -> tuple[str, dict]:
    tokenizer = load_tokenizer(EMBEDDED_DIR / "tokenizer")
    mix = request_mix(tokenizer, args.requests, args.seed, args.seq_len // 2, args.max_output)
    names = {"baseline": args.baseline, "BoV": args.bov}
    engines = {
        name: engine_for(bench_model(preset, args), tokenizer, args)
        for name, preset in names.items()
    }
    runs: dict[str, list[dict]] = {name: [] for name in names}
    header = [
        f"mix: {len(mix)} requests, prompts of {min(r.prompt_tokens for r in mix)}-"
        f"{max(r.prompt_tokens for r in mix)} tokens, {sum(r.max_tokens for r in mix):,} "
        f"output tokens; {args.clients} clients; {args.cache_mib} MiB of pages each: "
        + ", ".join(f"{n} {list(e.pages)} pages a group" for n, e in engines.items())
    ]
    for name, engine in engines.items():
        with running_server(engine, tokenizer, name) as url:
            asyncio.run(drive(url, name, mix, args.clients))  # warm-up: compiles
    for _ in range(args.runs):
        for name, engine in engines.items():
            with running_server(engine, tokenizer, name) as url:
                runs[name].append(asyncio.run(drive(url, name, mix, args.clients)))
    ratios = per_run_ratios(runs)
    text = "\n".join([*header, "", summary(runs, ratios)])
    figures = {
        "mix_requests": len(mix),
        "mix_output_tokens": sum(r.max_tokens for r in mix),
        "pages": {name: list(engine.pages) for name, engine in engines.items()},
        "runs": runs,
        "bov_over_baseline": ratios,
    }
    figures["settings"] = {k: getattr(args, k) for k in FLAG_NAMES}
    return text, figures


FLAG_NAMES = (
    "baseline",
    "bov",
    "depth",
    "model_dim",
    "head_dim",
    "seq_len",
    "vocab_size",
    "requests",
    "clients",
    "max_output",
    "max_seqs",
    "page_size",
    "chunk",
    "cache_mib",
    "runs",
    "seed",
)


def define_flags() -> None:
    flags.DEFINE_string("baseline", "d12", "Baseline preset.")
    flags.DEFINE_string("bov", "d12_bov", "BoV preset.")
    flags.DEFINE_integer("depth", 6, "Layers.")
    flags.DEFINE_integer("model_dim", 256, "Model width.")
    flags.DEFINE_integer("head_dim", 64, "Attention head width.")
    flags.DEFINE_integer("seq_len", 512, "Context (the engine's max_context).")
    flags.DEFINE_integer("vocab_size", 8192, "Vocabulary (the embedded tokenizer's).")
    flags.DEFINE_integer("requests", 48, "Requests in the mix.")
    flags.DEFINE_integer("clients", 16, "Concurrent streaming clients.")
    flags.DEFINE_integer("max_output", 96, "Longest output of the mix, in tokens.")
    flags.DEFINE_integer("max_seqs", 16, "Engine batch slots.")
    flags.DEFINE_integer("page_size", 16, "Tokens a page.")
    flags.DEFINE_integer("chunk", 128, "Prefill chunk.")
    flags.DEFINE_float("cache_mib", 48.0, "Cache pages per engine, MiB (the same for both).")
    flags.DEFINE_integer("runs", 3, "Timed runs of each model (alternating).")
    flags.DEFINE_integer("seed", 0, "Seeds the mix and the engines.")
    flags.DEFINE_string("json_out", None, "Also write the figures to this JSON file.")


def main(argv: list[str]) -> None:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    text, figures = run(flags.FLAGS)
    print(text)
    if flags.FLAGS.json_out:
        write_json_atomic(flags.FLAGS.json_out, figures)


if __name__ == "__main__":
    define_flags()
    cli.run(main)

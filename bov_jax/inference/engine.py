"""The serving engine: requests in, tokens out, over a paged cache with continuous batching.

    engine = Engine(model, EngineConfig(max_seqs=8), tokenizer)
    engine.add("a", prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_work():
        for out in engine.step(): ...       # new tokens, text and logprobs per request

Each `step` plans (`scheduler`), runs at most one prefill chunk (one row) and one decoding
batch (every decoding sequence, a row each) through `paged.forward_step`, samples every
row whose next token is due (`sampling.sample_rows`), and finishes sequences at EOS or a
stop token, at max_tokens, at a stop string or at the context's end, freeing their pages.
`add` and `abort` may be called from other threads: they queue, and `step` takes them in.

Prompt scoring (`SamplingParams.prompt_logprobs`): the prefill chunks of such a request
return every position's logits, and each prompt token's log probability (and its top-k)
is taken as its chunk runs, so the scores are the full forward's whatever the chunking; a
sequence preempted and recomputed does not score again what it scored. They reach the
client with the request's first output; `max_tokens=0` scores the prompt and decodes
nothing.

Compiled shapes are bucketed: a step has R rows of C tokens with R a power of two up to
max_seqs (decoding) or 1 (prefill), C 1 (decoding) or a power of two up to the chunk
(prefill), and per window a number of logical pages read that follows from C and the
power-of-two bucket of the batch's last page (`paged.spans_for`). A long-running engine
compiles at most `shape_bound()` programs, not one per request.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bov_jax.inference import bank_words, paged, sampling
from bov_jax.inference.allocator import PageAllocator
from bov_jax.inference.layout import BANK, CacheLayout
from bov_jax.inference.sampling import SamplingParams
from bov_jax.inference.scheduler import Scheduler, Sequence
from bov_jax.inference.texts import Tokenizer, completion_text
from bov_jax.model.gpt import GPT
from bov_jax.model.tables import embedding_paths

PROMPT_CONTEXT = 8  # prompt tokens decoded with a completion, for pieces that need the left
RATE_WINDOW_S = 10.0  # tokens/s is measured over this many seconds


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """page_size: tokens a page; max_seqs: sequences decoding at once (batch slots);
    max_context: positions a sequence may use (default: the model's seq_len); chunk: prompt
    tokens prefilled a call at most; pages: pages per cache group (default: room for
    max_seqs sequences of max_context tokens, `CacheLayout.pages_for`); seed: draws the
    seeds of requests that name none; block_pages: logical pages an attention without a
    paged kernel weighs at a time off NVIDIA GPUs (`paged.forward_step`)."""

    page_size: int = 16
    max_seqs: int = 8
    max_context: int | None = None
    chunk: int = 256
    pages: tuple[int, ...] | None = None
    eliminate_bank_v: bool = True
    cache_dtype: str | None = None
    seed: int = 0
    record_logits: bool = False  # keep each sampled row's logits on the host (tests)
    block_pages: int = paged.BLOCK_PAGES
    prefix_sharing: bool = True  # a sequence starts from the pages of a running one's prefix


def serving_params(model: GPT, params: nnx.State, layout: CacheLayout) -> nnx.State:
    """The parameters of `model` (`params`: arrays or ShapeDtypeStructs) as the step takes
    them: every floating one in the compute dtype, what the forward casts them to at each use
    (so serving them cast changes no result and holds bf16 weights, not fp32 masters, on
    accelerators); where the layout reads bank rows by id (BANK layers), the banks as words
    (`bank_words.pack`), as the paged kernels read them."""
    dtype, heads = model.spec.compute_dtype, model.spec.n_head
    by_id = any(reads.mode == BANK for reads in layout.layers)
    banks = {p for role, p in embedding_paths(model).items() if by_id and role.startswith("bank")}

    def served(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(dtype)
        return x

    def serve(path: tuple, x):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        as_served = (lambda t: bank_words.pack(served(t), heads)) if keys in banks else served
        if isinstance(x, jax.ShapeDtypeStruct):
            out = jax.eval_shape(as_served, x)
            return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=x.sharding)
        return as_served(x)

    return jax.tree_util.tree_map_with_path(serve, params)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the likeliest tokens and their log probabilities


@dataclasses.dataclass(frozen=True)
class Output:
    """What one step added to one request: new tokens (an EOS or stop token is not one), the
    text they add (held back while it may begin a stop string), their logprobs if asked,
    and the finish reason ("stop", "length", "abort") on its last output, with what stopped
    it (stop_reason: the stop string or stop token id; None for EOS or a length).

    The first output of a request that asked for prompt logprobs carries them
    (prompt_logprobs: one entry a prompt token, None for the first, which nothing
    predicts), and every request's first output says how long it queued (queued_s: from
    `add` to its admission)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logits: tuple[np.ndarray, ...] = ()  # (V,) behind each sampled token (record_logits)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: str | int | None = None
    queued_s: float | None = None


@dataclasses.dataclass
class Result:
    """A whole completion (`Engine.generate`)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str
    logits: list[np.ndarray]  # with record_logits: behind each sampled token, EOS included
    prompt_logprobs: list[TokenLogprob | None] | None = None


def held_back(text: str, stops: Seq[str]) -> int:
    """Characters at the end of `text` not to send yet: a trailing partial UTF-8 character
    (U+FFFD) or the longest proper prefix of a stop string that `text` ends with."""
    end = len(text.rstrip("\ufffd"))
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:k], 0, end):
                hold = max(hold, k)
                break
    return len(text) - end + hold


def _entry(token, logprob, top_ids, top_values, n: int | None) -> TokenLogprob:
    """A token's TokenLogprob from the sampler's arrays, with its n likeliest alternatives."""
    top = () if not n else tuple(zip(top_ids[:n].tolist(), top_values[:n].tolist(), strict=True))
    return TokenLogprob(int(token), float(logprob), top)


@dataclasses.dataclass
class _Stream:
    """The engine's per-request bookkeeping beside its `Sequence`."""

    seq: Sequence
    added_at: float  # time.monotonic() at `add`
    sent: int = 0  # characters of the completion text already output
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # not yet output
    admitted_at: float | None = None
    # prompt scoring: an entry per prompt token scored so far (the first None); None if not asked
    prompt_scores: list[TokenLogprob | None] | None = None
    first_sent: bool = False  # the first output (prompt scores, queue time) has gone

    @property
    def scoring(self) -> bool:
        """Prompt tokens remain to be scored."""
        return self.prompt_scores is not None and len(self.prompt_scores) < len(self.seq.prompt)


class Engine:
    def __init__(
        self,
        model: GPT,
        config: EngineConfig = EngineConfig(),
        tokenizer: Tokenizer | None = None,
        eos_ids: Seq[int] | None = None,
    ):
        spec = model.spec
        self.spec, self.config, self.tokenizer = spec, config, tokenizer
        self.max_context = config.max_context or spec.seq_len
        dtype = jnp.dtype(config.cache_dtype) if config.cache_dtype else None
        self.layout = CacheLayout.build(spec, config.page_size, dtype, config.eliminate_bank_v)
        self.width = -(-self.max_context // config.page_size)
        chunk = min(config.chunk, self.max_context)
        need = self.layout.pages_for(0, self.max_context, chunk)  # one sequence, prefilling
        pages = config.pages or self.layout.pages_for(config.max_seqs, self.max_context, chunk)
        if len(pages) != len(need) or any(p < n for p, n in zip(pages, need, strict=True)):
            raise ValueError(
                f"pages={list(pages)}; one sequence of max_context={self.max_context} needs "
                f"{list(need)} pages (groups: {[g.reach for g in self.layout.groups]})"
            )
        if config.block_pages < 1:
            raise ValueError(f"block_pages={config.block_pages}; expected at least 1")
        self.pages, self.chunk = tuple(pages), chunk
        self.graphdef, params = nnx.split(model)
        self.device = jax.devices()[0]  # one device serves
        self.params = jax.device_put(serving_params(model, params, self.layout), self.device)
        self._empty_cache()
        if eos_ids is None:
            eos_ids = () if tokenizer is None else (tokenizer.bos_id,)
        self.eos_ids = frozenset(eos_ids)
        self._seeds = np.random.default_rng(config.seed)
        self._streams: dict[str, _Stream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # ids in flight, for add's duplicate check
        self._ids: set[str] = set()
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self.generated_tokens = 0
        self.aborted = 0
        self.steps = 0
        self.shapes: set[tuple] = set()  # (rows, columns, spans) of the steps run so far

    def shape_bound(self) -> int:
        """How many distinct step shapes this engine can run: decoding steps of each rows
        bucket, prefill chunks of each columns bucket (scoring a prompt or not), each at
        every pages bucket."""
        rows, columns = paged.buckets(self.config.max_seqs), paged.buckets(self.chunk)
        return (rows + 2 * columns) * paged.buckets(self.width)

    def _empty_cache(self) -> None:
        self.allocator = PageAllocator(self.layout, self.pages, self.width)
        limit = self._share_limit if self.config.prefix_sharing else None
        self.scheduler = Scheduler(self.allocator, self.config.max_seqs, self.chunk, limit)
        # placed (committed) as the step's outputs are, so the first step compiles once
        self.pools = jax.device_put(paged.init_pools(self.layout, self.pages), self.device)

    def reset(self) -> list[str]:
        """Drop every request, queued ones too, and start again from an empty cache (after a
        failed step, whose donated pools are gone); the ids dropped."""
        dropped = list(self._streams)
        while not self._inbox.empty():
            dropped.append(self._inbox.get()[0].id)
        while not self._aborts.empty():
            self._aborts.get()
        self._streams.clear()
        with self._lock:
            self._ids.clear()
        self._empty_cache()
        return dropped

    # -- requests ---------------------------------------------------------------------

    def check(self, prompt: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field of a request the engine cannot serve."""
        params.validate(self.spec.vocab_size)
        if not prompt:
            raise ValueError("prompt: expected at least one token")
        if min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            raise ValueError(f"prompt: token ids must lie in [0, {self.spec.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(
                f"max_tokens={params.max_tokens} with a prompt of {len(prompt)} tokens exceeds "
                f"the context of {self.max_context} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")

    def add(self, request_id: str, prompt: Seq[int], params: SamplingParams) -> None:
        """Queue a request (any thread); ValueError if it is invalid or its id is in use."""
        self.check(prompt, params)
        with self._lock:
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._ids.add(request_id)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**31))
        self._inbox.put((Sequence(request_id, list(prompt), params, seed), time.monotonic()))

    def abort(self, request_id: str) -> None:
        """Stop a request (any thread): its pages are freed at the next step."""
        self._aborts.put(request_id)

    def has_work(self) -> bool:
        return bool(self._streams) or not self._inbox.empty() or not self._aborts.empty()

    # -- stepping ---------------------------------------------------------------------

    def _take_in(self) -> list[Output]:
        while not self._inbox.empty():
            seq, added_at = self._inbox.get()
            scores = None if seq.params.prompt_logprobs is None else [None]
            self._streams[seq.id] = _Stream(seq, added_at, prompt_scores=scores)
            self.scheduler.add(seq)
        outputs = []
        while not self._aborts.empty():
            stream = self._streams.get(self._aborts.get())
            if stream is not None:
                self.aborted += 1
                outputs.append(self._finish(stream, "abort"))
        return outputs

    def _share_limit(self, seq: Sequence, donor: Sequence, n: int) -> int:
        """How much of a common prefix of n tokens `seq` may take from `donor`: all of it,
        or for a prompt being scored what the scores it has or can copy cover."""
        own = self._streams[seq.id].prompt_scores
        if own is None:
            return n
        theirs = self._streams[donor.id].prompt_scores
        if theirs is None or donor.params.prompt_logprobs < seq.params.prompt_logprobs:
            theirs = ()
        return min(n, max(len(own), len(theirs)) - 1)

    def _take_scores(self, stream: _Stream) -> None:
        """A sequence admitted on a donor's pages takes the donor's scores of that prefix."""
        seq = stream.seq
        donor, seq.donor = seq.donor, None
        if stream.prompt_scores is None or donor is None:
            return
        theirs, k = self._streams[donor.id].prompt_scores, seq.params.prompt_logprobs
        have = len(stream.prompt_scores)
        for entry in (theirs or [])[have : seq.computed + 1]:
            stream.prompt_scores.append(TokenLogprob(entry.token, entry.logprob, entry.top[:k]))

    def _forward(
        self,
        rows: list[tuple[Sequence, int]],
        batch: int,
        columns: int,
        every_position: bool = False,
    ) -> jax.Array:
        """Run `rows` ((sequence, new tokens), ...) padded to (batch, columns); their
        last tokens' logits (batch, V), or every column's (batch, columns, V)."""
        tokens = np.zeros((batch, columns), np.int32)
        start, counts, previous = (np.zeros(batch, np.int32) for _ in range(3))
        for r, (seq, n) in enumerate(rows):
            tokens[r, :n] = seq.tokens[seq.computed : seq.computed + n]
            start[r], counts[r] = seq.computed, n
            previous[r] = seq.tokens[seq.computed - 1] if seq.computed else 0
        tables = self.allocator.tables([seq.id for seq, _ in rows], batch)
        inputs = paged.StepInput(tokens, start, counts, previous, tables)
        end_page = int(max(start + np.maximum(counts, 1) - 1)) // self.layout.page_size
        spans = paged.spans_for(self.layout, end_page, columns, self.width)
        self.shapes.add((batch, columns, spans, every_position))
        logits = self.run_step(inputs, spans, every_position)
        for seq, n in rows:
            seq.computed += n
        return logits

    def run_step(
        self,
        inputs: paged.StepInput,
        spans: tuple[tuple[int, int], ...],
        every_position: bool = False,
    ) -> jax.Array:
        """`paged.forward_step` over this engine's weights and pools (donated, then replaced
        by the ones it returns): the logits (`_forward`; the server's warm-up)."""
        logits, self.pools = paged.forward_step(
            self.graphdef,
            self.params,
            self.pools,
            inputs,
            layout=self.layout,
            spans=spans,
            block_pages=self.config.block_pages,
            every_position=every_position,
        )
        return logits

    def _sample(self, logits: jax.Array, seqs: list[Sequence]) -> list[Output]:
        """Sample the next token of each of `seqs` (the first rows of logits (B, V))."""
        rows = []
        for seq in seqs:
            p = seq.params
            banned: tuple[int, ...] = ()
            if len(seq.generated) < p.min_tokens:  # vLLM's min_tokens: no stopping yet
                banned = (*(() if p.ignore_eos else self.eos_ids), *p.stop_token_ids)
            rows.append(
                sampling.Row(p, seq.seed, len(seq.tokens), seq.prompt, seq.generated, banned)
            )
        picked = sampling.sample_rows(logits, rows)
        kept = np.asarray(logits[: len(seqs)]) if self.config.record_logits else None
        outputs = []
        for r, seq in enumerate(seqs):
            stream = self._streams[seq.id]
            if kept is not None:
                stream.logits.append(kept[r])
            entry = _entry(
                picked.tokens[r],
                picked.logprobs[r],
                picked.top_ids[r],
                picked.top_logprobs[r],
                seq.params.logprobs,
            )
            outputs.append(self._append(stream, entry))
        return outputs

    def _score(self, stream: _Stream, logits: jax.Array, start: int, count: int) -> None:
        """Score the prompt tokens that the chunk's positions start .. start + count - 1
        predict (those not scored before a preemption), from its logits (C, V)."""
        seq, scores = stream.seq, stream.prompt_scores
        end = min(start + count, len(seq.prompt) - 1)  # positions j < end predict prompt[j + 1]
        first = len(scores) - 1
        if first >= end:
            return
        targets = np.zeros(logits.shape[0], np.int32)
        targets[: end - start] = seq.prompt[start + 1 : end + 1]
        chosen, top_values, top_ids = (
            np.asarray(x) for x in sampling.logprobs_of(logits, jnp.asarray(targets))
        )
        k = seq.params.prompt_logprobs
        for j in range(first, end):
            c = j - start
            scores.append(_entry(targets[c], chosen[c], top_ids[c], top_values[c], k))

    def _append(self, stream: _Stream, entry: TokenLogprob) -> Output:
        seq, params = stream.seq, stream.seq.params
        self.generated_tokens += 1
        if entry.token in params.stop_token_ids:
            return self._finish(stream, "stop", stop_reason=entry.token)
        if entry.token in self.eos_ids and not params.ignore_eos:
            return self._finish(stream, "stop")
        seq.tokens.append(entry.token)
        logprobs = (entry,) if params.logprobs is not None else ()
        text, stop = self._text(stream)
        if stop is not None:
            return self._finish(stream, "stop", (entry.token,), logprobs, stop)
        if len(seq.generated) >= params.max_tokens or len(seq.tokens) >= self.max_context:
            return self._finish(stream, "length", (entry.token,), logprobs)
        delta = text[stream.sent : len(text) - held_back(text, params.stop)]
        stream.sent += len(delta)
        return self._output(stream, delta, (entry.token,), logprobs)

    def _text(self, stream: _Stream) -> tuple[str, str | None]:
        """The completion's text so far, cut at its first stop string (before it, or after it
        with include_stop_str_in_output), and that string; none before min_tokens tokens."""
        if self.tokenizer is None:
            return "", None
        seq, params = stream.seq, stream.seq.params
        text = completion_text(self.tokenizer, seq.prompt[-PROMPT_CONTEXT:], seq.generated)
        if len(seq.generated) < params.min_tokens:
            return text, None
        found = [(i, stop) for stop in params.stop if (i := text.find(stop)) >= 0]
        if not found:
            return text, None
        at, stop = min(found)
        return text[: at + len(stop) if params.include_stop_str_in_output else at], stop

    def _output(
        self,
        stream: _Stream,
        text: str,
        tokens: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> Output:
        seq, logits = stream.seq, tuple(stream.logits)
        stream.logits.clear()
        prompt, generated = len(seq.prompt), len(seq.generated)
        first = {}
        if not stream.first_sent:
            stream.first_sent = True
            scores = stream.prompt_scores
            admitted = stream.admitted_at or time.monotonic()
            first = dict(
                prompt_logprobs=None if scores is None else tuple(scores),
                queued_s=admitted - stream.added_at,
            )
        return Output(
            seq.id,
            tokens,
            text,
            logprobs,
            reason,
            prompt,
            generated,
            logits,
            stop_reason=stop_reason,
            **first,
        )

    def _finish(
        self,
        stream: _Stream,
        reason: str,
        tokens: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        stop_reason: str | int | None = None,
    ) -> Output:
        """The last output of a request (the rest of its text), its pages freed."""
        text, _ = self._text(stream)
        self.scheduler.remove(stream.seq)
        del self._streams[stream.seq.id]
        with self._lock:
            self._ids.discard(stream.seq.id)
        return self._output(stream, text[stream.sent :], tokens, logprobs, reason, stop_reason)

    def step(self) -> list[Output]:
        """One iteration (module doc); the outputs of every request it advanced."""
        outputs = self._take_in()
        plan = self.scheduler.plan()
        if plan.prefill is not None:
            seq, n = plan.prefill
            stream = self._streams[seq.id]
            if stream.admitted_at is None:
                stream.admitted_at = time.monotonic()
            self._take_scores(stream)
            start, scoring = seq.computed, stream.scoring
            logits = self._forward([plan.prefill], 1, paged.bucket(n, self.chunk), scoring)
            if scoring:
                self._score(stream, logits[0], start, n)
                logits = logits[:, n - 1]
            if seq.params.max_tokens == 0 and seq.computed >= len(seq.prompt) - 1:
                outputs.append(self._finish(stream, "length"))  # scored: nothing to decode
            elif seq.uncomputed == 0:
                outputs += self._sample(logits, [seq])
        if plan.decode:
            batch = paged.bucket(len(plan.decode), self.config.max_seqs)
            logits = self._forward([(seq, 1) for seq in plan.decode], batch, 1)
            outputs += self._sample(logits, plan.decode)
        self.steps += 1
        self._rate.append((time.monotonic(), sum(len(o.token_ids) for o in outputs)))
        return outputs

    def tokens_per_second(self) -> float:
        """Tokens generated a second over the last RATE_WINDOW_S seconds up to now: it falls
        to 0 within the window once the engine idles."""
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
        if not self._rate:
            return 0.0
        span = now - self._rate[0][0]
        return sum(n for _, n in list(self._rate)[1:]) / span if span > 0 else 0.0

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[Result]:
        """Every prompt's whole completion (one `SamplingParams` for all, or one each),
        stepping until all are done."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        results = {i: Result([], "", [], "", []) for i in ids}
        for request_id, prompt, p in zip(ids, prompts, each, strict=True):
            self.add(request_id, prompt, p)
        while any(not r.finish_reason for r in results.values()):
            for out in self.step():
                result = results[out.request_id]
                result.token_ids += out.token_ids
                result.text += out.text
                result.logprobs += out.logprobs
                result.logits += out.logits
                result.finish_reason = out.finish_reason or ""
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = list(out.prompt_logprobs)
        return [results[i] for i in ids]

    # -- state ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Running and waiting requests, pages used and free (all groups), tokens/s over
        the last RATE_WINDOW_S seconds, generated tokens, preemptions, prompt tokens taken
        from a running sequence's pages (prefix sharing), aborts, steps."""
        groups = range(len(self.layout.groups))
        rate = self.tokens_per_second()
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + self._inbox.qsize(),
            "pages_used": sum(self.allocator.used_pages(g) for g in groups),
            "pages_free": sum(self.allocator.free_pages(g) for g in groups),
            "tokens_per_second": rate,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.scheduler.preemptions,
            "shared_tokens": self.scheduler.shared_tokens,
            "aborted": self.aborted,
            "steps": self.steps,
        }

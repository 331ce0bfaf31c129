"""What the engine runs next: admission by free pages, one prefill chunk, the decode batch,
and preemption when pages run out. Plain Python over the allocator's host-side tables.

A sequence's tokens are its prompt and what it has generated; `computed` of them have their
keys and values in pages. One uncomputed token: it decodes (one token a step, in the batch
of every decoding sequence). More: it prefills, `chunk` tokens a step at most, one sequence
at a time, interleaved with the decode batch (JetStream's and vLLM's chunked prefill).

Each step (FCFS, as vLLM's scheduler):
  1. every decoding sequence, oldest first, releases the pages its window left behind and
     reserves a page for its next position; when a group has none free the youngest running
     sequence is preempted: its pages are freed, and it goes back to the front of the queue
     with nothing computed (recomputed later from its tokens: sampling depends only on
     (seed, position), so it continues exactly as it would have);
  2. the prefilling sequence gets its next chunk, preempting as in 1; or, with none, the
     oldest waiting sequence is admitted if a batch slot is free and its first chunk's
     pages are (admission never preempts).

Prefix sharing (vLLM's prefix caching, among the sequences in the engine): a sequence being
admitted whose tokens begin with full pages that a running sequence has computed (the
contexts of a multiple-choice item, the n samples of a prompt) takes those pages
(`PageAllocator.share`) and starts with them computed; `share_limit` (the engine's) may
shorten the prefix, e.g. to what the donor's prompt scores cover.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterator

from bov_jax.inference.allocator import PageAllocator
from bov_jax.inference.sampling import SamplingParams

_arrivals = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state in the engine (identity, not value, equality)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    preemptions: int = 0
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrivals))
    donor: Sequence | None = None  # whose pages it started from, at its last admission

    def __post_init__(self) -> None:
        self.tokens = self.tokens or list(self.prompt)

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


@dataclasses.dataclass
class Plan:
    """One step: a prefill chunk (sequence, tokens) or None, the decoding sequences, and the
    sequences preempted while planning."""

    prefill: tuple[Sequence, int] | None
    decode: list[Sequence]
    preempted: list[Sequence]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_seqs: int,
        chunk: int,
        share_limit: Callable[[Sequence, Sequence, int], int] | None = None,
    ):
        """share_limit(seq, donor, n): how much of a common prefix of n tokens seq may take
        from donor (module doc); None: no prefix sharing."""
        self.allocator, self.max_seqs, self.chunk = allocator, max_seqs, chunk
        self.share_limit = share_limit
        self.shared_tokens = 0  # prompt tokens not computed: taken from a running sequence
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the youngest last
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def sequences(self) -> Iterator[Sequence]:
        yield from self.running
        yield from self.waiting

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.id)

    def _preempt(self, preempted: list[Sequence]) -> Sequence:
        victim = self.running.pop()
        self.allocator.free(victim.id)
        victim.computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        preempted.append(victim)
        return victim

    def _grow(self, seq: Sequence, tokens: int, preempted: list[Sequence]) -> bool:
        """Pages for `seq`'s next `tokens` positions, preempting the youngest running
        sequences while they lack; False if `seq` itself was preempted."""
        self.allocator.release_behind(seq.id, seq.computed)
        while not self.allocator.reserve(seq.id, seq.computed + tokens):
            if self._preempt(preempted) is seq:
                return False
        return True

    def plan(self) -> Plan:
        preempted: list[Sequence] = []
        decode = []
        for seq in [s for s in self.running if s.uncomputed == 1]:
            if seq in self.running and self._grow(seq, 1, preempted):
                decode.append(seq)
        decode = [s for s in decode if s in self.running]
        prefill = None
        filling = next((s for s in self.running if s.uncomputed > 1), None)
        if filling is not None:
            tokens = min(self.chunk, filling.uncomputed)
            if self._grow(filling, tokens, preempted):
                prefill = (filling, tokens)
            decode = [s for s in decode if s in self.running]
        elif self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            self._share_prefix(seq)
            tokens = min(self.chunk, seq.uncomputed)
            if self.allocator.reserve(seq.id, seq.computed + tokens):
                self.running.append(self.waiting.popleft())
                prefill = (seq, tokens)
            else:  # waiting holds no pages
                self.allocator.free(seq.id)
                seq.computed, seq.donor = 0, None
        return Plan(prefill, decode, preempted)

    def _share_prefix(self, seq: Sequence) -> None:
        """Start `seq` from the longest prefix of full pages a running sequence computed."""
        seq.donor = None
        if self.share_limit is None:
            return
        size, best = self.allocator.layout.page_size, 0
        for other in self.running:
            n = common_prefix(other.tokens[: other.computed], seq.tokens[: seq.uncomputed - 1])
            n = self.share_limit(seq, other, n) // size * size
            if n > best and self.allocator.share(seq.id, other.id, n):
                self.allocator.free(seq.id)  # keep looking; take the best one below
                best, seq.donor = n, other
        if best and self.allocator.share(seq.id, seq.donor.id, best):
            seq.computed = best
            self.shared_tokens += best

"""The paged cache, described once: its page pools, which layers read them, what a page costs.

Every layer keeps its keys in pages. Its values come three ways (`value_modes`):

  own   the layer's values depend on the context: a V pool of its own;
  bank  source=bank, combine=replace: no V pool. One pool of token ids serves every such
        layer; V = coef * E_l[id] is gathered where it is weighed;
  v1    source=v1, combine=replace: V = coef * layer 0's values, read from layer 0's V pool.

Pools (P tokens a page, H heads, hd head width):

  k.<l>  (H, pages, P, hd)  layer l's keys (rotated, normed, scaled, as the dense cache)
  v.<l>  (H, pages, P, hd)  the values of an own layer l
  ids    (pages, P) int32   the token ids, when a bank layer exists

Head-major pages are the layout JAX's Pallas paged-attention kernels read (GPU and TPU).

A pool's *reach* is the largest attention window among the layers that read it: k.<l>
window_l; v.<l> window_l, for layer 0 also the windows of the v1 layers; ids the bank
layers' largest window. A query at position p reads positions p - reach .. p of a pool, so a
sequence that has computed n tokens never again reads a page lying wholly before n - reach:
the allocator releases it. Pools of one reach form a *group*: they share a page-id space,
a free list and one block table per sequence (vLLM's KV-cache groups: its sliding-window
manager swaps such pages for a null block, as `allocator` does here with page 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

from bov_jax.model.spec import ModelSpec

OWN, BANK, V1 = "own", "bank", "v1"
ID_DTYPE = jnp.int32
NULL_PAGE = 0  # each group's page 0: never allocated; unused and released entries point here


def pages_touched(positions: int, page_size: int) -> int:
    """The most pages that `positions` consecutive positions can touch (starting at a page's
    last slot): (positions + P - 2) // P + 1."""
    return (positions + page_size - 2) // page_size + 1


def value_modes(spec: ModelSpec, eliminate_bank_v: bool = True) -> tuple[str, ...]:
    """How each layer gets the values of past positions: OWN, BANK or V1 (module doc);
    eliminate_bank_v=False: bank layers keep their values (OWN)."""
    vp = spec.value_path

    def mode(layer: int) -> str:
        if layer not in spec.targets:
            return OWN
        if vp.id_only and eliminate_bank_v:
            return BANK
        if vp.source == "v1" and vp.combine == "replace":
            return V1
        return OWN

    return tuple(mode(i) for i in range(spec.n_layer))


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str  # "k.3", "v.3", "ids"
    kind: str  # "k", "v" or "ids"
    group: int


@dataclasses.dataclass(frozen=True)
class LayerReads:
    """What one layer's attention reads: its keys' pool, its values' source and pool."""

    window: int
    mode: str  # OWN, BANK or V1
    keys: str  # a pool name
    values: str  # its own V pool, layer 0's ("v.0") for V1, "ids" for BANK


@dataclasses.dataclass(frozen=True)
class Group:
    reach: int
    pools: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    page_size: int
    n_head: int
    head_dim: int
    dtype: jnp.dtype  # of the K and V pools
    pools: tuple[Pool, ...]
    groups: tuple[Group, ...]
    layers: tuple[LayerReads, ...]

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        page_size: int,
        dtype: jnp.dtype | None = None,
        eliminate_bank_v: bool = True,
    ) -> CacheLayout:
        """The layout of `spec`'s cache; K/V in `dtype` (default: the compute dtype).
        eliminate_bank_v=False gives bank layers V pools (a V cache, for comparison)."""
        if page_size < 1:
            raise ValueError(f"page_size={page_size}; expected a positive integer")
        modes = value_modes(spec, eliminate_bank_v)
        windows = spec.windows
        reach: dict[str, int] = {}
        layers = []
        for layer, (mode, window) in enumerate(zip(modes, windows, strict=True)):
            reach[f"k.{layer}"] = window
            values = {OWN: f"v.{layer}", V1: "v.0", BANK: "ids"}[mode]
            reach[values] = max(reach.get(values, 0), window)
            layers.append(LayerReads(window, mode, f"k.{layer}", values))
        by_reach = sorted(set(reach.values()))
        groups = tuple(
            Group(r, tuple(name for name in reach if reach[name] == r)) for r in by_reach
        )
        pools = tuple(Pool(name, name.split(".")[0], by_reach.index(reach[name])) for name in reach)
        return cls(
            page_size=page_size,
            n_head=spec.n_head,
            head_dim=spec.head_dim,
            dtype=jnp.dtype(dtype or spec.compute_dtype),
            pools=pools,
            groups=groups,
            layers=tuple(layers),
        )

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def pool_shape(self, pool: Pool, pages: int) -> tuple[tuple[int, ...], jnp.dtype]:
        """(shape, dtype) of a pool of `pages` pages."""
        if pool.kind == "ids":
            return (pages, self.page_size), jnp.dtype(ID_DTYPE)
        return (self.n_head, pages, self.page_size, self.head_dim), self.dtype

    def token_bytes(self, pool: Pool) -> int:
        """Bytes one cached token takes in `pool`."""
        shape, dtype = self.pool_shape(pool, 1)
        per_page = dtype.itemsize
        for size in shape:
            per_page *= size
        return per_page // self.page_size

    def page_bytes(self, group: int) -> int:
        """Bytes of one page of `group`: one page of each of its pools."""
        pools = [p for p in self.pools if p.group == group]
        return self.page_size * sum(self.token_bytes(p) for p in pools)

    @property
    def bytes_per_token(self) -> int:
        """Bytes a token takes while every pool holds it (before any window releases it)."""
        return sum(self.token_bytes(p) for p in self.pools)

    def live_pages(self, group: int, length: int, chunk: int = 1) -> int:
        """The most pages of `group` a sequence of `length` tokens holds at once, computed in
        calls of `chunk` tokens from position 0 (the last call: what is left), as the
        allocator holds them: a call at n keeps the pages from the one holding n - reach to
        the one holding n + chunk - 1. Past the reach the count repeats every
        lcm(chunk, P) positions, so the calls up to one such period past it decide."""
        reach, size = self.groups[group].reach, self.page_size

        def held(start: int) -> int:
            end = min(start + chunk, length)
            return -(-end // size) - max(0, start - reach) // size

        period = math.lcm(chunk, size)
        starts = range(0, min(length, reach + period + chunk), chunk)
        return max(held(n) for n in (*starts, (length - 1) // chunk * chunk))

    def sequence_bytes(self, length: int, chunk: int = 1) -> int:
        """The most bytes of pages a sequence of `length` tokens holds at once."""
        return sum(
            self.live_pages(g, length, chunk) * self.page_bytes(g) for g in range(len(self.groups))
        )

    def pages_for(self, sequences: int, length: int, chunk: int) -> tuple[int, ...]:
        """Pages per group (the null page included) for `sequences` sequences of `length`
        tokens decoding at once while one more prefills `chunk` tokens a call."""
        return tuple(
            sequences * self.live_pages(g, length) + self.live_pages(g, length, chunk) + 1
            for g in range(len(self.groups))
        )

    def sequences_within(self, budget: int, length: int, chunk: int) -> int:
        """The most sequences of `length` tokens whose pages (`pages_for`) fit in `budget`
        bytes (0 if not even one does)."""
        fixed = sum(
            (self.live_pages(g, length, chunk) + 1) * self.page_bytes(g)
            for g in range(len(self.groups))
        )
        return max(0, (budget - fixed) // self.sequence_bytes(length))

    def describe(self) -> str:
        """One line per group: its reach, pools and bytes per page."""
        lines = []
        for index, group in enumerate(self.groups):
            names = compact_names(group.pools)
            lines.append(
                f"group {index}: reach {group.reach}, {len(group.pools)} pools ({names}), "
                f"{self.page_bytes(index):,} bytes a page of {self.page_size} tokens"
            )
        return "\n".join(lines)


def compact_names(names: Sequence[str]) -> str:
    """'k.0-3, v.0-2, ids' for k.0 k.1 k.2 k.3 v.0 v.1 v.2 ids."""
    by_kind: dict[str, list[int]] = {}
    for name in names:
        kind, _, layer = name.partition(".")
        by_kind.setdefault(kind, []).extend([int(layer)] if layer else [])
    parts = []
    for kind, layers in by_kind.items():
        runs: list[list[int]] = []
        for layer in layers:
            if runs and runs[-1][1] == layer - 1:
                runs[-1][1] = layer
            else:
                runs.append([layer, layer])
        spans = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        parts.append(f"{kind}.{spans}" if layers else kind)
    return ", ".join(parts)

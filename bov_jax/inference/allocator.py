"""Which pages each sequence holds: per group a free list and a block list per sequence.

A sequence's block list in a group maps its logical pages (page j holds positions j * P ..
j * P + P - 1) to pages of that group's pools. Pages are taken as the sequence grows and
released once no query of it can reach them again (`release_behind`: the group's reach,
`layout`), their entries then pointing at the null page. Host-side Python only: the device
sees the block lists as the rows of each step's tables.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from bov_jax.inference.layout import NULL_PAGE, CacheLayout


class PageAllocator:
    def __init__(self, layout: CacheLayout, pages: Sequence[int], width: int):
        """pages[g]: pages in group g's pools, the null page included; width: logical
        pages a sequence may use (its block table's length)."""
        if len(pages) != len(layout.groups) or min(pages) < 2:
            raise ValueError(
                f"pages={list(pages)}; expected >= 2 pages for each of the "
                f"{len(layout.groups)} groups"
            )
        self.layout, self.width, self.pages = layout, width, tuple(pages)
        self._free = [list(range(n - 1, NULL_PAGE, -1)) for n in pages]
        self._blocks: dict[Hashable, list[list[int]]] = {}

    def free_pages(self, group: int) -> int:
        return len(self._free[group])

    def used_pages(self, group: int) -> int:
        return self.pages[group] - 1 - len(self._free[group])

    def reserve(self, seq: Hashable, length: int) -> bool:
        """Give `seq` pages for positions 0 .. length - 1 in every group (those released
        stay released); False, taking nothing, if some group has too few free pages."""
        if length > self.width * self.layout.page_size:
            raise ValueError(f"length {length} exceeds {self.width} pages")
        blocks = self._blocks.setdefault(seq, [[] for _ in self.layout.groups])
        need = -(-length // self.layout.page_size)
        missing = [max(0, need - len(b)) for b in blocks]
        if any(m > len(free) for m, free in zip(missing, self._free, strict=True)):
            return False
        for block, free, count in zip(blocks, self._free, missing, strict=True):
            block.extend(free.pop() for _ in range(count))
        return True

    def release_behind(self, seq: Hashable, computed: int) -> None:
        """Release the pages of `seq` lying wholly before computed - reach in each group:
        queries at positions >= computed cannot reach them."""
        size = self.layout.page_size
        for group, free, block in zip(
            self.layout.groups, self._free, self._blocks.get(seq, ()), strict=False
        ):
            for j in range(min(len(block), max(0, computed - group.reach) // size)):
                if block[j] != NULL_PAGE:
                    free.append(block[j])
                    block[j] = NULL_PAGE

    def free(self, seq: Hashable) -> None:
        """Return every page of `seq` (none if it was never given any)."""
        for free, block in zip(self._free, self._blocks.pop(seq, ()), strict=False):
            free.extend(page for page in block if page != NULL_PAGE)

    def held(self, seq: Hashable) -> tuple[int, ...]:
        """Pages `seq` holds in each group."""
        blocks = self._blocks.get(seq, [[] for _ in self.layout.groups])
        return tuple(sum(page != NULL_PAGE for page in block) for block in blocks)

    def tables(self, seqs: Sequence[Hashable | None], rows: int) -> tuple[np.ndarray, ...]:
        """Per group the (rows, width) int32 block tables of `seqs` (None, and rows past
        them: padding, all null)."""
        out = [np.zeros((rows, self.width), np.int32) for _ in self.layout.groups]
        for row, seq in enumerate(seqs):
            for table, block in zip(out, self._blocks.get(seq, ()), strict=False):
                table[row, : len(block)] = block
        return tuple(out)

"""Which pages each sequence holds: per group a free list and a block list per sequence.

A sequence's block list in a group maps its logical pages (page j holds positions j * P ..
j * P + P - 1) to pages of that group's pools. Pages are taken as the sequence grows and
released once no query of it can reach them again (`release_behind`: the group's reach,
`layout`), their entries then pointing at the null page. Sequences with a common prefix may
hold the same full pages (`share`): each page counts its holders, and goes back to the free
list when the last one releases it. Host-side Python only: the device sees the block lists
as the rows of each step's tables.
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
        self._holders: list[dict[int, int]] = [{} for _ in pages]  # page -> sequences holding it
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
        for group, (block, free, count) in enumerate(zip(blocks, self._free, missing, strict=True)):
            for _ in range(count):
                block.append(free.pop())
                self._holders[group][block[-1]] = 1
        return True

    def share(self, seq: Hashable, donor: Hashable, length: int) -> bool:
        """Give `seq`, which holds nothing, the pages of `donor` for positions 0 .. length - 1
        (length a multiple of the page size) that a query at `length` can reach in each group;
        False, giving nothing, if the donor has released one of them."""
        size = self.layout.page_size
        blocks = []
        for group, block in zip(self.layout.groups, self._blocks.get(donor, ()), strict=True):
            first = max(0, length - group.reach) // size
            reached = block[first : length // size]
            if len(reached) < length // size - first or NULL_PAGE in reached:
                return False
            blocks.append([NULL_PAGE] * first + reached)
        for holders, block in zip(self._holders, blocks, strict=True):
            for page in block:
                if page != NULL_PAGE:
                    holders[page] += 1
        self._blocks[seq] = blocks
        return True

    def _let_go(self, group: int, page: int) -> None:
        """One holder fewer for `page`; free once it has none."""
        holders = self._holders[group]
        holders[page] -= 1
        if not holders[page]:
            del holders[page]
            self._free[group].append(page)

    def release_behind(self, seq: Hashable, computed: int) -> None:
        """Release the pages of `seq` lying wholly before computed - reach in each group:
        queries at positions >= computed cannot reach them."""
        size = self.layout.page_size
        for g, (group, block) in enumerate(
            zip(self.layout.groups, self._blocks.get(seq, ()), strict=False)
        ):
            for j in range(min(len(block), max(0, computed - group.reach) // size)):
                if block[j] != NULL_PAGE:
                    self._let_go(g, block[j])
                    block[j] = NULL_PAGE

    def free(self, seq: Hashable) -> None:
        """Let go of every page of `seq` (none if it was never given any)."""
        for group, block in enumerate(self._blocks.pop(seq, ())):
            for page in block:
                if page != NULL_PAGE:
                    self._let_go(group, page)

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

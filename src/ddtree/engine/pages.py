"""KV pages: a free list, and the per-request block tables built from it.

Host-side bookkeeping only (plain Python and one CPU tensor); the device copy of the block table
is refreshed from `BlockManager.table` before each round.
"""

from __future__ import annotations

from collections import deque

import torch


class KVCacheFull(RuntimeError):
    """Not enough free KV pages for what was asked; raised before any page is taken."""


def pages_for(rows: int, page_size: int) -> int:
    """Pages that hold `rows` consecutive slots from slot 0."""
    return -(-rows // page_size)


class PageAllocator:
    """A free list of page ids 0 .. num_pages - 1 (a page belongs to one request at a time)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = deque(range(num_pages))
        self._taken = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages; raises KVCacheFull, taking none, if short."""
        if count > len(self._free):
            raise KVCacheFull(f"asked for {count} KV pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(count)]
        for p in pages:
            self._taken[p] = True
        return pages

    def release(self, pages: list[int]) -> None:
        """Give `pages` back to the free list."""
        for p in pages:
            if not self._taken[p]:
                raise ValueError(f"page {p} released more often than it was taken")
            self._taken[p] = False
            self._free.append(p)


class BlockManager:
    """Pages of each request slot, admission by worst case, and the block table.

    Admission promises a request the pages of its longest possible life (prompt + max new tokens +
    one verify's rows), so a running request never runs out mid-generation; pages themselves are
    taken lazily, round by round, as the request's prefix grows (`reserve`).

    table: int32 [max_batch, pages_per_request] on the host, -1 where a slot has no page.
    """

    def __init__(self, num_pages: int, page_size: int, max_batch: int, pages_per_request: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.table = torch.full((max_batch, pages_per_request), -1, dtype=torch.int32)
        self._pages: dict[int, list[int]] = {}
        self._promised: dict[int, int] = {}

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_promised(self) -> int:
        return sum(self._promised.values())

    def can_admit(self, worst_rows: int) -> bool:
        """Whether a request that may grow to `worst_rows` cache slots fits beside the running ones."""
        return self.num_promised + pages_for(worst_rows, self.page_size) <= self.num_pages

    def admit(self, slot: int, worst_rows: int, request_id: str) -> None:
        need = pages_for(worst_rows, self.page_size)
        if need > self.table.shape[1]:
            raise KVCacheFull(
                f"request {request_id} may need {need} KV pages ({worst_rows} slots of {self.page_size}), "
                f"more than the {self.table.shape[1]} a block table holds"
            )
        if not self.can_admit(worst_rows):
            raise KVCacheFull(
                f"request {request_id} may need {need} KV pages; {self.num_pages - self.num_promised} of "
                f"num_pages={self.num_pages} are not promised to running requests"
            )
        if slot in self._pages:
            raise ValueError(f"slot {slot} is already in use")
        self._pages[slot] = []
        self._promised[slot] = need

    def reserve(self, needs: list[tuple[int, int, str]]) -> None:
        """Make each (slot, rows, request_id) own pages for its first `rows` cache slots.

        All needs are checked before any page is taken: if the pool is short, KVCacheFull names the
        request and the limit, and nothing has changed.
        """
        extra = []
        for slot, rows, request_id in needs:
            want = pages_for(rows, self.page_size)
            if want > self._promised[slot]:
                raise KVCacheFull(
                    f"request {request_id} needs {want} KV pages for {rows} slots, more than the "
                    f"{self._promised[slot]} promised at admission"
                )
            extra.append(max(0, want - len(self._pages[slot])))
        if sum(extra) > self.num_free:
            slot, rows, request_id = next(n for n, e in zip(needs, extra) if e)
            raise KVCacheFull(
                f"request {request_id} needs {pages_for(rows, self.page_size)} KV pages for {rows} slots; "
                f"{self.num_free} of num_pages={self.num_pages} are free ({sum(extra)} wanted this round)"
            )
        for (slot, _, _), count in zip(needs, extra):
            if count:
                held = self._pages[slot]
                new = self.allocator.allocate(count)
                self.table[slot, len(held) : len(held) + count] = torch.tensor(new, dtype=torch.int32)
                held.extend(new)

    def pages(self, slot: int) -> list[int]:
        return list(self._pages[slot])

    def free(self, slot: int) -> None:
        """Give back every page of `slot` and its promise; its table row goes back to -1."""
        self.allocator.release(self._pages.pop(slot))
        self._promised.pop(slot)
        self.table[slot] = -1

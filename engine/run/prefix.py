"""Prompt openings kept for reuse: the keys and values of prompts the batch engine prefilled, so that a later request
that opens with the same tokens starts from them and prefills only the rest, as vLLM's automatic prefix caching and
SGLang's radix cache do. A request that repeats a kept prompt whole computes only its last prompt token, whose logits
give its first output token, as one more row of the running decode (engine.run.batch). The entries are copies of the
prefilled caches (a sequence's own cache grows and is freed as it runs), kept least recently used first out, within a
number of bytes; an opening that a later entry shared and took in the index is found again only through that entry
while it is kept. A cache whose next forward is the kernels' decode step (the request repeats a kept prompt whole)
reads its positions where the entry keeps them (engine.model.lean's OpeningLayer): every sequence decoding after the
same prompt attends over one set of them, which stays in the processor's caches, instead of a copy each from memory,
and the entry is not let go while a cache reads it; any other forward would copy them into the sequence's own cache,
so such a cache is given a copy from the start.

Each position's keys and values are those of the tokens before it, whichever sequence computed them, so a reused
opening is the one the request would compute alone, to the bit where the products do not depend on the rows beside
them; its remaining tokens then run as a prefill chunk does after an earlier chunk (a single one is a decode step's
row, which attends with the sums of the prompt's own last row)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from transformers.cache_utils import DynamicLayer

from engine.model.lean import first_positions, open_with, unshare

# openings are looked up a block of tokens at a time, then extended token by token: a kept prompt shorter than a
# block is found only when a request repeats it whole
BLOCK = 16


def reusable(kinds: list[tuple[type, dict]]) -> bool:
    """Whether caches of these layers (engine.model.lean.cache_layer_kinds) keep every position, so an opening can be
    copied from one to another (a sliding window's layer keeps only its last ones)."""
    return all(kind is DynamicLayer for kind, _ in kinds)


class Prefixes:
    """Kept prompts' keys and values, within capacity_bytes (bytes_per_position each position)."""

    def __init__(self, capacity_bytes: int, bytes_per_position: int):
        self.capacity, self.per_position = capacity_bytes, bytes_per_position
        self.entries: OrderedDict[tuple[int, ...], list[tuple]] = OrderedDict()  # least recently used first
        self.index: dict[tuple[int, ...], tuple[int, ...]] = {}  # each entry's block openings and whole ids
        self.positions = 0
        self.queried_tokens = self.hits = self.reused_tokens = 0  # as vLLM counts its prefix cache's (in tokens)

    @property
    def bytes(self) -> int:
        return self.positions * self.per_position

    def __len__(self) -> int:
        return len(self.entries)

    def longest(self, ids: list[int]) -> tuple[tuple[int, ...] | None, int]:
        """The kept entry that opens with the most of ids, and how many of its tokens it shares (0: none)."""
        best = self.index.get(tuple(ids))  # an entry that opens with all of ids
        if best is not None:
            return best, len(ids)
        blocks = 0
        while (blocks + 1) * BLOCK <= len(ids) and (found := self.index.get(tuple(ids[:(blocks + 1) * BLOCK]))):
            best, blocks = found, blocks + 1
        if best is None:
            return None, 0
        shared, most = blocks * BLOCK, min(len(best), len(ids))
        while shared < most and best[shared] == ids[shared]:
            shared += 1
        return best, shared

    def opening(self, ids: list[int]) -> tuple[tuple[int, ...] | None, int]:
        """The kept entry a request of ids would open with and how many positions it would take from it: all it
        shares but the last token of ids, whose logits give the next token ((None, 0): none)."""
        entry, shared = self.longest(ids)
        shared = min(shared, len(ids) - 1)
        return (entry, shared) if shared > 0 else (None, 0)

    def reuse(self, ids: list[int], cache, found: tuple[tuple[int, ...], int] | None = None
              ) -> tuple[tuple[int, ...] | None, int]:
        """Open the empty cache with a kept opening of ids: found (a kept entry and its positions, from opening()),
        read where it is kept, or where none is given the longest one kept, copied into the cache. The entry the cache
        reads (None where it reads none) and the positions the cache holds now."""
        entry, shared = found or self.opening(ids)
        self.queried_tokens += len(ids)
        if entry is None:
            return None, 0
        self.entries.move_to_end(entry)
        open_with(cache, self.entries[entry], shared)
        if found is None:
            unshare(cache)
        self.hits += 1
        self.reused_tokens += shared
        return (entry if found is not None else None), shared

    def keep(self, ids: list[int], cache, room_bytes: int | None = None,
             in_use: Callable[[], Collection] = tuple) -> None:
        """Keep a copy of the prefilled cache's first len(ids) positions, unless a kept entry holds them already;
        the least recently used entries but those in_use() gives (caches read them; asked only where entries must
        make way) make way, within the capacity and room_bytes (what a KV budget leaves)."""
        key = tuple(ids)
        if key in self.entries:  # kept, though a later entry that took its openings in the index may have gone
            for opening in self._openings(key):
                self.index.setdefault(opening, key)
            return
        if self.longest(ids)[1] == len(key):
            return
        limit = self.capacity if room_bytes is None else min(self.capacity, room_bytes)
        need = len(key) * self.per_position
        if need > limit:
            return
        if self.bytes + need > limit:
            reading = in_use()
            while self.bytes + need > limit:
                if not self.evict(reading):
                    return
        self.entries[key] = [first_positions(layer, len(key)) for layer in cache.layers]
        self.positions += len(key)
        for opening in self._openings(key):
            self.index[opening] = key

    def evict(self, in_use: Collection = ()) -> bool:
        """Drop the least recently used entry that no cache reads (none of in_use): letting one go that a cache
        reads would free no memory. False when there is none."""
        key = next((key for key in self.entries if key not in in_use), None)
        if key is None:
            return False
        del self.entries[key]
        self.positions -= len(key)
        for opening in self._openings(key):
            if self.index.get(opening) == key:  # else a later entry holds it too
                del self.index[opening]
        return True

    @staticmethod
    def _openings(key: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [key[:blocks * BLOCK] for blocks in range(1, len(key) // BLOCK + 1)] + [key]

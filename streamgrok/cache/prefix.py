"""Prefix sharing: full pages of identical leading text are stored once.

Pages are identified by a hash chain over their token ids (each hash covers the whole prefix
up to and including that page). An entry records, for every layer, the page holding those
tokens and that page's generation; a page rewritten in place or freed gets a new generation,
so stale entries are recognised and dropped on lookup without explicit invalidation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixEntry:
    tokens: tuple[int, ...]
    pages: tuple[int, ...]  # one page per layer
    generations: tuple[int, ...]


def chain_hashes(tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Hash of every full page, each chained to the hashes before it."""
    hashes, previous = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(",".join(map(str, tokens[start : start + page_size])).encode())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Maps prefix hashes to the pages that hold them."""

    def __init__(self, page_size: int, max_entries: int = 4096) -> None:
        self.page_size = page_size
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(
        self, tokens: Sequence[int], generation: Sequence[int]
    ) -> list[PrefixEntry]:
        """Entries for the longest run of leading full pages that are cached and current."""
        found = []
        for i, key in enumerate(chain_hashes(tokens, self.page_size)):
            entry = self._entries.get(key)
            chunk = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            if entry is None or entry.tokens != chunk:
                break
            if any(generation[p] != g for p, g in zip(entry.pages, entry.generations)):
                del self._entries[key]
                break
            self._entries.move_to_end(key)
            found.append(entry)
        return found

    def publish(
        self,
        tokens: Sequence[int],
        pages_per_layer: Sequence[Sequence[int]],
        generation: Sequence[int],
    ) -> int:
        """Record the full pages of `tokens` (page i of every layer); returns pages recorded."""
        hashes = chain_hashes(tokens, self.page_size)
        for i, key in enumerate(hashes):
            pages = tuple(layer[i] for layer in pages_per_layer)
            self._entries[key] = PrefixEntry(
                tuple(tokens[i * self.page_size : (i + 1) * self.page_size]),
                pages,
                tuple(generation[p] for p in pages),
            )
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return len(hashes)

"""Which pool holds which page, as the pools' KV events tell it.

Keys are the hashes the events carry (16-byte big-endian chain hashes, or
vLLM's int form of them, as each pool sends them). Each hash maps
to a bitmask of the pools that hold it, so a prompt's walk over its pages is
one dict lookup per page whatever the number of pools; each pool also keeps
the set of its hashes, so that an AllBlocksCleared (or a lost batch) forgets
that pool in O(its pages).
"""

from __future__ import annotations

from typing import Any


class PageIndex:
    """Hash -> pools bitmask, plus each pool's own hash set."""

    def __init__(self, num_pools: int) -> None:
        self.where: dict[bytes | int, int] = {}
        self.held: list[set[bytes | int]] = [set() for _ in range(num_pools)]
        # While a list: every change, (pool, hash, added), for undo() (Router.feed_many).
        self.journal: list[tuple[int, Any, bool]] | None = None

    def add(self, pool: int, hashes: list[Any]) -> None:
        # int(): a numpy pool index would make every mask it touches a fixed-width numpy int.
        bit, held, where = 1 << int(pool), self.held[pool], self.where
        for h in hashes:
            if h not in held:
                held.add(h)
                where[h] = where.get(h, 0) | bit
                if self.journal is not None:
                    self.journal.append((pool, h, True))

    def remove(self, pool: int, hashes: list[Any]) -> None:
        clear, held, where = ~(1 << int(pool)), self.held[pool], self.where
        for h in hashes:
            if h in held:
                held.discard(h)
                m = where[h] & clear
                if m:
                    where[h] = m
                else:
                    del where[h]
                if self.journal is not None:
                    self.journal.append((pool, h, False))

    def undo(self, pool: int) -> None:
        """Take back the journal's changes (all to ``pool``), newest first, and stop journaling."""
        log, self.journal = self.journal or [], None
        for p, h, added in reversed(log):
            assert p == pool
            if added:
                self.remove(p, [h])
            else:
                self.add(p, [h])

    def forget(self, pool: int) -> None:
        self.remove(pool, list(self.held[pool]))

    def depths(self, keys: list[Any], alive: int, num_pools: int, also: list[Any] | None = None) -> list[int]:
        """Leading pages of ``keys`` each pool holds (pools outside ``alive``: 0); with
        ``also`` (the same pages' other form), a page held under either key counts."""
        depth = [0] * num_pools
        where = self.where
        j = 0
        for k in keys:
            m = where.get(k, 0)
            if also is not None:
                m |= where.get(also[j], 0)
            m &= alive
            if m != alive:
                gone = alive & ~m
                while gone:
                    low = gone & -gone
                    depth[low.bit_length() - 1] = j
                    gone ^= low
                alive = m
                if not alive:
                    return depth
            j += 1
        while alive:
            low = alive & -alive
            depth[low.bit_length() - 1] = j
            alive ^= low
        return depth

    def __len__(self) -> int:
        return len(self.where)


__all__ = ["PageIndex"]

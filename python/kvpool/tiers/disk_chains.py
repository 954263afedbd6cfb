"""What ``DiskCache`` knows of its pool's registered pages, learnt from the pool's KV
events: each page's parent link, tokens and salt, on which media it is cached, and
which device pages are not on disk yet (pending)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.tiers.backend import page_key

__all__ = ["DEVICE_MEDIUM", "Entry", "RegisteredChains"]

STORED, REMOVED, CLEARED = 0, 1, 2
DEVICE_MEDIUM = 0


@dataclass
class Entry:
    parent: int
    tokens: np.ndarray
    salt: int
    media: set = field(default_factory=set)


class RegisteredChains:
    """``entries``: pool hash -> chain link of every registered page; ``pending``: pool
    hashes of device pages to store, in the order they were registered."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}
        self.pending: dict[int, None] = {}

    def absorb(self, ev: dict[str, np.ndarray]) -> None:
        """Take a batch of events (``take_events()`` arrays)."""
        kinds = ev["kind"]
        if len(kinds) == 0:
            return
        keys = [page_key(hi, lo) for hi, lo in zip(ev["hash_hi"], ev["hash_lo"])]
        parents = [page_key(hi, lo) for hi, lo in zip(ev["parent_hi"], ev["parent_lo"])]
        media = ev.get("medium", np.zeros(len(kinds), dtype=np.int64))
        ntok = ev["num_tokens"]
        toks = ev["token_ids"]
        off = 0
        for i, kind in enumerate(kinds):
            if kind == CLEARED:
                self.entries.clear()
                self.pending.clear()
            elif kind == STORED:
                n = int(ntok[i])
                e = self.entries.get(keys[i])
                if e is None:
                    e = self.entries[keys[i]] = Entry(parents[i], np.array(toks[off : off + n], dtype=np.int32),
                                                      int(ev["salt"][i]))
                e.media.add(int(media[i]))
                if int(media[i]) == DEVICE_MEDIUM:
                    self.pending[keys[i]] = None
                off += n
            elif kind == REMOVED:
                e = self.entries.get(keys[i])
                if e is not None:
                    e.media.discard(int(media[i]))
                    if not e.media:
                        del self.entries[keys[i]]
                        self.pending.pop(keys[i], None)

    def chain(self, key: int) -> list[int] | None:
        """Pool hashes from the chain's first page to ``key``; None if a link is unknown
        (or the links loop, which only malformed events could make)."""
        chain: list[int] = []
        while key:
            e = self.entries.get(key)
            if e is None or len(chain) > len(self.entries):
                return None
            chain.append(key)
            key = e.parent
        return chain[::-1]

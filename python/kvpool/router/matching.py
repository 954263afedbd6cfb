"""PrefixMatching: how many of a prompt's tokens each pool would serve from its cache.

The prompt is hashed as the pools hash it (``page_hashes`` with the router's page
size, hash seed and the request's salt), and the router's ``PageIndex`` gives each
pool's depth of consecutive held pages, in whichever key form (16-byte hashes or
vLLM's int form) the pools' events used. A mixin of ``Router`` (kept apart so
router.py holds the routing decision, and event_streams.py the pools' event streams).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError, page_hashes
from kvpool._values import host_array

__all__ = ["PrefixMatching"]


class PrefixMatching:
    """``Router.match`` and the key forms it looks pages up by."""

    num_pools: int
    page_size: int
    hash_seed: int
    index: Any
    _all: Any
    _int_keys: Any
    _bytes_keys: Any

    @staticmethod
    def _keys(words: np.ndarray) -> list[bytes]:
        # (hi, lo) uint64 words -> the events' 16-byte big-endian hashes.
        return words.byteswap().view("V16").tolist()  # type: ignore[no-any-return]

    @staticmethod
    def _int_form(words: np.ndarray) -> list[int]:
        # vLLM's int form of those: the low 64 bits, unsigned.
        return words[1::2].tolist()  # type: ignore[no-any-return]

    def match(self, tokens: Any, salt: int = 0) -> list[int]:
        """Prompt tokens each pool would serve from its cache, as its
        ``open_with_prefix`` computes them: whole pages, at most
        ``len(tokens) - 1`` (a step computes at least one token)."""
        tokens = host_array("tokens", tokens)
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"tokens must be one prompt's token ids (1-D), got shape {tokens.shape}")
        if tokens.size and tokens.dtype.kind not in "iu":
            # Checked at every length: a prompt shorter than a page would otherwise pass
            # unchecked, and the same prompt a token longer be refused.
            raise InvalidArgumentError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        cap = max(len(tokens) - 1, 0) // self.page_size
        # The whole prompt is hashed, not just the pages looked up, so that its salt and every
        # token id are checked as open_with_prefix checks them (route() would otherwise count
        # a request no pool takes); at most one page more than the cap.
        words = page_hashes(tokens if tokens.size else tokens.astype(np.int64), self.page_size,
                            self.hash_seed, salt)[: 2 * cap]
        if cap == 0:
            return [0] * self.num_pools
        if self._int_keys and self._bytes_keys:  # pools of both kinds: a page held in either form
            depths = self.index.depths(self._keys(words), self._all, self.num_pools, also=self._int_form(words))
        else:
            keys = self._int_form(words) if self._int_keys else self._keys(words)
            depths = self.index.depths(keys, self._all, self.num_pools)
        return [d * self.page_size for d in depths]

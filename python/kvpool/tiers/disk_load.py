"""``DiskCache``'s load half (``prefetch``): the prompt's pages past what the pool caches,
read from the backend, verified and put into the pool (the module doc of
``kvpool.tiers.disk_cache`` says how)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool._core import ContextTooLongError, InvalidArgumentError, PoolExhaustedError, TooManyRequestsError, page_hashes
from kvpool.kernels.pages import load_pages
from kvpool.tiers.backend import PageRecord, TierBackend, page_key, shape_fingerprint, tier_seed

__all__ = ["DiskLoads"]


def _token_ids(tokens: Any) -> np.ndarray:
    """A prompt as int32 token ids, checked as ``open_with_prefix`` checks them: an id
    past int32 must not wrap onto another prompt's pages."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:  # ragged nesting
        raise InvalidArgumentError(f"tokens must be a 1-D sequence of int token ids: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens must be int token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D (one prompt), got shape {arr.shape}")
    bad = np.flatnonzero((arr < 0) | (arr > np.iinfo(np.int32).max))
    if bad.size:
        raise InvalidArgumentError(f"tokens[{int(bad[0])}] = {int(arr[bad[0]])} is not a token id; ids must be in "
                                   f"[0, {np.iinfo(np.int32).max}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


class DiskLoads:
    """Mixed into ``DiskCache``; uses its pool, backend, stats, lock and staging buffer."""

    pool: Any
    backend: TierBackend
    model: str
    stats: Any
    _calls: Any
    _staging_event: Any
    _stage: Any  # (n) -> the staging HostStorage of at least n + 1 pages
    _scratch_open: Any  # a request on a chain's cached pages, not counted as a prompt served
    _page_bytes: Any  # () -> one page's K/V bytes, a record's payload

    def prefetch(self, tokens: Any, salt: int | None = None) -> int:
        """Put the prompt's pages that the pool lacks and the backend has into the pool.

        Only full pages that ``open_with_prefix`` could use (never the prompt's last
        token), from the first page the pool does not cache, up to the first page the
        backend has no verified record for. Gives up (returns 0) when the pool has no
        room or no free request row.

        Returns:
            Pages loaded.

        Raises:
            InvalidArgumentError: ``tokens`` not a 1-D sequence of token ids in int32 range,
                or a ``salt`` that is not one int in the int64 range (whatever the prompt's
                length, as ``open_with_prefix`` refuses it).
            ContextTooLongError: a prompt longer than the pool's ``max_context_len``, which
                ``open_with_prefix`` refuses too (nothing is read or loaded).
        """
        tokens = _token_ids(tokens)
        # The salt is checked as the prompt's hashes check it, before anything else: a prompt
        # too short to hold a full page hashes nothing, and must not let a bad salt through.
        page_hashes(tokens[:0], self.pool.page_size, 0, salt)
        if len(tokens) > self.pool.max_context_len:
            # Up front: it returned 0 or raised from its own extend, by what the pool cached.
            raise ContextTooLongError(f"the prompt has {len(tokens)} tokens, more than the pool's max_context_len="
                                      f"{self.pool.max_context_len}; open_with_prefix refuses it too")
        with self._calls:
            return self._prefetch(tokens, salt)

    def _prefetch(self, tokens: np.ndarray, salt: int | None) -> int:
        p = self.pool.page_size
        n_full = max(0, (len(tokens) - 1) // p)
        if n_full == 0:
            return 0
        prefix = tokens[: n_full * p]
        pool_words = page_hashes(prefix, p, self.pool.allocator.hash_seed, salt)
        cached = self.pool.match_chain_hashes(pool_words, prefix, salt)
        if cached >= n_full or self.pool.open_requests >= self.pool.max_requests:
            return 0  # (no free row: give up before the backend is read and its records touched)
        records = self._read(prefix, cached, n_full, 0 if salt is None else int(salt))
        if not records:
            return 0
        return self._admit(prefix, pool_words, cached, records, salt)

    def _read(self, prefix: np.ndarray, start: int, stop: int, salt: int) -> list[PageRecord]:
        p = self.pool.page_size
        fp = shape_fingerprint(self.pool, self.model)
        tier = page_hashes(prefix, p, tier_seed(fp), salt)
        keys = [page_key(tier[2 * i], tier[2 * i + 1]) for i in range(stop)]
        out = []
        for i in range(start, stop):
            rec = self.backend.get(keys[i])
            if rec is None:
                self.stats.pages_missed += 1
                break
            if not rec.matches(fp, prefix[i * p : (i + 1) * p], salt, keys[i - 1] if i else 0) or len(
                    rec.payload) != self._page_bytes():
                # Under a name derived from this fingerprint, tokens and salt, a record
                # for anything else is damage (or a collision): it must not block a
                # correct record from being stored there. Only this record: one another
                # process stored under the name since the read is kept.
                self.backend.discard(rec)
                self.stats.pages_rejected += 1
                break
            out.append(rec)
        if out:
            # Every page of the hit is used, its first page most recently: eviction then
            # takes chains' tails first and never leaves a record whose parent is gone.
            self.backend.touch(keys[: start + len(out)][::-1])
        return out

    def _admit(self, prefix: np.ndarray, pool_words: np.ndarray, cached: int, records: list[PageRecord],
               salt: int | None) -> int:
        pool, p = self.pool, self.pool.page_size
        staging = self._stage(len(records))  # filled before the pool's lock is taken
        raw = staging.buffer.view(staging.host_pages, -1).view(torch.uint8)
        for i, rec in enumerate(records):
            raw[i + 1].numpy()[:] = np.frombuffer(rec.payload, dtype=np.uint8)
        with pool._lock:
            try:
                h: int | None = self._scratch_open(pool_words[: 2 * cached], prefix[: cached * p], salt, cached)
            except TooManyRequestsError:
                return 0  # another thread took the last free row since the check in _prefetch
            try:
                if pool.length(h) != cached * p:
                    return 0  # the cached part shrank meanwhile: a later call retries
                # free_pages counts the evictable cached pages already (pinned ones are not free).
                m = min(len(records), int(pool.free_pages))
                if m == 0:
                    return 0
                try:
                    pool.extend(np.array([h], dtype=np.int64), np.array([m * p], dtype=np.int64),
                                tokens=prefix[cached * p : (cached + m) * p])
                except PoolExhaustedError:
                    return 0
                dev_pages = pool.pages(h)[cached : cached + m].astype(np.int64)
                load_pages(staging, pool._storage.caches, np.arange(1, m + 1, dtype=np.int64), dev_pages)
                order = getattr(pool, "_order", None)
                if order is not None:
                    # Published below and hit at once, maybe from the engine's stream: the
                    # pool's next page hand-out on another stream waits for this load first.
                    order.copied()
                if pool.device.type == "cuda":  # the staging buffer is reused once this load has run
                    self._staging_event = torch.cuda.Event()
                    self._staging_event.record(torch.cuda.current_stream(pool.device))
                pool.close(np.array([h], dtype=np.int64), cache=True)
                h = None
                self.stats.pages_loaded += m
                return m
            finally:
                # (A close(cache=True) whose write-through offloads then failed has closed the
                # request before raising; closing it again would replace that error. The pool's
                # lock is held: no other request can have taken its row meanwhile.)
                if h is not None and pool.is_open(h):
                    pool.close(np.array([h], dtype=np.int64))

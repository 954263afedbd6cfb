"""``DiskCache``: a pool's cached prefixes kept in a ``TierBackend`` (e.g. ``FileTier``)
across restarts, with today's public pool API (no core tier needed).

STORE (``store_new``): the pool's Stored events name every page ``cache()``
registered (hash, parent hash, token ids, salt). ``DiskCache`` keeps the
chain structure of the registered pages from those events, and for each
chain with pages not yet stored it opens a scratch request holding the chain
(``open_with_chain_hashes``: the core verifies it is still registered and
hands out its current pages, which then cannot be evicted), copies those
pages to host memory (``offload_pages``), waits for that copy, closes the
scratch request and writes one record per page. Stale events are harmless:
a chain no longer registered is skipped.

LOAD (``prefetch``): for a prompt, the pages past what the pool caches are
read from the backend and verified (fingerprint, token ids, salt, parent:
by induction from the first page, the whole prefix); the verified run is
put into the pool by a scratch request that holds the cached part, is
extended with those pages' token ids, gets their K/V (``load_pages``) and is
closed with ``cache=True``. The next ``open_with_prefix`` of the prompt hits.

Names: records are filed by the core's chain hash under a seed derived
from the fingerprint (``tier_seed``), not the pool's ``hash_seed`` (random
unless given), so a new process finds what an earlier one wrote whatever
its seed, and pools of different models never collide on a name. The
fingerprint covers the model shape (layers, KV heads and this rank's shard
of them, head_dim, dtype, page size, MLA ranks; not the layout, which does
not change the bytes), fp8 scales (the bytes mean nothing without them) and
a caller-given ``model`` string (name and revision: two models of the same
shape must not share pages).

Both calls block the calling thread on disk I/O, and ``store_new`` on the
device (it waits for its copy): run them off the step loop (between steps,
or from a helper thread: the pool's calls are thread-safe).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool._core import InvalidArgumentError, TooManyRequestsError, page_hashes
from kvpool._forksafe import OUTER, OwnedLock
from kvpool._forksafe import track as track_for_fork
from kvpool._nopickle import NotPicklable
from kvpool.events.drained import checked_events
from kvpool.events.drainers import claim_self_drain, publisher_of
from kvpool.kernels.pages import offload_pages
from kvpool.tiers.backend import PageRecord, TierBackend, check_model_name, page_key, record_bytes, shape_fingerprint, tier_seed
from kvpool.tiers.disk_chains import RegisteredChains
from kvpool.tiers.disk_load import DiskLoads
from kvpool.tiers.host_storage import HostStorage
from kvpool.validate import require_plain_pool

__all__ = ["DiskCache", "shape_fingerprint"]

def _page_bytes(pool: Any) -> int:
    """One page's K/V bytes across layers (a host page's, a record's payload)."""
    return (1 if pool.mla else 2) * pool.num_layers * pool.page_size * pool.num_kv_heads * pool.head_dim * \
        pool.dtype.itemsize


@dataclass
class DiskStats:
    """Cumulative counts of a ``DiskCache``."""

    pages_stored: int = 0
    pages_loaded: int = 0
    pages_missed: int = 0  # looked up, no intact record
    pages_rejected: int = 0  # an intact record that is not the expected page
    chains_skipped: int = 0  # no longer registered, or their start unknown
    write_failures: int = 0  # pages the backend refused to store (kept for the next store_new)


class DiskCache(DiskLoads, NotPicklable):
    """A pool's prefix cache on a ``TierBackend`` (see the module doc).

    Args:
        pool: a ``KVPool`` (recording events: ``kv_events=True``, the default, from its start).
        backend: where pages go (e.g. ``FileTier(path, max_bytes)``).
        model: what model (and revision) wrote the K/V: part of the fingerprint.

    Raises:
        InvalidArgumentError: ``pool`` is not a plain ``KVPool`` or records no KV events
            (``kv_events=False``), ``backend`` not a ``TierBackend`` or too small for one
            page record, or ``model`` not a str of UTF-8 text.

    Calls from several threads run one at a time (the cache's lock, taken before the
    pool's): ``store_new`` and ``prefetch`` stage pages through one host buffer.
    """

    _pickle_refusal = "it mirrors a pool of this process and holds its staging buffer"

    def __init__(self, pool: Any, backend: TierBackend, *, model: str = "") -> None:
        require_plain_pool(pool, "DiskCache")  # before store_new drains a hybrid pool's events
        if not pool.kv_events:
            raise InvalidArgumentError(
                "DiskCache needs a pool built with kv_events=True (the default): it learns which pages "
                "to store from the pool's Stored events, and this pool records none, so nothing would "
                "ever be stored")
        if not isinstance(backend, TierBackend):
            raise InvalidArgumentError(f"backend must be a TierBackend (e.g. FileTier(path, max_bytes)), "
                                       f"got {type(backend).__name__}")
        check_model_name(model)
        need = record_bytes(pool.page_size, _page_bytes(pool))
        if backend.max_bytes < need:
            raise InvalidArgumentError(f"backend.max_bytes = {backend.max_bytes} cannot hold one page record of "
                                       f"this pool; it must be at least {need} bytes")
        self.pool, self.backend, self.model = pool, backend, model
        self._fit = backend.max_bytes // need  # page records the backend holds at most
        self.stats = DiskStats()
        self._chains = RegisteredChains()
        self._entries = self._chains.entries  # pool hash -> chain link, for registered pages
        self._pending = self._chains.pending  # pool hashes to store (insertion ordered)
        self._staging: HostStorage | None = None
        self._staging_event: Any = None
        # Held for the whole of store_new and prefetch: both fill and read the one staging
        # buffer (and the chain state), so a prefetch interleaved with a store_new on another
        # thread would load the pages store_new copied there under the prompt's hashes.
        self._calls = OwnedLock()  # (held around user code, which may fork: see _forksafe)
        track_for_fork(self, "_calls", OUTER)

    # ----- events -> chains (disk_chains.py) -----------------------------

    def _absorb(self, ev: dict[str, np.ndarray]) -> None:
        self._chains.absorb(ev)

    def _chain(self, key: int) -> list[int] | None:
        return self._chains.chain(key)

    # ----- store ----------------------------------------------------------

    def store_new(self, events: dict[str, np.ndarray] | None = None, *, max_pages: int | None = None) -> int:
        """Write the pages registered since the last call that the backend lacks.

        Args:
            events: the pool's drained events (an engine that publishes them too passes
                what it drained); None drains ``pool.take_events()`` here.
            max_pages: write at most this many pages now; the rest wait for the next call.

        Returns:
            Pages written. A page the backend refuses (a full disk) stays pending while
            the pool caches it, for a later call (``stats.write_failures``).

        Raises:
            InvalidArgumentError: ``events`` is not what this pool's ``take_events()`` returns,
                ``events`` is None while an event publisher, or another live ``DiskCache``
                that drained by itself, drains the pool (it would miss what this drained),
                or ``max_pages`` is not None or an int >= 0
                (nothing is absorbed or stored).
        """
        if max_pages is not None and (isinstance(max_pages, (bool, np.bool_))
                                      or not isinstance(max_pages, numbers.Integral) or max_pages < 0):
            raise InvalidArgumentError(f"max_pages must be None or an int >= 0, got {max_pages!r}")
        with self._calls:
            return self._store_new(events, max_pages)

    def _store_new(self, events: dict[str, np.ndarray] | None, max_pages: int | None) -> int:
        if events is None and (pub := publisher_of(self.pool)) is not None:
            raise InvalidArgumentError(
                f"store_new() would drain this pool's events, which a {type(pub).__name__} publishes: each drain "
                f"takes them from every other reader, and the router behind it would miss them. Drain once and "
                f"hand the same events to both: events = pool.take_events(); disk.store_new(events); "
                f"publisher.publish(events)")
        if events is None and (other := claim_self_drain(self.pool, self)) is not None:
            raise InvalidArgumentError(
                f"store_new() would drain this pool's events, which another DiskCache (on "
                f"{str(getattr(other.backend, 'path', type(other.backend).__name__))!r:.80}) "
                f"drains by itself: each drain takes them from the other, and each would store only its share "
                f"of the pages. Drain once and hand the same events to each: events = pool.take_events(); "
                f"disk_a.store_new(events); disk_b.store_new(events)")
        # (events of a pool of another page size were taken in, then failed every later call)
        self._absorb(checked_events(events, self.pool.page_size) if events is not None else self.pool.take_events())
        fp = shape_fingerprint(self.pool, self.model)
        leaves, covered = [], set()
        for key in reversed(list(self._pending)):  # deepest first: one chain covers its ancestors
            if key not in covered:
                chain = self._chain(key)
                if chain is None:
                    self._pending.pop(key, None)
                    self.stats.chains_skipped += 1
                    continue
                leaves.append(chain)
                covered.update(chain)
        work: list[tuple[int, PageRecord, int]] = []  # (device page, record without payload, pool hash)
        handles: list[int] = []
        chains: list[tuple[int, int, list[int]]] = []  # per chain: its work items [start, stop), backend keys
        budget = int(max_pages) if max_pages is not None else len(self._pending)
        try:
            for chain in reversed(leaves):
                if len(work) >= budget:
                    break
                got = self._take_chain(chain, fp, handles, work, budget, chains)
                if got is None:
                    break  # no free request row: the rest waits for the next call
            written = self._write(work, fp, chains)
        except BaseException:
            # Taken from pending, maybe not written (an error other than a refused put: a
            # device copy, the staging buffer, the backend): pending again while the pool
            # caches them, as a refused put leaves them; the next call skips what got stored.
            for _, _, key in work:
                if key in self._entries:
                    self._pending[key] = None
            raise
        finally:
            if handles:
                self.pool.close(np.array(handles, dtype=np.int64))
        return written

    def _take_chain(self, chain: list[int], fp: bytes, handles: list[int], work: list[tuple[int, PageRecord, int]],
                    budget: int, chains: list[tuple[int, int, list[int]]]) -> int | None:
        first = self._entries[chain[0]]
        salt = first.salt
        tokens = np.concatenate([self._entries[k].tokens for k in chain])
        p = self.pool.page_size
        tier = page_hashes(tokens, p, tier_seed(fp), salt)
        tier_keys = [page_key(tier[2 * i], tier[2 * i + 1]) for i in range(len(chain))]
        todo = [i for i, k in enumerate(chain) if k in self._pending]
        todo_new = []
        for i in todo:
            if self.backend.contains(tier_keys[i]):
                self._pending.pop(chain[i], None)
            else:
                todo_new.append(i)
        if not todo_new:
            return 0
        pool_words = np.array([w for k in chain for w in (k >> 64, k & (2**64 - 1))], dtype=np.uint64)
        try:
            h = self._scratch_open(pool_words, tokens, salt)
        except TooManyRequestsError:
            return None
        handles.append(h)
        held = self.pool.length(h) // p
        pages = self.pool.pages(h)
        start = len(work)
        for i in todo_new:
            if i >= held or i >= self._fit:
                # Evicted since its event: nothing left to store. Or past the pages the backend
                # holds at all: written, it would evict its own chain's start and never be hit.
                self._pending.pop(chain[i], None)
                continue
            if len(work) >= budget:
                break
            parent = tier_keys[i - 1] if i else 0
            work.append((int(pages[i]), PageRecord(tier_keys[i], parent, salt, tokens[i * p : (i + 1) * p].copy(),
                                                   fp, b""), chain[i]))
            self._pending.pop(chain[i], None)
        if len(work) > start:
            chains.append((start, len(work), tier_keys))
        if held < len(chain):
            self.stats.chains_skipped += 1
        return len(todo_new)

    def _scratch_open(self, words: np.ndarray, tokens: np.ndarray, salt: int | None,
                      max_pages: int | None = None) -> int:
        """A request holding the pages of a chain the pool caches, for this cache's own copy:
        not a prompt served, so the pool's hit and miss counts (its hit rate, the exported
        metrics) take back what the open counted."""
        with self.pool._lock:  # a scrape (KVPool.stats holds the lock) sees neither count
            h = self.pool.open_with_chain_hashes(words, tokens, salt, max_pages)
            held = int(self.pool.length(h))
            self.pool.allocator._uncount_opens(held, len(tokens) - held, 0)
        return h

    def _write(self, work: list[tuple[int, PageRecord, int]], fp: bytes,
               chains: list[tuple[int, int, list[int]]]) -> int:
        if not work:
            return 0
        staging = self._stage(len(work))
        offload_pages(self.pool._storage.caches, staging, np.array([w[0] for w in work], dtype=np.int64),
                      np.arange(1, len(work) + 1, dtype=np.int64))
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()
        raw = staging.buffer.view(staging.host_pages, -1).view(torch.uint8)
        done: list[tuple[int, int]] = []  # (tier hash, pool key) of the records written
        refused: set[int] = set()
        for start, stop, keys in chains:
            # The chain's pages stored before (an earlier turn's) become the most recently used,
            # its first page last: these writes then evict other chains before this one's start,
            # which, older than the pages written now, went first (leaving them unreachable).
            now = {rec.page_hash for _, rec, _ in work[start:stop]}
            self.backend.touch([k for k in reversed(keys) if k not in now])
            # Deepest first: eviction during these writes takes a chain's tail before its start.
            for i in range(stop - 1, start - 1, -1):
                _, rec, pool_key = work[i]
                full = PageRecord(rec.page_hash, rec.parent_hash, rec.salt, rec.tokens, fp,
                                  raw[i + 1].numpy().tobytes())
                if self.backend.put(full):
                    done.append((rec.page_hash, pool_key))
                    continue
                refused.add(rec.page_hash)
                if pool_key in self._entries:
                    # Refused (a full disk, an I/O error): stays pending, so the next call
                    # writes it once there is room, rather than never while it stays cached.
                    self._pending[pool_key] = None
                    self.stats.write_failures += 1
            self.backend.touch(keys[::-1])  # the whole chain again, deepest first
        if refused:
            done = self._drop_orphans(done, refused, {rec.page_hash: rec.parent_hash for _, rec, _ in work})
        self.stats.pages_stored += len(done)
        return len(done)

    def _drop_orphans(self, done: list[tuple[int, int]], refused: set[int],
                      parent: dict[int, int]) -> list[tuple[int, int]]:
        """Remove the records just written below a page the backend refused: a lookup walks
        a chain from its first page, so they could never be hit, and would hold the space
        (a disk full before ``max_bytes``) that the refused page needs. They stay pending."""
        kept = []
        for page_hash, pool_key in done:
            up = parent.get(page_hash)
            while up in parent and up not in refused:
                up = parent[up]
            if up not in refused:
                kept.append((page_hash, pool_key))
                continue
            self.backend.remove(page_hash)
            if pool_key in self._entries:
                self._pending[pool_key] = None
        return kept

    def _page_bytes(self) -> int:
        return _page_bytes(self.pool)

    def _stage(self, n: int) -> HostStorage:
        """A host buffer of at least n + 1 pages, reused (grown in powers of two); waits
        for the load that last read it."""
        if self._staging_event is not None:
            self._staging_event.synchronize()
            self._staging_event = None
        if self._staging is None or self._staging.host_pages < n + 1:
            size = 1 << max(1, n).bit_length()
            self._staging = HostStorage.for_pool(self.pool, host_pages=max(2, size))
        return self._staging

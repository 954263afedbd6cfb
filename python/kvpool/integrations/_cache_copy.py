"""``copy.deepcopy`` of a ``KVPoolCache`` (plain or hybrid): transformers' prompt-reuse pattern
(``past_key_values = copy.deepcopy(prompt_cache)`` before each ``generate``).

The copy is a new cache of the same class on the SAME pool (the pool is the device memory; it
is never copied, and the memo maps it to itself), whose rows are ``pool.fork``s of the
original's: they share its pages, copy-on-write, as beam search's copies do (``_reorder``), and
a hybrid pool's fork copies the rows' state slots. Same length, same options, new layers; no
object that a later step of one changes is shared with the other. A copy is refused (typed,
nothing changed) where the original could not take a step either: a forward cut short or under
way, rows broken by a failed step, rows changed through the pool; or where the pool has no room
for the forks (``max_requests``, a hybrid pool's state slots).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.errors import CopyRefusedError, TooManyRequestsError
from kvpool.integrations._pending import undo_flush
from kvpool.integrations._row_checks import pool_lock
from kvpool.modes import persistent

__all__ = ["SHALLOW_COPY", "deep_copy"]

SHALLOW_COPY = (
    "copy.copy would share this cache's pool requests between two caches, and the first close() would "
    "give the other's rows back: use copy.deepcopy(cache), which forks the rows (copy-on-write pages)")

WHAT = "copy.deepcopy(KVPoolCache)"


def deep_copy(cache: Any, memo: dict[int, Any]) -> Any:
    """A new, independent cache of ``cache``'s class on its pool, holding forks of its rows
    (see the module docstring); the pool and the cache are left as they were when it raises."""
    pool, req = cache.pool, cache.requests
    memo[id(pool)] = pool  # (anything else deep-copied with the cache that names the pool keeps it)
    if req.handles is not None:  # (an empty or closed cache has nothing to check or fork)
        cache._check_between_steps(WHAT)  # a forward cut short or under way, rows broken by a failed step
        req.check_edits()  # rows closed, swapped out or truncated through the pool
    pages = getattr(req, "pages", None)
    layer_buffers = True if pages is None else bool(pages.layer_buffers)
    cls = type(cache)
    new = cls.__new__(cls, pool)
    cls.__init__(new, pool, layer_buffers=layer_buffers)
    memo[id(cache)] = new
    new._reset_mid = cache._reset_mid
    if req.handles is None:
        return new
    handles = _fork_rows(req)
    try:
        _take_rows(cache, new, handles)
    except BaseException:
        new.close()
        raise
    return new


def _fork_rows(req: Any) -> np.ndarray:
    """One fork per row of ``req``, made under the pool's lock after bringing the pool up to the
    rows' tokens (``flush``); all or nothing: a refused fork closes those made and puts the
    deferred steps back, leaving the pool and the cache as they were."""
    pool = req.pool
    fork = getattr(pool, "fork", None)
    if fork is None:
        raise CopyRefusedError(f"{WHAT}: the copy's rows are forks of the cache's (shared pages), and this pool "
                               "object has no fork (every kvpool.KVPool does); build a new cache and run the prompt again")
    b = int(req.handles.shape[0])
    with pool_lock(pool):
        # Again under the lock: a change by another thread since deep_copy's check would be hidden
        # by the edit count taken after the forks (and the forks would copy the changed rows).
        req.check_edits()
        most, now = int(pool.max_requests), int(pool.open_requests)
        if now + b > most:
            raise TooManyRequestsError(
                f"too many requests: {WHAT} forks the cache's {b} row{'s' if b != 1 else ''}, with {now} of "
                f"max_requests={most} already open; close a cache (or a request) first, or give the pool "
                "more rows (max_requests)")
        caught_up = getattr(req, "deferred", 0)
        req.flush()
        made: list[int] = []
        try:
            for h in req.handles.tolist():
                made.extend(int(x) for x in fork(int(h), 1))
        except BaseException:
            if made:
                pool.close(np.asarray(made, dtype=np.int64))
            req._edits = getattr(pool, "_row_edits", 0)  # (its own forks and closes)
            if caught_up:
                undo_flush(req, caught_up)
            raise
        _shared_now(req)
    return np.asarray(made, dtype=np.int64)


def _shared_now(req: Any) -> None:
    """The original's rows share every page with their forks now: a plain cache reads its page
    table from the pool from the next step on (its layer buffers gathered again), as after a
    reorder's fork; a hybrid cache reads its tables at every step already."""
    req._edits = getattr(req.pool, "_row_edits", 0)  # (its own forks)
    if hasattr(req, "_shared"):  # (BatchRequests)
        unstarted = req.prefix_unstarted
        req._shared = True
        req._set_handles(req.handles)
        req.prefix_unstarted = unstarted


def _take_rows(cache: Any, new: Any, handles: np.ndarray) -> None:
    """``new``'s requests and layers as ``cache``'s, on the forked rows ``handles``."""
    src, dst = cache.requests, new.requests
    if hasattr(dst, "_shared"):  # (BatchRequests)
        dst._shared = True
        dst._set_handles(handles)
    else:  # (HybridRequests)
        dst._set_handles(handles)
        dst.before, dst.published, dst.steps = src.before, src.published, src.steps
    dst.length, dst.prefix_mode = src.length, src.prefix_mode
    dst.cached_lens = None if src.cached_lens is None else src.cached_lens.copy()
    dst.prefix_unstarted = src.prefix_unstarted
    new._hit = cache._hit
    for a, b in zip(cache._pool_layers, new._pool_layers):
        b.seen, b.is_initialized = a.seen, a.is_initialized
    for a, b in zip(getattr(cache, "_state_layers", ()), getattr(new, "_state_layers", ())):
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                     "conv_kernel_size"):
            setattr(b, name, dict(getattr(a, name)))
        b.record_past = getattr(a, "record_past", False)
        count = getattr(a, "cumulative_length_linear", None)
        if count is not None:
            with persistent():
                b.cumulative_length_linear = count.clone()

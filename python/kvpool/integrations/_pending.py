"""The tokens a ``KVPoolCache`` holds that the pool does not yet (``_requests``): deferred decode
steps the core has not been extended by, and steps whose stores wait for the layer buffers
(``StepPages.later``). How the next flush brings the pool up to them, how a crop into them or a
refused step that had caught them up leaves the pool as it was, and how they follow pool calls
the cache did not make (``kvpool.row_edits``: a fork or swap_in moved their pages)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.integrations._row_checks import row_slots, rows_hold

__all__ = ["flush_locked", "store_below", "undo_flush"]


def flush_locked(req: Any, n: int) -> None:
    """``BatchRequests.flush`` under the pool's lock: one extend by the ``n`` deferred steps and one
    store of every pending token from the layer buffers, at the slots the rows hold now."""
    assert req.handles is not None and req.pages is not None
    parts, pool = req.unstored, req.pool
    # A counted call named the rows since their pending tokens' slots were taken (a fork, a
    # swap_in: their pages may have moved, and the extend below may copy one on write).
    moved = req._moved or (getattr(pool, "_row_edits", 0) != req._edits
                           and pool._edited_since(req._edits, req.handles))
    if moved and not rows_hold(pool, req.handles, req.length - n):
        return  # closed, swapped out or truncated through the pool: the next step refuses
    if n:
        slots = pool._extend_host(req.handles, n) if req.host_extend else None
        if slots is None:
            slots = pool.extend(req.handles, n).slots
        req.deferred = 0
        if not moved and req.batch == 1 and len(parts) == 1 and parts[0].shape == (1, 1) and all(
                x.seen == req.length for x in req.layers):
            # One row at a page's end (every flush of a batch-1 generate): its page's first token, then
            # the deferred steps', usually one run of slots, checked and stored as Python ints. Each
            # numpy call after the model's forward costs microseconds of host time (see _pages).
            first = parts[0].item()
            if slots.tolist() == list(range(first + 1, first + 1 + n)):
                req.pages.store_run(req.length - n - 1, n + 1, (first, 0))
                req.unstored = []
                return
        parts.append(np.asarray(slots, dtype=np.int64).reshape(req.batch, n))
    if moved:
        cols = sum(x.shape[1] for x in parts)
        parts, req._moved = [row_slots(pool, req.handles, req.length - cols, req.length)], False
    held = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
    # A step under way (between two of its layers) is stored with what the layers that
    # ran have added, and again by the next flush, once every layer has.
    under = req.length - req.before if any(x.seen != req.length for x in req.layers) else 0
    req.pages.store_tokens(req.length - held.shape[1], held.reshape(-1))
    req.unstored = [held[:, held.shape[1] - under :]] if under else []


def store_below(req: Any, length: int) -> None:
    """After a crop to ``length`` of rows truncated through the pool past their pending tokens:
    store those below ``length`` at the rows' slots now, and drop the rest."""
    assert req.handles is not None and req.pages is not None
    first = req.length - req.deferred - sum(x.shape[1] for x in req.unstored)
    if length > first:
        req.pages.store_tokens(first, row_slots(req.pool, req.handles, first, length).reshape(-1))
    req.deferred, req.unstored, req._moved = 0, [], False


def undo_flush(req: Any, n: int) -> None:
    """A step or fork refused after ``flush`` caught the core up with ``n`` deferred steps:
    shorten the rows back, so that the refusal leaves the pool's lengths as they were (the
    rows keep the page those steps are in: it holds earlier tokens too), and the steps stay
    deferred (their tokens, stored meanwhile, are stored again at the next flush)."""
    assert req.handles is not None
    req.pool.truncate(req.handles, np.full(req.handles.shape[0], req.length - n, dtype=np.int64))
    req._edits = getattr(req.pool, "_row_edits", 0)  # (its own truncate, after check_edits)
    req.deferred = n

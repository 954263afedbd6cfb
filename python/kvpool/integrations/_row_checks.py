"""What a cache checks of its rows after pool calls it did not make (``kvpool.row_edits``),
for ``KVPoolCache`` (``_requests``) and its hybrid form (``_hybrid``), and how ``KVPoolCache``'s
pending tokens (deferred steps, stores not made yet) follow such calls or its own refused ones."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.errors import InvalidHandleError, RequestSwappedOutError, RowsChangedError

__all__ = ["check_rows", "close_rows", "row_slots", "rows_hold", "store_below", "undo_flush"]


def check_rows(pool: Any, handles: np.ndarray, tokens: int | None, ahead: int = 0) -> None:
    """After a pool call the cache did not make named its rows (``kvpool.row_edits``): raise the
    typed error of a change it cannot follow: the rows closed (``pool.close``, ``pool.reset``),
    swapped out, or (``tokens``: the length the pool should hold) truncated. ``ahead``: tokens the
    cache holds past ``tokens`` (deferred steps), for the crop the error names. Nothing changes."""
    if not all(pool.is_open(h) for h in handles.tolist()):
        raise InvalidHandleError(
            "this KVPoolCache's rows were closed through the pool (pool.close of its handles, or "
            "pool.reset) since its last step: it has nothing left to go on from. Close the cache "
            "(close() gives nothing back twice and leaves requests that reuse the rows alone) and "
            "open a new one for the batch")
    swapped = [h for h in handles.tolist() if getattr(pool, "is_swapped", None) and pool.is_swapped(h)]
    if swapped:
        raise RequestSwappedOutError(
            f"{len(swapped)} of this KVPoolCache's rows are swapped out (pool.swap_out of its handles): "
            "a step needs them on the device; call pool.swap_in(cache.handles) first")
    if tokens is None:
        return
    held = np.asarray(pool.lengths(handles), dtype=np.int64)
    if (held != tokens).any():
        how = "truncated" if (held < tokens).all() else "extended or truncated"
        fix = (f"crop the cache to them (cache.crop({int(held[0]) - tokens - ahead})) to go on from there, or close it"
               if (held == held[0]).all() and held[0] < tokens else "close the cache")
        raise RowsChangedError(
            f"this KVPoolCache's rows were {how} through the pool (pool.truncate of its handles) since its "
            f"last step: they hold {held.tolist()} tokens, the cache {tokens}; {fix}. Steps read the "
            "rows' K/V by the cache's length, so they are refused rather than read past the rows")


def close_rows(pool: Any, handles: np.ndarray, publish: bool) -> None:
    """Close a cache's rows (``publish``: with ``cache=True``). Rows already closed through the pool
    (``pool.close``, ``pool.reset``) are left alone, and so are the requests that reopened them
    (a stale handle names none); the others are closed."""
    try:
        pool.close(handles, cache=True) if publish else pool.close(handles)
    except InvalidHandleError:
        alive = np.array([h for h in handles.tolist() if pool.is_open(h)], dtype=np.int64)
        if alive.shape[0] == handles.shape[0]:
            raise
        if alive.shape[0]:
            pool.close(alive)


def rows_hold(pool: Any, handles: np.ndarray, tokens: int) -> bool:
    """Whether every row is open, on the device and holds ``tokens`` in the pool."""
    hs = handles.tolist()
    if not all(pool.is_open(h) for h in hs):
        return False
    if getattr(pool, "is_swapped", None) and any(pool.is_swapped(h) for h in hs):
        return False
    return bool((np.asarray(pool.lengths(handles), dtype=np.int64) == tokens).all())


def row_slots(pool: Any, handles: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The rows' slots of positions ``[start, stop)`` as the pool holds them now, ``[B, stop - start]``
    (after a fork or swap_in moved pages, the slots a cache took before name pages that are no
    longer its rows')."""
    return np.stack([np.asarray(pool.slots(h), dtype=np.int64)[start:stop] for h in handles.tolist()])


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

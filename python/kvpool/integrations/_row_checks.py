"""What a cache checks of its rows after pool calls it did not make (``kvpool.row_edits``),
for ``KVPoolCache`` (``_requests``) and its hybrid form (``_hybrid``). How its pending tokens
follow such calls is ``_pending``'s."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from kvpool.errors import (
    ContextTooLongError,
    IncompleteForwardError,
    InvalidHandleError,
    RequestSwappedOutError,
    RowsChangedError,
)

__all__ = ["check_rows", "close_rows", "refuse_broken", "row_slots", "rows_hold"]


def refuse_broken(broken: str | None, what: str) -> None:
    """``IncompleteForwardError`` for ``what`` when the cache's rows are ``broken`` (a step that
    failed half-made, a reorder that lost rows): everything but reset/close is refused."""
    if broken is not None:
        raise IncompleteForwardError(f"{what}: {broken}; the cache can no longer tell what its rows "
                                     "hold: reset() (or close()) it and run the batch again")


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


def pool_lock(pool: Any) -> Any:
    """The pool's own (reentrant) lock, for a cache's check-then-act on its rows (a reorder's or a
    copy's forks, a close): no other thread changes the rows in between. A pool object without
    one gets no lock."""
    lock = getattr(pool, "_lock", None)
    return lock if lock is not None and hasattr(lock, "__enter__") else nullcontext()


def close_rows(pool: Any, handles: np.ndarray, publish: bool) -> None:
    """Close a cache's rows (``publish``: with ``cache=True``). Rows already closed through the pool
    (``pool.close``, ``pool.reset``) are left alone, and so are the requests that reopened them
    (a stale handle names none); the others are closed.

    Under the pool's lock (reentrant; the pool's own calls take it too): another thread closing
    one of the rows between the check of which are open and the close of those would otherwise
    make that close raise, and the rest, which the cache no longer names, stay open for good."""
    with pool_lock(pool):
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


def check_context(pool: Any, length: int, tokens: int) -> None:
    """Refuse a step that would take the batch past the pool's ``max_context_len``, naming the
    batch (the pool's own refusal names an internal request handle a transformers user never saw)."""
    ctx = pool.max_context_len
    if length + tokens > ctx:
        raise ContextTooLongError(
            f"KVPoolCache: this step would take the batch's rows to {length + tokens} tokens ({length} cached "
            f"+ {tokens} new), more than the pool's max_context_len={ctx}: build the pool with a larger "
            "max_context_len (pool_for_model(..., max_context_len=)) or generate fewer tokens")

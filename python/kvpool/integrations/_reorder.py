"""Beam-search reordering of a ``KVPoolCache`` batch: rows continued, forked or closed.

Kept apart from ``BatchRequests`` because it is the one whole-batch edit that makes and
drops pool requests (forks for rows continued more than once, closes for rows nobody
continues), with its own all-or-nothing rollback.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError
from kvpool.errors import TooManyRequestsError
from kvpool.integrations._pending import undo_flush
from kvpool.integrations._row_checks import pool_lock

BEAM_NEEDS_FORK = (
    "reordering the cache so that one row continues in several rows (beam search, "
    "num_return_sequences with a filled cache) needs shared pages: KVPool.fork(handle, n), "
    "which this pool object does not have (every kvpool.KVPool does). "
    "Greedy and sampling generate, batch_select_indices and permutations work without it."
)


def reorder_rows(batch: Any, sources: Sequence[int]) -> None:
    """Row j of ``batch`` (a ``BatchRequests``; not imported here, which imports this)
    continues row ``sources[j]``. Rows nobody continues are closed.

    A row continued once keeps its request; each further copy is a ``pool.fork``
    (shares every page). All forks are made before anything is closed, so a
    failing fork leaves the batch as it was; unless the pool has too few free rows
    for the copies and closing the dropped rows first makes room (``close_first``).
    """
    if batch.handles is None:
        return  # nothing opened yet: the first update opens as many rows as it sees
    b = batch.handles.shape[0]
    bad = [s for s in sources if not 0 <= s < b]
    if bad:
        raise InvalidArgumentError(f"row indices {bad[:4]} outside the batch of {b}")
    counts = Counter(sources)
    extra = {s: c - 1 for s, c in counts.items() if c > 1}
    fork = getattr(batch.pool, "fork", None)
    if extra and batch.length > 0 and fork is None:
        raise NotImplementedError(BEAM_NEEDS_FORK)
    batch.check_edits()
    made: list[int] = []
    copies: dict[int, list[int]] = {}
    closed = False
    dropped = [int(batch.handles[s]) for s in range(b) if s not in counts]
    # Under the pool's lock from the decision on: another thread taking the rows counted free
    # would fail a fork after the dropped rows closed, and the rows closed first stay free.
    with pool_lock(batch.pool):
        # Forks share the rows' pages as the pool holds them (after the checks: a reorder
        # refused leaves the pool as it was, deferred steps included).
        caught_up = batch.deferred
        batch.flush()
        first = close_first(batch.pool, sum(extra.values()), len(dropped))
        try:
            if first:
                closed = True  # (from the call on: one that fails part-way may have closed some)
                batch.pool.close(np.asarray(dropped, dtype=np.int64))
            for s, n in extra.items():
                if batch.length == 0:
                    new = [int(h) for h in batch.pool.open(n)]  # nothing to share yet
                else:
                    assert fork is not None  # checked above: extra copies with tokens need fork
                    new = [int(h) for h in fork(int(batch.handles[s]), n)]
                made.extend(new)
                copies[s] = new
            out = np.empty(len(sources), dtype=np.int64)
            used: set[int] = set()
            for j, s in enumerate(sources):
                if s in used:
                    out[j] = copies[s].pop()
                else:
                    out[j] = batch.handles[s]
                    used.add(s)
            if dropped and not first:  # (inside: a close that fails, a host tier's copy, would leave the forks unowned)
                batch.pool.close(np.asarray(dropped, dtype=np.int64))
        except BaseException as err:
            if not gave_back(batch, made, closed, err) and caught_up:
                undo_flush(batch, caught_up)
            raise
    batch._shared = batch._shared or bool(made and batch.length > 0)
    batch._set_handles(out)


def reorder_hybrid_rows(batch: Any, sources: Sequence[int]) -> None:
    """``reorder_rows`` for a ``HybridRequests`` batch: a fork per extra copy (state included), row
    by row, refused up front when the rows cannot hold the copies; the dropped rows close first
    only when the copies need their rows (``close_first``)."""
    if batch.handles is None:
        return
    b = batch.handles.shape[0]
    bad = [s for s in sources if not 0 <= s < b]
    if bad:
        raise InvalidArgumentError(f"row indices {bad[:4]} outside the batch of {b}")
    kept = set(sources)
    extra = len(sources) - len(kept)
    dropped = [int(batch.handles[s]) for s in range(b) if s not in kept]
    with pool_lock(batch.pool):  # (as reorder_rows: decided and done under the pool's lock)
        most, now = int(batch.pool.max_requests), int(batch.pool.open_requests)
        first = close_first(batch.pool, extra, len(dropped))
        if extra and now + extra > most and not first:
            # Up front, as the plain pool's one fork call refuses: forking row by row first
            # rewrote the table rows of the forks it then closed, and named one fork only.
            raise TooManyRequestsError(
                f"too many requests: fork asks for {extra} new request{'s' if extra != 1 else ''} (copies of rows) "
                f"with {now} of max_requests={most} already open; at most {max(most - now, 0)} more can open now "
                f"(close requests first, or ask for fewer)")
        batch.check_edits()
        batch.flush()
        out = np.empty(len(sources), dtype=np.int64)
        used: set[int] = set()
        made: list[int] = []
        closed = False
        try:
            if first:
                closed = True  # (from the call on: one that fails part-way may have closed some)
                batch.pool.close(np.asarray(dropped, dtype=np.int64))
            for j, s in enumerate(sources):
                if s in used:
                    h = int(batch.pool.fork(int(batch.handles[s]), 1)[0])
                    made.append(h)
                    out[j] = h
                else:
                    out[j] = batch.handles[s]
                    used.add(s)
        except BaseException as err:
            gave_back(batch, made, closed, err)
            raise
        if dropped and not first:
            batch.pool.close(np.asarray(dropped, dtype=np.int64))
    batch._set_handles(out)


def gave_back(batch: Any, made: list[int], closed: bool, err: BaseException) -> bool:
    """A failed reorder closes the copies it made; returns whether it had closed the dropped
    rows first, which leaves the batch refusing all but reset/close (``lost_rows``)."""
    if made:
        batch.pool.close(np.asarray(made, dtype=np.int64))
    batch._edits = getattr(batch.pool, "_row_edits", 0)  # (its own forks and closes)
    if closed:
        lost_rows(batch, err)
    return closed


def lost_rows(batch: Any, err: BaseException) -> None:
    """A reorder closed the rows it dropped, then failed: the batch cannot be put back, so it
    refuses all but reset/close (``check_broken``), on every path (the plain cache's fast
    decode path and a hybrid cache's state layers check it too)."""
    batch.broken = (f"a reorder closed the rows it dropped to make room for its copies, then failed "
                    f"({type(err).__name__}: {err})")
    batch.fast = False  # (the plain cache's short way: its next update goes the checked way)


def close_first(pool: Any, copies: int, dropped: int) -> bool:
    """Whether a reorder making ``copies`` new requests must close its ``dropped`` rows before
    it forks: only when the pool has too few free rows for the copies and the dropped rows
    make up for it. Beam search's reorders keep the batch size, so their copies number the
    rows they drop, and forking first needed twice the batch's rows at its peak (a pool
    sized for the beams refused the first reorder that continued a beam twice). Forking
    first keeps a failed fork harmless, so it stays the rule where the rows allow it."""
    most, now = getattr(pool, "max_requests", None), getattr(pool, "open_requests", None)
    if not copies or not dropped or most is None or now is None:
        return False
    free = int(most) - int(now)
    return free < copies <= free + dropped


def repeat_prefix_rows(batch: Any, rows: int) -> bool:
    """Whether ``batch`` (rows opened on ``prefix_ids``, no forward since) took a first forward
    of ``rows`` = k x its rows as ``generate``'s expansion for beam search or
    ``num_return_sequences`` (``repeat_interleave`` of the input ids, made after the cache
    was built): then each row becomes k consecutive rows (forks sharing the hit's pages, as
    ``batch_repeat_interleave(k)``), and the forward goes on. Any other batch is not."""
    n = batch.handles.shape[0]
    if not batch.prefix_unstarted or rows <= n or rows % n:
        return False
    batch.reorder([i for i in range(n) for _ in range(rows // n)])
    return True


def batch_mismatch(rows: int, held: int) -> str:
    """The refusal of a forward whose batch is not the cache's rows."""
    return (f"the batch has {rows} rows but this cache holds {held} pool requests; use one KVPoolCache "
            "per batch (or reorder/select it first; a cache opened on prefix_ids= also takes a first "
            "forward of k times its rows, as generate's beam search and num_return_sequences make)")

"""Events a caller drained itself (``pool.take_events()``) and hands to
``DiskCache.store_new(events=)`` and ``EventPublisher.publish(events=)``: checked to be
what ``take_events()`` returns before any of it is used.

An engine that both stores pages to disk and publishes events drains once and hands the
same events to both (each drain takes the events from every other reader). Anything else
(another dict, arrays of mismatched lengths, a Stored event whose token ids are missing)
would otherwise fail halfway through with a ``KeyError`` or ``IndexError``, or file
chains under the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgumentError

__all__ = ["EVENT_FIELDS", "checked_events"]

#: One entry per event, as ``take_events()`` returns them (``medium`` may be absent).
EVENT_FIELDS = ("kind", "hash_hi", "hash_lo", "parent_hi", "parent_lo", "num_tokens", "salt")
STORED, KINDS = 0, (0, 1, 2)


def _ints(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(
            f"events[{name!r}] must be a 1-D integer array (as take_events() returns), "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    return arr


def checked_events(ev: Any, page_size: int | None = None) -> dict[str, np.ndarray]:
    """``ev`` as ``take_events()`` returns it, or ``InvalidArgumentError`` saying what is off;
    with ``page_size``, as a pool of that page size returns it (one page per Stored event)."""
    if not isinstance(ev, Mapping):
        raise InvalidArgumentError(
            f"events must be the dict pool.take_events() returns, got {type(ev).__name__}"
        )
    missing = [k for k in (*EVENT_FIELDS, "token_ids") if k not in ev]
    if missing:
        raise InvalidArgumentError(f"events lacks {missing}: pass the dict pool.take_events() returns")
    out = {k: _ints(k, ev[k]) for k in (*EVENT_FIELDS, "token_ids")}
    for k in ("medium", "group_idx"):  # (optional: the encoder sends them when present)
        if k in ev:
            out[k] = _ints(k, ev[k])
    n = len(out["kind"])
    wrong = [k for k in out if k != "token_ids" and len(out[k]) != n]
    if wrong:
        raise InvalidArgumentError(f"events[{wrong[0]!r}] has {len(out[wrong[0]])} entries, events['kind'] {n}: "
                                   "every field but token_ids has one entry per event")
    if n and not np.isin(out["kind"], KINDS).all():
        raise InvalidArgumentError("events['kind'] must hold 0 (Stored), 1 (Removed) or 2 (Cleared)")
    if n and (out["num_tokens"] < 0).any():
        raise InvalidArgumentError("events['num_tokens'] must be >= 0")
    if n and page_size is not None:
        sizes = out["num_tokens"][out["kind"] == STORED]
        if (sizes != page_size).any():
            other = int(sizes[sizes != page_size][0])
            raise InvalidArgumentError(
                f"events hold Stored pages of {other} tokens, and this pool's pages hold {page_size}: pass the "
                f"events of this pool's own take_events()")
    stored = int(out["num_tokens"][out["kind"] == STORED].sum()) if n else 0
    if stored != len(out["token_ids"]):
        raise InvalidArgumentError(f"events['token_ids'] has {len(out['token_ids'])} ids, the Stored events' "
                                   f"num_tokens add up to {stored}")
    return out

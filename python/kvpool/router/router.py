"""A cache-aware router that knows the pools only through their KV events.

It keeps its own index of which pool holds which chained page hash (fed with
the pools' ``KVEventBatch`` messages), computes a prompt's page hashes itself
(``kvpool._core.page_hashes``: the pools' hash, seed and salt), and sends each
request to the pool with the longest cached prefix, the least loaded among
equals. It holds no pool.

Each pool's stream (the order its batches are applied in, and when the router
forgets what it believed of a pool) is ``kvpool.router.event_streams``'s.

Block hashes may come as the 16-byte chain hashes or as vLLM's int form (the
low 64 bits; ``ZmqEventPublisher(int_block_hashes=True)``): the index keeps
each as it came, and a prompt is looked up in every form the streams have used.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpool._core import InvalidArgumentError
from kvpool._values import is_int
from kvpool.router.event_streams import EventStreams, StreamState
from kvpool.router.index import PageIndex
from kvpool.router.matching import PrefixMatching

#: Most pools one router routes over.
MAX_POOLS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Route:
    """A routing decision: the pool, and the prompt tokens it is expected to
    serve from its cache (what its ``open_with_prefix`` should return)."""

    pool: int
    cached_tokens: int


class Router(EventStreams, PrefixMatching):
    """Routes requests over ``num_pools`` pools by their cached prefixes.

    Args:
        num_pools: pools, numbered 0 .. num_pools - 1 (at most ``MAX_POOLS``, 65536).
        page_size: the pools' page size (all equal).
        hash_seed: the pools' hash_seed (all equal: a pool built with another
            seed names its pages with other hashes, and the first root page it
            stores raises InvalidArgumentError when the router checks it).
        max_pending: batches of one stream that may wait for a gap to be
            filled before the router gives up on the gap.
        medium: the tier whose pages count as hits ("GPU"; events for other
            media are skipped).
    """

    def __init__(self, num_pools: int, *, page_size: int, hash_seed: int, max_pending: int = 64,
                 medium: str = "GPU") -> None:
        # Checked before anything is sized by it: the router keeps a stream state and a
        # load count per pool, so a huge count would exhaust memory instead of failing.
        if not is_int(num_pools) or not 1 <= num_pools <= MAX_POOLS:
            raise InvalidArgumentError(f"num_pools must be an int in [1, {MAX_POOLS}] (the pools routed over), "
                                       f"got {num_pools!r}")
        for name, value, low in (("page_size", page_size, 1), ("max_pending", max_pending, 0)):
            if not is_int(value) or value < low:
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        if not is_int(hash_seed) or not 0 <= hash_seed < 1 << 64:
            raise InvalidArgumentError(f"hash_seed must be the pools' hash_seed, an int in [0, 2**64), got {hash_seed!r}")
        from kvpool.events.schema import MEDIUM_CPU, MEDIUM_GPU, decoder, msgspec

        # Any other name matches no event the pools send, so every page would be ignored.
        media = (MEDIUM_GPU, MEDIUM_CPU, "STORAGE")
        if not isinstance(medium, str) or medium not in media:
            raise InvalidArgumentError(f"medium must be one of {media} (the tier whose pages count as hits), "
                                       f"got {medium!r}")

        # int(): numpy ints pass the checks, and a numpy num_pools made the pool bitmask a
        # fixed-width numpy int (no bit_length in match(), and wrapped past 63 pools).
        self.num_pools, self.page_size, self.hash_seed = int(num_pools), int(page_size), int(hash_seed)
        self.max_pending, self.medium = int(max_pending), medium
        self.index = PageIndex(self.num_pools)
        self.streams = [StreamState() for _ in range(self.num_pools)]
        self.load = [0] * self.num_pools  # requests routed and not finished
        self._all = (1 << self.num_pools) - 1
        # The hash forms the streams have sent (16-byte, int): match() looks a prompt up in each.
        self._bytes_keys = self._int_keys = False
        self._decode = decoder().decode
        self._not_a_batch = (TypeError, msgspec.DecodeError)  # ValidationError is a DecodeError

    # ----- copies and pickles ----------------------------------------------
    # A router is plain Python state plus a msgspec decoder, which neither pickles nor
    # needs to: rebuilt on load. A copy is a whole, independent router (copy.copy's default
    # shared the index, streams and loads, so feeding one silently changed the other).

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_decode"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from kvpool.events.schema import decoder  # (msgspec: imported on use, as in __init__)

        self.__dict__.update(state)
        self._decode = decoder().decode

    def __copy__(self) -> Router:
        return copy.deepcopy(self)

    # ----- routing -------------------------------------------------------

    def route(self, tokens: Any, salt: int = 0, *, loads: Sequence[float] | None = None,
              eligible: Sequence[bool] | None = None) -> Route:
        """Pick the pool for a request: the longest cached prefix, then the least
        load (``loads``, or the router's count of routed, unfinished requests),
        then the lowest index. Counts the request in ``load`` of that pool.

        Args:
            tokens: the prompt's token ids.
            salt: the request's salt (as given to the pool's open_with_prefix).
            loads: per-pool load to break ties with (default ``self.load``): any real
                numbers, the lowest preferred; ``inf`` marks a pool taken only when no
                other eligible pool caches as long a prefix. NaN, which orders with
                nothing, is refused.
            eligible: per-pool flags; only pools flagged True are considered
                (e.g. those with room for the request).

        Raises:
            InvalidArgumentError: no pool is eligible, arguments of the wrong length, or a
                ``loads`` entry that is not a real number.
        """
        cached = self.match(tokens, salt)
        load = self.load if loads is None else _per_pool("loads", loads, self.num_pools, "a number")
        if eligible is not None:
            eligible = _per_pool("eligible", eligible, self.num_pools, "True or False")
        best = -1
        for p in range(self.num_pools):
            if eligible is not None and not eligible[p]:
                continue
            if best < 0 or (cached[p], -load[p]) > (cached[best], -load[best]):
                best = p
        if best < 0:
            raise InvalidArgumentError("no pool is eligible for this request")
        self.load[best] += 1
        return Route(best, cached[best])

    def finished(self, pool: int) -> None:
        """A request routed to ``pool`` ended (its load count goes down)."""
        self._stream(pool)
        self.load[pool] = max(0, self.load[pool] - 1)

    def pages(self, pool: int) -> int:
        """Pages the router believes ``pool`` holds."""
        self._stream(pool)
        return len(self.index.held[pool])


def _per_pool(name: str, values: Any, num_pools: int, each: str) -> list[Any]:
    """``loads`` / ``eligible``: one real number (or one flag) per pool, checked
    before any comparison so that a wrong value is named, not a numpy or torch
    truth-value error."""
    flags = each == "True or False"
    # A mapping iterates its keys, not its values; a 0-d array or tensor has __len__ but no length.
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__") \
            or not hasattr(values, "__getitem__") or (hasattr(values, "ndim") and values.ndim == 0):
        raise InvalidArgumentError(f"{name} must be a sequence of {num_pools} entries ({each} per pool), "
                                   f"got {type(values).__name__}")
    if len(values) != num_pools:
        raise InvalidArgumentError(f"{name} needs one entry per pool ({num_pools}), got {len(values)}")
    out = values.tolist() if hasattr(values, "tolist") else list(values)
    for i, v in enumerate(out):
        if flags:
            ok = isinstance(v, (bool, np.bool_))
        else:
            # isnan only on floats: an int has no NaN, and one past float's range (10**400)
            # made math.isnan raise OverflowError; ints compare with floats exactly.
            ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
                and not (isinstance(v, (float, np.floating)) and math.isnan(v))
        if not ok:
            raise InvalidArgumentError(f"{name}[{i}] must be {each}, got {type(v).__name__} {v!r}")
    return out


__all__ = ["MAX_POOLS", "Route", "Router", "StreamState"]

"""Prometheus metrics of one or more pools (optional extra ``metrics``: prometheus_client).

``KVPoolCollector`` reads each pool's counters when Prometheus scrapes (one
``stats()`` snapshot per pool, under the pool's lock) and exports them with a
``pool`` label. Register it once::

    from prometheus_client import REGISTRY
    from kvpool.metrics import KVPoolCollector
    REGISTRY.register(KVPoolCollector({"gpu0": pool0, "gpu1": pool1}, publishers={"gpu0": pub0}))

Families (counters are exposed with the ``_total`` suffix; docs/events-and-metrics.md):

- ``kvpool_pages`` (gauge, ``state`` = free / held / cached / pinned): pages by
  state; cached pages are registered in the prefix cache, held by no request
  and evictable; pinned ones are cached pages with retention priority 100 and
  no duration (never evicted, not free).
- ``kvpool_pinned_pages`` (gauge): registered pages pinned, held or cached (what
  ``max_pinned_pages`` bounds); ``kvpool_max_pinned_pages`` (gauge): the bound.
- ``kvpool_evictable_pages_by_priority`` (gauge, ``band`` = low / default /
  high): evictable pages below, at and above the default retention priority.
- ``kvpool_usage_ratio`` (gauge): held pages / capacity pages.
- ``kvpool_registered_pages`` (gauge): device pages in the prefix index, held
  or not (an entry whose only copy is on the host tier is not counted).
- ``kvpool_open_requests`` (gauge).
- ``kvpool_prefix_cache_queries`` (counter, tokens): prompt tokens looked up by
  ``open_with_prefix``.
- ``kvpool_prefix_cache_hits`` (counter, tokens): of those, tokens served from
  the cache, i.e. not recomputed (the last prompt token, always computed, is
  never a hit).
- ``kvpool_events_dropped`` (counter): KV events dropped by backlog overflows.
- ``kvpool_evicted_pages`` (counter; pools with a publisher): pages that left
  the prefix cache (Removed events: evictions, and a cached page rewritten in place).
- ``kvpool_events_published`` (counter; pools with a publisher): events sent.
- ``kvpool_copy_bytes`` (counter; ``KVPool`` only): K/V bytes moved by
  copy-on-write copies.
- ``kvpool_offload_bytes`` / ``kvpool_load_bytes`` (counters; ``KVPool`` with a
  host tier): device -> host and host -> device K/V bytes.

Pools with a host tier (``host_pages``) also export, as vLLM's kv_offload and
SGLang's hicache metrics do for theirs:

- ``kvpool_host_capacity_pages`` (gauge): host pages (the reserved page 0 not counted).
- ``kvpool_host_free_pages`` (gauge): host pages an offload or a swap can take now:
  free, or holding a cached copy no request holds (evictable).
- ``kvpool_host_used_pages`` (gauge): the rest, held by swapped-out requests or
  queued loads.
- ``kvpool_host_registered_pages`` (gauge): host pages holding a cached copy,
  held or not.
- ``kvpool_offloaded_pages`` / ``kvpool_loaded_pages`` (counters, pages):
  device -> host and host -> device page copies (evictions written back,
  swaps, and hits loaded back).
- ``kvpool_host_prefix_cache_hits`` (counter, tokens): the part of
  ``kvpool_prefix_cache_hits`` served from host copies (loaded back).

Hybrid pools (a ``KVPool`` with ``layer_types``, or a ``GroupedAllocator``)
export ``kvpool_open_requests``, the prefix cache and dropped-event counters,
the publisher's, and per layer group (``group`` = its index, ``kind`` = full /
sliding / state):

- ``kvpool_group_pages`` (gauge, ``state`` = free / held / cached): the group's
  pages (state slots) by state; they add up to the group's ``capacity_pages``.
- ``kvpool_group_registered_pages`` (gauge): the group's registered pages
  (checkpoints), held or not.

One scrape reads one ``stats()`` snapshot per pool and nothing else that
changes (the capacities are fixed at construction; ``kvpool_copy_bytes`` is a
separate running count), so within a scrape the page states add up to the
capacity and the priority bands to the cached pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvpool._core import DEFAULT_PRIORITY
from kvpool._nopickle import NotCopyable
from kvpool.extras import require

_pc = require("prometheus_client", "metrics", "kvpool.metrics")
_core = require("prometheus_client.core", "metrics", "kvpool.metrics")


def _named(pools: Any | Iterable[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """Label -> pool, every pool checked here: a scrape that raises fails the
    whole exposition, every other pool's families included."""
    from kvpool._core import GroupedAllocator, InvalidArgumentError, SlotAllocator

    if isinstance(pools, Mapping):
        items = list(pools.items())
    elif hasattr(pools, "stats") or hasattr(pools, "allocator") or isinstance(pools, SlotAllocator):
        items = [("0", pools)]
    elif isinstance(pools, Iterable) and not isinstance(pools, (str, bytes)):
        items = list(enumerate(pools))
    else:
        items = [("0", pools)]
    named: dict[str, Any] = {}
    for key, pool in items:
        label = str(key)
        if label in named:
            raise InvalidArgumentError(f"two pools would carry the label pool={label!r} (keys {list(dict(items))!r}); "
                                       f"give each pool its own label")
        core = getattr(pool, "allocator", pool)
        plain = isinstance(core, SlotAllocator) and callable(getattr(pool, "stats", None))
        if not plain and not isinstance(core, GroupedAllocator):
            raise InvalidArgumentError(f"pool {label!r} must be a KVPool or SlotAllocator, or a hybrid KVPool "
                                       f"(layer_types) or GroupedAllocator (their stats() are what the collector "
                                       f"exports), got {type(pool).__name__}")
        twin = next((k for k, p in named.items() if getattr(p, "allocator", p) is core), None)
        if twin is not None:  # (a KVPool and its own allocator are one pool too)
            raise InvalidArgumentError(f"pools {twin!r} and {label!r} are the same pool: every figure of it would "
                                       f"be exported twice and counted twice in sums; give each pool once")
        named[label] = pool
    return named


class KVPoolCollector(NotCopyable):
    """A prometheus_client collector of ``pools``: one pool, a list (labelled
    "0", "1", ...) or a mapping label -> pool (``KVPool``, hybrid or not,
    ``SlotAllocator`` or ``GroupedAllocator``).
    ``publishers`` maps the same labels to their ``kvpool.events`` publishers,
    whose counters give the eviction and published-event counts."""

    _copy_refusal = "a copy would export the same pools again; build another KVPoolCollector (one per registry)"

    def __init__(self, pools: Any | Iterable[Any] | Mapping[str, Any], *,
                 publishers: Mapping[str, Any] | None = None) -> None:
        from kvpool._core import GroupedAllocator, InvalidArgumentError
        from kvpool.events.publisher import EventPublisher

        self.pools = _named(pools)
        # Hybrid pools: label -> each group's kind (fixed at construction).
        self._kinds = {label: [str(g["kind"]) for g in getattr(p, "allocator", p).groups]
                       for label, p in self.pools.items() if isinstance(getattr(p, "allocator", p), GroupedAllocator)}
        if publishers is not None and not isinstance(publishers, Mapping):
            raise InvalidArgumentError(f"publishers must be a dict {{pool label: publisher}}, "
                                       f"got {type(publishers).__name__}")
        self.publishers: dict[str, Any] = {}
        for key, pub in (publishers or {}).items():
            label = str(key)
            if label in self.publishers:  # (0 and "0": one of them would be dropped unseen)
                raise InvalidArgumentError(f"two publishers would belong to the pool labelled {label!r} (keys "
                                           f"{list(publishers or {})!r}); give each pool one publisher")
            self.publishers[label] = pub
        unknown = set(self.publishers) - set(self.pools)
        if unknown:
            raise InvalidArgumentError(f"publishers for unknown pools {sorted(unknown)}; pools are {sorted(self.pools)}")
        for label, pub in self.publishers.items():
            if not isinstance(pub, EventPublisher):
                raise InvalidArgumentError(f"the publisher of pool {label!r} must be a kvpool.events publisher "
                                           f"(ZmqEventPublisher, LocalEventPublisher), got {type(pub).__name__}")
            # Another pool's publisher would export that pool's evictions under this label.
            mine = getattr(self.pools[label], "allocator", self.pools[label])
            if getattr(pub.pool, "allocator", pub.pool) is not mine:
                raise InvalidArgumentError(f"the publisher given for pool {label!r} publishes another pool's events; "
                                           f"give each pool the publisher built on it")

    def describe(self) -> list[Any]:
        # Every family this collector can export (empty): the registry checks these
        # names, so a second collector in one registry, which would expose every family
        # twice, is refused when it is registered instead of breaking each scrape.
        return list(self._families())

    def _families(self) -> tuple[Any, ...]:
        G, C = _core.GaugeMetricFamily, _core.CounterMetricFamily
        pages = G("kvpool_pages", "Pages by state: free, held by requests, cached (prefix cache, held by none, "
                  "evictable), pinned (cached, never evicted)", labels=["pool", "state"])
        pinned = G("kvpool_pinned_pages", "Registered pages pinned, held or cached", labels=["pool"])
        max_pinned = G("kvpool_max_pinned_pages", "Most registered pages that may be pinned", labels=["pool"])
        bands = G("kvpool_evictable_pages_by_priority",
                  "Evictable pages below, at and above the default retention priority", labels=["pool", "band"])
        usage = G("kvpool_usage_ratio", "Held pages / capacity pages", labels=["pool"])
        registered = G("kvpool_registered_pages", "Device pages in the prefix index, held or not",
                       labels=["pool"])
        requests = G("kvpool_open_requests", "Requests opened and not yet closed", labels=["pool"])
        queries = C("kvpool_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["pool"])
        hits = C("kvpool_prefix_cache_hits", "Prompt tokens served from the prefix cache (not recomputed)",
                 labels=["pool"])
        dropped = C("kvpool_events_dropped", "KV events dropped because the undrained backlog overflowed",
                    labels=["pool"])
        evicted = C("kvpool_evicted_pages", "Pages that left the prefix cache (Removed events)", labels=["pool"])
        published = C("kvpool_events_published", "KV events published", labels=["pool"])
        copy = C("kvpool_copy_bytes", "K/V bytes moved by copy-on-write copies", labels=["pool"])
        offload = C("kvpool_offload_bytes", "K/V bytes moved device -> host", labels=["pool"])
        load = C("kvpool_load_bytes", "K/V bytes moved host -> device", labels=["pool"])
        host = (G("kvpool_host_capacity_pages", "Host tier pages", labels=["pool"]),
                G("kvpool_host_free_pages", "Host pages an offload or swap can take now: free or holding an "
                  "evictable cached copy", labels=["pool"]),
                G("kvpool_host_used_pages", "Host pages held by swapped-out requests or queued loads",
                  labels=["pool"]),
                G("kvpool_host_registered_pages", "Host pages holding a cached copy, held or not", labels=["pool"]),
                C("kvpool_offloaded_pages", "Pages copied device -> host", labels=["pool"]),
                C("kvpool_loaded_pages", "Pages copied host -> device", labels=["pool"]),
                C("kvpool_host_prefix_cache_hits", "Prompt tokens served from host copies (loaded back)",
                  labels=["pool"]))
        groups = (G("kvpool_group_pages", "Pages (state slots) of a hybrid pool's layer group by state: free, held "
                    "by requests, cached (evictable)", labels=["pool", "group", "kind", "state"]),
                  G("kvpool_group_registered_pages", "Registered pages (checkpoints) of a layer group, held or not",
                    labels=["pool", "group", "kind"]))
        return (pages, pinned, max_pinned, bands, usage, registered, requests, queries, hits, dropped, evicted,
                published, copy, offload, load, *host, *groups)

    def collect(self) -> Iterator[Any]:
        families = self._families()
        (pages, pinned, max_pinned, bands, usage, registered, requests, queries, hits, dropped, evicted,
         published, copy, offload, load, host_capacity, host_free, host_used, host_registered, offloaded, loaded,
         host_hits, group_pages, group_registered) = families
        for name, pool in self.pools.items():
            pub = self.publishers.get(name)
            if pub is not None:
                evicted.add_metric([name], int(pub.removed_pages))
                published.add_metric([name], int(pub.events))
            kinds = self._kinds.get(name)
            if kinds is not None:  # a hybrid pool: its GroupedAllocator's one-lock snapshot
                g = pool.stats()  # (a hybrid KVPool's holds its lock too: no open half-undone)
                requests.add_metric([name], int(g["open_requests"]))
                queries.add_metric([name], int(g["hit_tokens"]) + int(g["miss_tokens"]))
                hits.add_metric([name], int(g["hit_tokens"]))
                dropped.add_metric([name], int(g["dropped_events"]))
                for i, (kind, c) in enumerate(zip(kinds, g["groups"])):
                    evictable = int(c["evictable_pages"])
                    for state, n in (("free", int(c["free_pages"]) - evictable), ("held", int(c["used_pages"])),
                                     ("cached", evictable)):
                        group_pages.add_metric([name, str(i), kind, state], n)
                    group_registered.add_metric([name, str(i), kind], int(c["cached_pages"]))
                continue
            # Everything that changes comes from this one snapshot: figures read apart
            # (under their own locks) could straddle another thread's call.
            s = pool.stats()
            alloc = getattr(pool, "allocator", pool)
            capacity = int(alloc.capacity_pages)  # fixed at construction, as max_pinned_pages and host_pages
            cached = int(s.evictable_pages)
            free = int(s.free_pages) - cached
            held = int(s.used_pages)
            pinned_cached = capacity - int(s.free_pages) - held
            for state, v in (("free", free), ("held", held), ("cached", cached), ("pinned", pinned_cached)):
                pages.add_metric([name, state], v)
            pinned.add_metric([name], int(s.pinned_pages))
            max_pinned.add_metric([name], int(alloc.max_pinned_pages))
            by = s.evictable_pages_by_priority
            d = DEFAULT_PRIORITY
            for band, v in (("low", sum(by[:d])), ("default", by[d]), ("high", sum(by[d + 1:]))):
                bands.add_metric([name, band], int(v))
            usage.add_metric([name], held / capacity if capacity else 0.0)
            registered.add_metric([name], int(s.cached_pages))
            requests.add_metric([name], int(s.open_requests))
            queries.add_metric([name], int(s.hit_tokens) + int(s.miss_tokens))
            hits.add_metric([name], int(s.hit_tokens))
            dropped.add_metric([name], int(s.dropped_events))
            slots = getattr(pool, "copied_slots", None)
            if slots is not None:
                copy.add_metric([name], int(slots) * int(pool.bytes_per_slot))
            host_pages = int(alloc.host_pages)
            if host_pages:
                cap = host_pages - 1  # page 0 is reserved
                for fam, v in ((host_capacity, cap), (host_free, s.host_free_pages),
                               (host_used, cap - int(s.host_free_pages)), (host_registered, s.host_cached_pages),
                               (offloaded, s.offloaded_pages), (loaded, s.loaded_pages),
                               (host_hits, s.host_hit_tokens)):
                    fam.add_metric([name], int(v))
                storage = getattr(pool, "host", None)  # KVPool's HostStorage: the bytes of one page
                if storage is not None:
                    offload.add_metric([name], int(s.offloaded_pages) * int(storage.page_bytes))
                    load.add_metric([name], int(s.loaded_pages) * int(storage.page_bytes))
        for fam in families:
            if fam.samples:
                yield fam


__all__ = ["KVPoolCollector"]

"""Replay of one prefix trace over several kvpool pools in one process, with a
routing policy choosing each admitted group's pool.

Each pool is a ``SlotAllocator`` driven as the prefix benchmark's kvpool driver
drives one (close with cache, open_with_prefix + extend + cache per group, fork
for n > 1, one decode extend per pool). Each pool has a ``LocalEventPublisher``
that publishes once a step, at its end, and the router gets those messages
before the next step: what it knows lags the pools by up to one step, as a
router fed over the network would.

Admission: the trace admits a group when the whole fleet has room; the driver
then offers the policy only the pools with room for the group's lifetime
(``reserved + need + one page per lane <= usable``), so no pool ever runs out.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

import kvpool
from kvpool._core import page_hashes
from kvpool.bench.prefix.trace import PrefixTrace
from kvpool.events import LocalEventPublisher


@dataclasses.dataclass
class Disagreement:
    step: int
    pool: int
    prompt_len: int
    predicted: int
    returned: int
    cause: str  # "in flight", "evicted" or "bug: ..."

    def line(self) -> str:
        return (f"step {self.step} pool {self.pool}: predicted {self.predicted} cached tokens, the pool returned "
                f"{self.returned} (prompt {self.prompt_len}): {self.cause}")


@dataclasses.dataclass
class PolicyResult:
    policy: str
    pools: int
    requests: int = 0  # groups routed (all steps)
    prompt_tokens: int = 0  # measured steps: prompt tokens admitted (n per group)
    hit_tokens: int = 0  # of those, served from a pool's cache
    prefill_tokens: int = 0  # measured steps: prompt tokens computed (once per group)
    total_prompt_tokens: int = 0
    total_hit_tokens: int = 0
    evicted_pages: int = 0
    requests_per_pool: list[int] = dataclasses.field(default_factory=list)
    route_us: list[float] = dataclasses.field(default_factory=list)  # router only: per request
    feed_us_per_event: float = 0.0  # router only: applying the events it was sent
    events: int = 0
    agreed: int = 0
    disagreements: list[Disagreement] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def agreement(self) -> float | None:
        n = self.agreed + len(self.disagreements)
        return self.agreed / n if n else None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        us = np.asarray(self.route_us)
        d["route_us"] = ({"mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
                          "p99": float(np.percentile(us, 99)), "max": float(us.max())} if len(us) else None)
        d["hit_rate"], d["agreement"] = self.hit_rate, self.agreement
        d["disagreements"] = [dataclasses.asdict(x) for x in self.disagreements]
        return d


class Fleet:
    """``pools`` SlotAllocators of ``pool_pages`` pages each, replaying ``trace``."""

    def __init__(self, trace: PrefixTrace, pools: int, pool_pages: int, hash_seed: int) -> None:
        cfg = trace.config
        self.trace, self.n, self.ps = trace, pools, cfg.page_size
        self.usable = pool_pages - 1
        self.allocs = [kvpool.SlotAllocator(pool_pages, cfg.page_size, cfg.concurrency, cfg.max_context_len,
                                            hash_seed=hash_seed) for _ in range(pools)]
        self.pubs = [LocalEventPublisher(a) for a in self.allocs]
        self.lane_pool = np.full(cfg.concurrency, -1, dtype=np.int64)
        self.handles = np.zeros(cfg.concurrency, dtype=np.int64)
        self.need = np.zeros(cfg.concurrency, dtype=np.int64)
        self.reserved = [0] * pools
        self.lanes = [0] * pools

    def room(self, need: int, lanes: int) -> list[bool]:
        return [self.reserved[p] + need + self.lanes[p] + lanes <= self.usable for p in range(self.n)]


def replay(trace: PrefixTrace, pools: int, pool_pages: int, policy: str, hash_seed: int = 0x6b76) -> PolicyResult:
    """Replay ``trace`` over ``pools`` pools, routing by ``policy`` ("router" or "round-robin")."""
    from kvpool.router import Router

    fleet = Fleet(trace, pools, pool_pages, hash_seed)
    ps, warmup = fleet.ps, trace.config.warmup
    router = Router(pools, page_size=ps, hash_seed=hash_seed)
    res = PolicyResult(policy, pools, requests_per_pool=[0] * pools)
    rr = [0]
    feed_s = 0.0

    def choose(prompt: np.ndarray, eligible: list[bool]) -> tuple[int, int]:
        if policy == "router":
            t = time.perf_counter()
            r = router.route(prompt, eligible=eligible)
            res.route_us.append((time.perf_counter() - t) * 1e6)
            return r.pool, r.cached_tokens
        for k in range(pools):
            p = (rr[0] + k) % pools
            if eligible[p]:
                rr[0] = p + 1
                return p, -1
        return -1, -1

    for t, step in enumerate(trace.steps + [trace.drain]):
        measured = warmup <= t < len(trace.steps)
        for lane in step.release_lanes.tolist():
            p = int(fleet.lane_pool[lane])
            fleet.allocs[p].close(fleet.handles[lane : lane + 1], cache=True)
            fleet.reserved[p] -= int(fleet.need[lane])
            fleet.lanes[p] -= 1
            if policy == "router" and fleet.lane_pool[lane] >= 0:
                router.finished(p)
            fleet.lane_pool[lane] = -1
        for g in step.admit:
            prompt = g.prompt
            needs = [-(-s.final_len // ps) for s in g.seqs]
            eligible = fleet.room(sum(needs), g.n)
            if not any(eligible):  # fleet-wide room but no single pool: take the one with the most
                free = [fleet.usable - fleet.reserved[p] - fleet.lanes[p] for p in range(pools)]
                eligible = [f == max(free) for f in free]
            p, predicted = choose(prompt, eligible)
            a = fleet.allocs[p]
            h, cached = a.open_with_prefix(prompt, [len(prompt)])
            hit, total = int(cached[0]), len(prompt)
            if policy == "router":
                if hit == predicted:
                    res.agreed += 1
                else:
                    res.disagreements.append(Disagreement(t, p, total, predicted, hit,
                                                          _cause(fleet.pubs[p], prompt, ps, hash_seed,
                                                                 predicted, hit)))
            a.extend(h, total - hit)
            a.cache(h)
            res.requests += 1
            res.requests_per_pool[p] += 1
            if measured:
                res.prompt_tokens += g.n * total
                res.hit_tokens += g.n * hit
                res.prefill_tokens += total - hit
            res.total_prompt_tokens += g.n * total
            res.total_hit_tokens += g.n * hit
            lanes = g.lanes
            fleet.handles[lanes[0]] = h[0]
            if g.n > 1:
                fleet.handles[lanes[1:]] = a.fork(int(h[0]), g.n - 1)
                if policy == "router":
                    for _ in range(g.n - 1):
                        router.load[p] += 1
            fleet.lane_pool[lanes] = p
            fleet.need[lanes] = needs
            fleet.reserved[p] += sum(needs)
            fleet.lanes[p] += g.n
        if len(step.decode_lanes):
            where = fleet.lane_pool[step.decode_lanes]
            for p in range(pools):
                sel = where == p
                if sel.any():
                    fleet.allocs[p].extend(fleet.handles[step.decode_lanes[sel]], 1,
                                           tokens=step.decode_tokens[sel])
                    fleet.allocs[p].take_copies()
        for p, pub in enumerate(fleet.pubs):
            pub.publish()
            msgs = pub.drain()
            if policy == "router":
                t0 = time.perf_counter()
                router.feed_many(p, msgs)
                feed_s += time.perf_counter() - t0
    res.events = sum(pub.events for pub in fleet.pubs)
    res.evicted_pages = sum(pub.removed_pages for pub in fleet.pubs)
    res.feed_us_per_event = feed_s * 1e6 / res.events if res.events and policy == "router" else 0.0
    for a in fleet.allocs:
        a.check()
    return res


def _cause(pub: LocalEventPublisher, prompt: np.ndarray, ps: int, seed: int, predicted: int, returned: int) -> str:
    """Why the router's prediction differs from what the pool returned: the
    events it has not been sent yet (this step's) explain it, or it is a bug."""
    from kvpool.events.schema import decoder

    pub.publish()  # this step's events so far, kept back from the router until the step ends
    dec = decoder()
    stored: set[bytes] = set()
    removed: set[bytes] = set()
    for _, _, payload in pub.outbox:
        for ev in dec.decode(payload).events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                stored.update(ev.block_hashes)
            elif kind == "BlockRemoved":
                removed.update(ev.block_hashes)
    keys = page_hashes(prompt[: max(predicted, returned)], ps, seed).byteswap().view("V16").tolist()
    if returned > predicted:
        missing = keys[predicted // ps : returned // ps]
        if all(k in stored for k in missing):
            return "in flight: the pages were stored this step, their Stored event not delivered yet"
        return "bug: the pool served pages the router was never told of"
    first = keys[returned // ps]
    if first in removed:
        return "evicted: the page was evicted this step, its Removed event not delivered yet"
    return "bug: the router believes in a page the pool does not serve, and no Removed event is pending"


__all__ = ["Disagreement", "Fleet", "PolicyResult", "replay"]

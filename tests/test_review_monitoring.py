"""An outside check of the monitoring and retention surfaces against models
written apart from the pool's own reference models: the eviction order of
retention priorities (one page per request, so each victim names one prompt)
with and without a host tier, the prefix-cache counters against a trace's own
sums (failed calls included), counters that never go back, and scrapes taken
while another thread drives the pool."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kvpool

D = kvpool.DEFAULT_PRIORITY
P = 2
MAX_PINNED = 3


class Retention:
    """Prompt key -> its page's priority, end, last-release stamp and holders,
    kept by the documented rules (docs/allocator.md, Retention priorities)."""

    def __init__(self) -> None:
        self.pages: dict[int, dict] = {}
        self.stamp = 0
        self.clock = 0.0

    def tick(self) -> int:
        self.stamp += 1
        return self.stamp

    def add(self, key: int) -> dict:
        self.pages[key] = dict(prio=D, end=None, given=False, seq=0, stamp=self.tick(), held=0)
        return self.pages[key]

    @staticmethod
    def is_pin(m: dict) -> bool:
        return m["prio"] == 100 and m["end"] is None

    def pinned(self) -> int:
        return sum(self.is_pin(m) for m in self.pages.values())

    def end_due(self) -> None:
        # Soonest first; among equal ends, the latest given first, so a page given
        # its end earlier joins the default list as the more recent one.
        due = sorted((m["end"], -m["seq"], k) for k, m in self.pages.items()
                     if m["end"] is not None and m["end"] <= self.clock)
        for _, _, k in due:
            m = self.pages[k]
            moved = m["prio"] != D
            m.update(prio=D, end=None, given=False)
            if moved and m["held"] == 0:
                m["stamp"] = self.tick()

    def give(self, key: int, prio: int, retain: float | None) -> None:
        m = self.pages[key]
        if prio == 100 and retain is None and not self.is_pin(m) and self.pinned() >= MAX_PINNED:
            prio = 99  # a pin past the bound
        inf = float("inf")
        cur = (m["prio"], inf if m["end"] is None else m["end"])
        end = None if retain is None else self.clock + retain
        new = (prio, inf if end is None else end)
        if m["given"] and not (new[0] > cur[0] or (new[0] == cur[0] and new[1] > cur[1])):
            return  # a lower priority given while a higher one holds is not remembered
        if end is not None and m["end"] != end:
            m["seq"] = self.tick()
        old = m["prio"] if not self.is_pin(m) else -1
        m.update(prio=prio, end=end, given=True)
        if m["held"] == 0 and old != (m["prio"] if not self.is_pin(m) else -1):
            m["stamp"] = self.tick()

    def victims(self) -> list[int]:
        ev = [(m["prio"], m["stamp"], k) for k, m in self.pages.items() if m["held"] == 0 and not self.is_pin(m)]
        return [k for _, _, k in sorted(ev)]

    def by_priority(self) -> np.ndarray:
        out = np.zeros(101, np.int64)
        for m in self.pages.values():
            if m["held"] == 0 and not self.is_pin(m):
                out[m["prio"]] += 1
        return out


class Trace:
    """Drives a SlotAllocator whose prompts are [10k, 10k+1, 7] (one full page
    each) and maps each device Removed event back to its prompt key."""

    def __init__(self, host: int) -> None:
        self.a = kvpool.SlotAllocator(13, P, 6, 16, hash_seed=1, manual_clock=True,
                                      max_pinned_pages=MAX_PINNED, host_pages=host)
        self.host = host
        self.keys: dict[tuple[int, int], int] = {}
        self.m = Retention()

    def removed(self) -> list[int]:
        ev = self.a.take_events()
        out, off = [], 0
        for i, kind in enumerate(ev["kind"]):
            key = (int(ev["hash_hi"][i]), int(ev["hash_lo"][i]))
            if kind == 0:
                if ev["medium"][i] == 0:
                    self.keys[key] = int(ev["token_ids"][off]) // 10
                off += int(ev["num_tokens"][i])
            elif kind == 1 and ev["medium"][i] == 0:
                out.append(self.keys[key])
        if self.host:
            self.a.take_offloads()
            self.a.take_loads()
        return out

    def expect_evicted(self, expected: list[int]) -> None:
        got = self.removed()
        assert got == expected[: len(got)], (got, expected)
        for k in got:
            del self.m.pages[k]

    def release(self, key: int) -> None:
        m = self.m.pages[key]
        m["held"] -= 1
        if m["held"] == 0:
            m["stamp"] = self.m.tick()


def run_retention_trace(seed: int, host: int, steps: int = 300) -> None:
    rng = np.random.default_rng(seed)
    t = Trace(host)
    a, m = t.a, t.m
    held: dict[int, tuple[int, bool]] = {}
    for _ in range(steps):
        r = rng.random()
        if r < 0.45 and len(held) < 6:
            key = int(rng.integers(0, 20))
            if any(k == key for k, _ in held.values()):
                continue  # two requests computing one prompt would register duplicates
            before = m.victims()
            h, c = a.open_with_prefix(np.array([key * 10, key * 10 + 1, 7]), [3])
            hit = int(c[0]) > 0
            t.expect_evicted(before)  # a host hit's load may take a device page
            if hit:
                # A device hit keeps its priority; a host hit is a new registration at the default.
                (m.pages.get(key) or m.add(key))["held"] += 1
            before = m.victims()
            try:
                a.extend(h, 3 - int(c[0]))
            except kvpool.PoolExhaustedError:
                a.close(h)
                assert t.removed() == []
                if hit:
                    t.release(key)
                continue
            t.expect_evicted(before)
            held[int(h[0])] = (key, hit)
        elif r < 0.85 and held:
            handle = list(held)[int(rng.integers(0, len(held)))]
            key, hit = held.pop(handle)
            prio = retain = None
            if rng.random() < 0.7:
                prio = int(rng.choice([0, 5, D, 60, 99, 100, 100]))
                retain = float(rng.integers(1, 4)) if rng.random() < 0.3 else None
            a.close([handle], cache=True, priority=prio, retain_s=retain)
            assert t.removed() == []
            if key not in m.pages:
                m.add(key)["held"] = 1
            if prio is not None:
                m.give(key, prio, retain)
            t.release(key)
        elif r < 0.93:
            m.clock += 1
            a.set_clock(m.clock)
            m.end_due()
        else:
            n = int(rng.integers(1, 4))
            expected = m.victims()
            got = a.evict(n)
            assert got == min(n, len(expected))
            t.expect_evicted(expected)
        a.check()
        assert a.evictable_pages_by_priority().tolist() == m.by_priority().tolist()
        assert a.pinned_pages == m.pinned()


@pytest.mark.parametrize("host", [0, 8])
@pytest.mark.parametrize("seed", range(6))
def test_eviction_order_follows_priorities_then_lru(seed, host):
    run_retention_trace(seed, host)


def opened(pool, prompts):
    lens = [len(p) for p in prompts]
    h, c = pool.open_with_prefix(np.concatenate(prompts), lens)
    return h, c, lens


@pytest.mark.parametrize("host", [None, 16])
@pytest.mark.parametrize("kind", ["allocator", "pool"])
def test_prefix_counters_match_the_trace_and_never_go_back(kind, host):
    if kind == "allocator":
        pool = kvpool.SlotAllocator(10, 4, 3, 48, hash_seed=1, host_pages=host or 0, manual_clock=True)
    else:
        pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=10, page_size=4, max_requests=3,
                             max_context_len=48, host_pages=host, manual_clock=True)
    rng = np.random.default_rng(7)
    queries = hits = 0
    open_handles: list[int] = []
    last = (0, 0, 0)
    for _ in range(600):
        if rng.random() < 0.5:
            prompts = [np.arange(b, b + n) for b, n in
                       zip(rng.integers(0, 6, 2) * 100, rng.integers(1, 50, 2))][: int(rng.integers(1, 3))]
            try:
                h, c, lens = opened(pool, prompts)
            except (kvpool.TooManyRequestsError, kvpool.ContextTooLongError, kvpool.PoolExhaustedError):
                continue  # a refused open looks nothing up
            queries += sum(lens)
            hits += int(c.sum())
            assert all(int(x) < n for x, n in zip(c, lens)), "the last prompt token is never a hit"
            open_handles += [int(x) for x in h]
            try:
                pool.extend(h, np.array(lens) - c)
            except kvpool.PoolExhaustedError:
                pass
        elif open_handles:
            h = open_handles.pop(int(rng.integers(0, len(open_handles))))
            pool.close([h], cache=True, priority=int(rng.integers(0, 101)) if rng.random() < 0.5 else None)
        if kind == "allocator" and host:
            pool.take_offloads()
            pool.take_loads()
        if rng.random() < 0.02:
            pool.reset()
            open_handles.clear()
        if rng.random() < 0.01:
            pool.clear_cache()
        s = pool.stats()
        assert (s.hit_tokens, s.hit_tokens + s.miss_tokens) == (hits, queries)
        now = (s.host_hit_tokens, s.offloaded_pages, s.loaded_pages)
        assert all(x >= y for x, y in zip(now, last)) and s.host_hit_tokens <= s.hit_tokens
        last = now
        assert pool.evictable_pages_by_priority().sum() == s.evictable_pages
    pool.check()
    if host:
        assert last[0] > 0, "the trace reached the host tier"


prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvpool.metrics import KVPoolCollector  # noqa: E402


def test_scrapes_while_another_thread_drives_the_pool():
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=30, page_size=4, max_requests=8,
                         max_context_len=64, host_pages=40)
    reg = prometheus_client.CollectorRegistry()
    reg.register(KVPoolCollector({"p": pool}))
    done = threading.Event()
    problems: list[object] = []
    scrapes = [0]

    def scraper() -> None:
        last: dict[str, float] = {}
        while not done.is_set() or scrapes[0] < 3:
            try:
                text = prometheus_client.generate_latest(reg).decode()
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                problems.append(repr(e))
                return
            states = {}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if fam.type == "counter":
                        if s.value < last.get(s.name, 0):
                            problems.append((s.name, s.value, last[s.name]))
                        last[s.name] = s.value
                    if fam.name == "kvpool_pages":
                        states[s.labels["state"]] = s.value
            if sum(states.values()) != pool.capacity_pages or min(states.values()) < 0:
                problems.append(states)
            scrapes[0] += 1

    thread = threading.Thread(target=scraper)
    thread.start()
    rng = np.random.default_rng(0)
    try:
        for _ in range(300):
            base, n = int(rng.integers(0, 10)) * 100, int(rng.integers(1, 30))
            h, c = pool.open_with_prefix(np.arange(base, base + n), [n])
            pool.extend(h, n - int(c[0]))
            pool.close(h, cache=True, priority=int(rng.integers(0, 101)) if rng.random() < 0.5 else None)
    finally:
        done.set()
        thread.join()
    assert problems == [] and scrapes[0] >= 3
    pool.check()


@pytest.mark.parametrize("twice", ["same pool", "pool and its allocator"])
def test_one_pool_under_two_labels_is_refused(twice):
    """Each of its figures would be exported under both labels and counted twice in any sum
    over pools (a dashboard's total of held pages, say)."""
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=8, page_size=4, max_requests=2, max_context_len=16)
    other = pool if twice == "same pool" else pool.allocator
    with pytest.raises(kvpool.InvalidArgumentError, match="same pool"):
        KVPoolCollector({"a": pool, "b": other})
    with pytest.raises(kvpool.InvalidArgumentError, match="same pool"):
        KVPoolCollector([pool, other])
    # Two pools, each once: fine.
    second = kvpool.KVPool(1, 1, 4, dtype=torch.float32, num_pages=8, page_size=4, max_requests=2,
                           max_context_len=16)
    assert set(KVPoolCollector({"a": pool, "b": second}).pools) == {"a", "b"}

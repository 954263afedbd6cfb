"""Figures the docs state about this repository's own files and code, each checked against
what they count, so that a change to the counted thing fails here rather than leaving the
doc behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reliability_md_counts_the_committed_fuzz_seeds():
    """docs/reliability.md said fuzz/seeds/ops held 206 files and the seeds about 90 KB after
    148 more ops inputs were committed (354 files, about 100 KB)."""
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    m = re.search(r"`fuzz/seeds/ops`: (\d+) files, `fuzz/seeds/groups`: (\d+), about (\d+) KB", text)
    assert m, "docs/reliability.md no longer states the seed counts in the form this test reads"
    ops, groups, kb = (int(g) for g in m.groups())
    seeds = ROOT / "fuzz" / "seeds"
    files = {d: [f for f in (seeds / d).iterdir() if f.is_file()] for d in ("ops", "groups")}
    assert ops == len(files["ops"])
    assert groups == len(files["groups"])
    total = sum(f.stat().st_size for fs in files.values() for f in fs)
    assert abs(total / 1000 - kb) <= 0.15 * kb, (total, kb)


def test_every_drain_carries_medium_and_a_host_copy_goes_out_as_cpu():
    """docs/events-and-metrics.md said the event arrays had no `medium` "today" (so every
    wire event read "GPU"), but take_events() has carried it since the host tier: 0 for a
    device page, 1 for a host copy, which the encoder sends as "CPU"."""
    import numpy as np

    import kvpool
    from kvpool import _core

    schema = __import__("pytest").importorskip("kvpool.events.schema", reason="needs the 'events' extra (msgspec)")
    plain = kvpool.SlotAllocator(num_pages=16, page_size=2, max_requests=4, max_context_len=64)
    grouped = kvpool.GroupedAllocator([{"kind": "full", "num_pages": 16, "page_size": 2}],
                                      max_requests=4, max_context_len=64)
    for a in (plain, grouped):
        h = a.open(1)
        a.extend(h, 4, tokens=np.arange(4))
        a.cache(h)
        ev = a.take_events()
        assert ev["medium"].dtype == np.uint8 and list(ev["medium"]) == [0, 0], type(a)
        assert "group_idx" not in ev  # the doc's "no group_idx yet"
    tiered = kvpool.SlotAllocator(num_pages=4, page_size=2, max_requests=4, max_context_len=64, host_pages=8)
    h = tiered.open(1)
    tiered.extend(h, 6, tokens=np.arange(6))
    tiered.close(h, cache=True)
    tiered.extend(tiered.open(1), 6, tokens=np.arange(10, 16))  # evicts: write_back offloads
    ev = tiered.take_events()
    assert 1 in set(ev["medium"].tolist())
    payload, *_ = _core.encode_kv_events(ev, 0.0)
    media = {e.medium for e in schema.decoder().decode(payload).events if hasattr(e, "medium")}
    assert media == {"GPU", "CPU"}


def test_a_sliding_layer_holds_at_most_the_pages_docs_hybrid_md_states():
    """docs/hybrid.md said held_tokens of a sliding layer stays at most W + one page; with a
    window that is not a multiple of the page size a request holds more (W = 6, pages of 4:
    3 pages, 12 tokens, while the window starts and ends inside a page). The bound is
    ceil(W / page_size) + 1 pages (docs/groups.md's), W + one page when the page divides W."""
    import math

    import torch

    import kvpool

    beyond = False
    for window, page in [(5, 4), (6, 4), (8, 4), (1, 4), (7, 16), (17, 16), (3, 2), (16, 16)]:
        pool = kvpool.KVPool(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu",
                             layer_types=["sliding_attention", "full_attention"], sliding_window=window,
                             page_size=page, num_pages=80, max_requests=2, max_context_len=128)
        h = pool.open(1)
        most = 0
        for _ in range(100):
            pool.extend(h, 1)
            most = max(most, pool.held_tokens(int(h[0]), 0))
        assert most <= (math.ceil(window / page) + 1) * page, (window, page, most)
        if window % page == 0:
            assert most <= window + page, (window, page, most)
        beyond |= most > window + page
        pool.check()
    assert beyond  # so the doc must not promise W + one page for every window


class _CountingLock:
    """The pool's RLock, counting how often a call enters it."""

    def __init__(self, lock):
        self.lock, self.entered = lock, 0

    def __enter__(self):
        self.entered += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)

    def acquire(self, *a, **k):
        self.entered += 1
        return self.lock.acquire(*a, **k)

    def release(self):
        return self.lock.release()


def test_every_call_the_threads_paragraph_names_holds_the_pool_lock():
    """docs/kernels-and-graphs.md's "Threads" listed the calls that hold the pool's lock but
    left out unpin, set_clock, swap_out and swap_in, which hold it too (KVPool's docstring
    names them). Each call the paragraph names is made here and must enter the lock."""
    import numpy as np
    import torch

    import kvpool

    text = " ".join((ROOT / "docs" / "kernels-and-graphs.md").read_text(encoding="utf-8").split())
    para = text[text.index("**Threads.**"):]
    para = para[:para.index("holds the pool's lock")]
    named = set(re.findall(r"`(\w+)`", para)) - {"KVPool", "send_request", "recv_request"}
    assert {"unpin", "set_clock", "swap_out", "swap_in"} <= named
    pool = kvpool.KVPool(1, 1, 4, dtype=torch.float32, page_size=2, num_pages=32, max_requests=8,
                         max_context_len=32, host_pages=8, manual_clock=True)
    lock = pool._lock = _CountingLock(pool._lock)
    h = pool.open(2)
    pool.extend(h, 5, tokens=np.arange(10))
    calls = {
        "open": lambda: pool.open(1), "admit": lambda: pool.admit([2]), "extend": lambda: pool.extend(h, 1),
        "truncate": lambda: pool.truncate(h, [5, 5]), "cache": lambda: pool.cache(h, priority=100),
        "unpin": lambda: pool.unpin(h), "set_clock": lambda: pool.set_clock(1.0),
        "fork": lambda: pool.fork(int(h[0]), 1), "evict": lambda: pool.evict(1),
        "swap_out": lambda: pool.swap_out(h[1:]), "swap_in": lambda: pool.swap_in(h[1:]),
        "close": lambda: pool.close(h[:1], cache=True), "clear_cache": pool.clear_cache,
        "open_with_prefix": lambda: pool.open_with_prefix(np.arange(6), [6]), "reset": pool.reset,
    }
    assert named - {"open_with_"} <= set(calls), named - set(calls)
    for name in [n for n in calls if n in named or n.startswith("open_with")]:
        before = lock.entered
        calls[name]()
        assert lock.entered > before, name
    pool.check()

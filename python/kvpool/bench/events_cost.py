"""What ``ZmqEventPublisher.publish()`` costs per step.

``publish()`` is what the scheduler's thread pays (drain, encode, hand over);
``until sent`` adds the wait for the sender thread's ZMQ send (``flush()``),
most of it waking ZMQ's I/O thread.

Each timed call publishes one step's worth of events made untimed just before:
three quarters Stored (requests of 8 pages caching their prompts) and one
quarter Removed (evictions), as a busy step has them. The PUB socket is bound on
loopback with one subscriber connected, which is drained between calls.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import kvpool
from kvpool._core import MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS

CHAIN = 8  # pages per request: one BlockStored each on the wire


def pool_shape(n: int, page_size: int) -> tuple[int, int, int]:
    """(num_pages, max_requests, max_context_len) of the pool that makes ``n`` events a step."""
    removed = n // 4
    stored = n - removed
    return 4 * stored + removed + 64, max(1, -(-stored // CHAIN)), CHAIN * page_size + 1


def shape_problem(sizes: list[int], page_size: int) -> str | None:
    """Why a size's pool is past the allocator's bounds (None: every one fits), naming the flag."""
    if pool_shape(1, page_size)[2] > MAX_CONTEXT_LEN:
        top = (MAX_CONTEXT_LEN - 1) // CHAIN
        return (f"--page-size {page_size} makes requests of {CHAIN} pages longer than kvpool's allocator takes "
                f"({MAX_CONTEXT_LEN} tokens); give --page-size in [1, {top}]")

    def fits(n: int) -> bool:
        pages, rows, _ = pool_shape(n, page_size)
        return pages <= MAX_PAGES and rows <= MAX_REQUESTS

    for n in sizes:
        if not fits(n):
            lo, hi = 1, n  # the largest size that fits: the shape grows with n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            pages, rows, _ = pool_shape(n, page_size)
            return (f"--sizes {n} needs a pool of {pages} pages and {rows} requests; kvpool's allocator takes at "
                    f"most {MAX_PAGES} pages and {MAX_REQUESTS} requests: give sizes in [1, {lo}]")
    return None


def measure(sizes: list[int], page_size: int = 16, repeats: int = 200) -> list[dict[str, Any]]:
    from kvpool.bench.runner import freeze_import_heap
    from kvpool.events import ZmqEventPublisher
    from kvpool.extras import require

    zmq = require("zmq", "events", "python -m kvpool.bench events")
    freeze_import_heap()  # torch's import heap: a full GC pass would land inside a timed call
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        removed = n // 4
        stored = n - removed
        pages, max_requests, context = pool_shape(n, page_size)
        a = kvpool.SlotAllocator(pages, page_size, max_requests, context, hash_seed=1)
        pub = ZmqEventPublisher(a, "tcp://127.0.0.1:0", buffer_steps=16)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        times, sent, sizes_b = [], [], []
        try:
            for _ in range(repeats):
                a.evict(a.evictable_pages)
                pub.publish()
                lens = [CHAIN * page_size] * (stored // CHAIN) + ([stored % CHAIN * page_size] if stored % CHAIN else [])
                toks = rng.integers(0, 32000, size=sum(lens))
                # Each request's first token its own: two requests of a step that began with the same
                # token would share their first page, cached once (at page size 1 a step of 94 requests
                # drawn from 32,000 tokens does that one time in seven), and publish one event fewer.
                toks[np.cumsum([0] + lens[:-1])] = 32000 + np.arange(len(lens))
                h, _ = a.open_with_prefix(toks, lens)
                a.extend(h, np.asarray(lens))
                a.close(h, cache=True)
                a.evict(removed)
                t = time.perf_counter()
                got = pub.publish()
                t1 = time.perf_counter()
                pub.flush()
                t2 = time.perf_counter()
                times.append(t1 - t)
                sent.append(t2 - t)
                assert got == n, (got, n)
                if sub.poll(1000):
                    sizes_b.append(len(sub.recv_multipart()[2]))
        finally:
            pub.close()
            sub.close(linger=0)
        us = float(np.median(times)) * 1e6
        rows.append({"events": n, "mix": f"{stored} : {removed}", "us": us, "us_per_100": us * 100 / n,
                     "us_until_sent": float(np.median(sent)) * 1e6,
                     "payload_bytes": int(np.median(sizes_b)) if sizes_b else 0, "repeats": repeats})
    return rows


__all__ = ["measure", "pool_shape", "shape_problem"]

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

CHAIN = 8  # pages per request: one BlockStored each on the wire


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
        pages = 4 * stored + removed + 64
        a = kvpool.SlotAllocator(pages, page_size, max(1, -(-stored // CHAIN)), CHAIN * page_size + 1, hash_seed=1)
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


__all__ = ["measure"]

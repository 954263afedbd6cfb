"""Threads share one allocator *and its pages*: each serves prompts with a common
system prompt through open_with_prefix, forks, decodes with token ids (copy-on-
write included), caches and closes, while other threads evict. Every request
must keep reading its own token ids, and check() (refcounts equal holders, every
page in exactly one state) must pass at the end."""

import threading

import numpy as np

from kvpool import PoolExhaustedError, SlotAllocator, TooManyRequestsError

THREADS, ROUNDS = 4, 150
SYSTEM = list(range(1000, 1032))


def worker(a, seed, errors, barrier, stats):
    rng = np.random.default_rng(seed)
    barrier.wait()
    try:
        for _ in range(ROUNDS):
            prompt = SYSTEM + rng.integers(0, 50, size=int(rng.integers(1, 20))).tolist()
            try:
                h, cached = a.open_with_prefix(prompt, [len(prompt)], salt=int(seed % 2))
            except TooManyRequestsError:
                continue
            stats["hits"] += int(cached[0])
            seqs = {int(h[0]): list(prompt)}
            try:
                a.extend(h, len(prompt) - int(cached[0]))
                if rng.random() < 0.5:
                    try:
                        for k in a.fork(h[0], 2):
                            seqs[int(k)] = list(prompt)
                    except TooManyRequestsError:
                        pass
                for _ in range(int(rng.integers(1, 6))):
                    hs = list(seqs)
                    toks = rng.integers(0, 50, size=len(hs)).tolist()
                    a.extend(hs, 1, tokens=toks)
                    for x, t in zip(hs, toks):
                        seqs[x].append(t)
                for x, s in seqs.items():
                    if a.known_tokens(x).tolist() != s:
                        raise AssertionError(f"thread {seed}: request {x} lost its tokens")
            except PoolExhaustedError:
                pass  # atomic failure: nothing changed
            a.take_copies()  # nobody runs K/V here; keep the queue short
            a.close(list(seqs), cache=bool(rng.random() < 0.8))
            if rng.random() < 0.1:
                a.evict(int(rng.integers(0, 8)))
    except BaseException as e:  # surfaced in the main thread
        errors.append(e)


def test_threads_share_pages_without_corruption():
    a = SlotAllocator(600, page_size=4, max_requests=THREADS * 3, max_context_len=256)
    errors, stats = [], {"hits": 0}
    barrier = threading.Barrier(THREADS)
    threads = [threading.Thread(target=worker, args=(a, s, errors, barrier, stats)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert not errors, errors
    a.check()
    assert a.open_requests == 0
    assert stats["hits"] > 0, "the shared system prompt never hit"
    assert a.free_pages == a.capacity_pages  # free + evictable
    n = a.cached_pages  # every request is closed: all registered pages are evictable
    assert a.evict(10**6) == n and a.cached_pages == 0 and a.free_pages == a.capacity_pages
    a.check()

"""Outside review of KVPool under threads (rev45): targeted repros of what a
randomized multi-thread hunt and a read of the locks turned up.

Whether ``extend`` asks the core for copy-on-write work is decided by the pool's
``_sharing`` flag, under the pool's lock, set by every call that can leave a page
with two holders. ``swap_in`` is one: a swapped-out request's registered page
whose entry another request's duplicate registration took over comes back as
that request's page (``SlotAllocator.swap_in``), so both hold it.

A ``DiskCache``'s ``store_new`` and ``prefetch`` stage pages through one host buffer;
called from two threads (a scheduler prefetching, a helper storing) they run one at a
time, or a prefetch loads what store_new copied there under its own prompt's hashes.

``ZmqEventPublisher.close()`` is idempotent, also when two threads close at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kvpool

P = 4
JOIN_S = 30.0


def _pool(**kw) -> kvpool.KVPool:
    kw = {"dtype": torch.float32, "page_size": P, "num_pages": 16, "host_pages": 16, "max_requests": 8,
          "max_context_len": 32, **kw}
    return kvpool.KVPool(1, 1, 1, **kw)


def _write(pool, result, values) -> None:
    t = torch.tensor(values, dtype=torch.float32).view(-1, 1, 1)
    pool.write(0, result.out_cache_loc, t, -t)


def _values(pool, h) -> list[float]:
    k, v = pool.read(0, pool.slots(int(h)))
    assert torch.equal(v, -k)
    return k.flatten().tolist()


def _share_by_swap_in(pool):
    """A and B hold the same two full pages of the same tokens: A was swapped out,
    B registered those tokens meanwhile, A came back on B's pages."""
    toks = list(range(10, 18))
    a, ra = pool.admit([8], tokens=toks)
    _write(pool, ra, [1.0] * 8)
    pool.cache(a)
    pool.swap_out(a)
    b, rb = pool.admit([8], tokens=toks)
    _write(pool, rb, [2.0] * 8)
    pool.cache(b)
    pool.swap_in(a)
    return int(a[0]), int(b[0])


def test_a_request_swapped_in_onto_shared_pages_copies_on_write():
    pool = _pool()
    a, b = _share_by_swap_in(pool)
    assert np.array_equal(pool.pages(a), pool.pages(b)), "the scenario no longer shares pages"
    pool.truncate([a], [6])
    r = pool.extend(np.array([a], dtype=np.int64), 2)  # into the shared last page: a copy first
    _write(pool, r, [3.0, 3.0])
    assert _values(pool, b) == [2.0] * 8
    assert _values(pool, a) == [2.0] * 6 + [3.0, 3.0]
    assert pool.allocator.pending_copies == 0
    pool.check()



def test_prefetch_on_one_thread_while_store_new_runs_on_another(tmp_path, monkeypatch):
    """docs/tiers.md runs a DiskCache's calls off the step loop; an engine may prefetch from
    its scheduler while a helper stores. Both calls stage through the cache's one host
    buffer: prefetch filled it with prompt X's pages from disk, store_new then copied the
    pool's prompt-Y pages into it, and prefetch loaded those under X's hashes, so X's prefix
    hit read Y's K/V. Hooks force that interleaving (each pause ends after WINDOW_S)."""
    import kvpool.tiers.disk_cache as disk_cache
    from kvpool.tiers import DiskCache, FileTier

    window_s = 1.0
    tier = FileTier(tmp_path, 1 << 20)
    x, y = list(range(100, 109)), list(range(500, 509))

    def prompt_pool(seed, tokens):
        pool = _pool(host_pages=None, hash_seed=seed)
        h, r = pool.admit([len(tokens)], tokens=tokens)
        _write(pool, r, [float(t) for t in tokens])
        pool.close(h, cache=True)
        return pool

    assert DiskCache(prompt_pool(1, x), tier, model="m").store_new() == 2  # X on disk
    pool = prompt_pool(2, y)  # Y cached here, not yet on disk
    disk = DiskCache(pool, tier, model="m")

    storing, filled, offloaded = threading.Event(), threading.Event(), threading.Event()
    real_offload = disk_cache.offload_pages

    def offload(*args, **kw):  # store_new's copy of Y's pages into the staging buffer
        storing.set()
        filled.wait(window_s)
        real_offload(*args, **kw)
        offloaded.set()

    monkeypatch.setattr(disk_cache, "offload_pages", offload)
    real_lock = pool._lock

    class PausingLock:
        """The pool's lock, except that prefetch, having filled the staging buffer, first
        lets store_new copy into it."""

        def __enter__(self):
            if threading.current_thread().name == "prefetch":
                filled.set()
                offloaded.wait(window_s)
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

        def acquire(self, *args):
            return real_lock.acquire(*args)

        def release(self):
            return real_lock.release()

    monkeypatch.setattr(pool, "_lock", PausingLock())
    got: dict[str, object] = {}

    def run(name, call):
        try:
            got[name] = call()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            got[name] = e

    store = threading.Thread(target=run, args=("stored", disk.store_new), daemon=True)
    store.start()
    assert storing.wait(JOIN_S)
    fetch = threading.Thread(target=run, args=("loaded", lambda: disk.prefetch(x)), name="prefetch", daemon=True)
    fetch.start()
    for t in (store, fetch):
        t.join(JOIN_S)
        assert not t.is_alive(), "deadlock"
    assert got == {"stored": 2, "loaded": 2}, got
    monkeypatch.setattr(pool, "_lock", real_lock)
    hs, cached = pool.open_with_prefix(x, [len(x)])
    assert int(cached[0]) == 8
    assert _values(pool, hs[0])[:8] == [float(t) for t in x[:8]]
    pool.check()


def test_zmq_publisher_closed_from_two_threads_at_once():
    """close() is idempotent; two threads closing at once (an engine's shutdown path and an
    atexit hook) both return. The second used to test the sender thread, queue its stop
    marker, and then call join() on the None the first had left there (AttributeError).
    A hook holds the second between the two until the first has finished."""
    pytest.importorskip("zmq", reason="the events extra (pyzmq) is not installed")
    from kvpool.events import ZmqEventPublisher

    pub = ZmqEventPublisher(_pool(host_pages=None), endpoint="inproc://review-threads-close")
    first_done, second_queued = threading.Event(), threading.Event()
    queue = pub._queue

    class SlowQueue:
        def put(self, item):
            queue.put(item)
            if threading.current_thread().name == "second":
                second_queued.set()
                first_done.wait(JOIN_S)

        def __getattr__(self, name):
            return getattr(queue, name)

    pub._queue = SlowQueue()
    errors: list[BaseException] = []

    def close():
        try:
            pub.close()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    second = threading.Thread(target=close, name="second", daemon=True)
    second.start()
    second_queued.wait(1.0)  # with the fix the second may hold a lock instead: the first then waits
    first = threading.Thread(target=close, name="first", daemon=True)
    first.start()
    first.join(1.0)
    first_done.set()
    for t in (first, second):
        t.join(JOIN_S)
        assert not t.is_alive(), "deadlock"
    assert not errors, errors[0]
    with pytest.raises(kvpool.PublisherClosedError):
        pub.publish()

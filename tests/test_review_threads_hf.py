"""Outside review (rev72): several threads, each with its own KVPoolCache, on one shared KVPool.

Each worker thread runs greedy ``generate`` calls with its own cache on ONE pool (page
sizes 1 and 16, with and without layer buffers, with ``prefix_ids=`` so rows of different
threads share cached pages) while a churn thread opens/extends/closes its own requests,
evicts and caches. Every thread's tokens must equal a ``DynamicCache`` run of the same
prompt made beforehand, and the pool must end consistent with every page free.

A thread that forks/truncates/closes ANOTHER thread's cache's handles mid-generate must
be followed or refused with a typed error (``kvpool.errors``) in the cache's thread, never
corrupt the pool or the other threads' tokens.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from _hf_models import greedy, tiny_model  # noqa: I001  (skips without transformers)
from _thread_window import start_at_call

import kvpool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model

NEW = 12
JOIN_S = 60.0
N_WORKERS = 3
# The plain cache's step extends through either (layer buffers or not): the window ends at both.
HOST_AND_DEVICE_EXTEND = ("_extend_host", "extend")


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model("llama")
    torch.set_num_threads(threads)


def _prompts(seed: int, n: int, shared: torch.Tensor | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tail = torch.randint(3, 90, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g)
        p = tail if shared is None else torch.cat([shared, tail])
        out.append(p[None])
    return out


def _run_threads(targets: list, join_s: float = JOIN_S) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (reported in the main thread)
                errors.append(e)
        return run

    ts = [threading.Thread(target=wrap(f), daemon=True) for f in targets]
    for t in ts:
        t.start()
    for t in ts:
        t.join(join_s)
    assert not any(t.is_alive() for t in ts), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]


def _churn(pool, stop: threading.Event, rng_seed: int) -> None:
    rng = np.random.default_rng(rng_seed)
    while not stop.is_set():
        try:
            h = pool.open(1)
        except kvpool.errors.KVPoolError:
            continue
        try:
            for _ in range(int(rng.integers(1, 4))):
                pool.extend(h, [int(rng.integers(1, 8))])
            if rng.random() < 0.5:
                pool.cache(h)
        except kvpool.errors.KVPoolError:
            pass
        finally:
            pool.close(h)
        pool.evict(int(rng.integers(0, 3)))


def stress(model, page_size: int, layer_buffers: bool, prefix: bool, calls: int = 3, seed: int = 0) -> None:
    shared = torch.randint(3, 90, (2 * page_size + 3,), generator=torch.Generator().manual_seed(seed)) \
        if prefix else None
    work = [_prompts(seed * 10 + w, calls, shared) for w in range(N_WORKERS)]
    with torch.inference_mode():
        refs = [[greedy(model, p, None, NEW).sequences for p in ps] for ps in work]
    pool = pool_for_model(model, max_tokens=4096, page_size=page_size, max_context_len=128, max_requests=32)
    stop = threading.Event()

    def worker(w: int):
        def run():
            for p, ref in zip(work[w], refs[w]):
                with torch.inference_mode():
                    cache = KVPoolCache(pool, prefix_ids=p, layer_buffers=layer_buffers) if prefix \
                        else KVPoolCache(pool, layer_buffers=layer_buffers)
                    with cache:
                        out = greedy(model, p, None, NEW, cache=cache).sequences
                assert torch.equal(out, ref), (w, out, ref)
        return run

    def churn():
        _churn(pool, stop, seed)

    workers = [worker(w) for w in range(N_WORKERS)]

    def all_workers_then_stop():
        try:
            _run_threads(workers)
        finally:
            stop.set()

    _run_threads([all_workers_then_stop, churn])
    pool.allocator.check()
    assert pool.allocator.open_requests == 0
    pool.evict(pool.num_pages)
    assert pool.allocator.used_pages == 0


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("layer_buffers", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_threads_each_with_a_cache_on_one_pool(model, page_size, layer_buffers, prefix):
    stress(model, page_size, layer_buffers, prefix)


# (call 2: the first decode step's extend, or with layer buffers the flush at the first page boundary.)
@pytest.mark.parametrize("layer_buffers, page_size, at_call",
                         [(False, 16, 2), (False, 4, 2), (False, 4, 3), (True, 4, 2), (True, 4, 3), (True, 4, 4)])
def test_a_fork_by_another_thread_just_before_the_step_extends_is_followed(model, layer_buffers, page_size, at_call):
    """A fork is a change the cache follows (its rows' pages become shared). Done by another
    thread after the step's edit check and before its extend, the extend copies the shared
    page on write; the cache must see that too, or attention reads the old page's copy,
    which misses the step's token: a wrong greedy token, not an error."""
    p = _prompts(3, 1, None)[0]
    with torch.inference_mode():
        ref = greedy(model, p, None, NEW).sequences
    pool = pool_for_model(model, max_tokens=1024, page_size=page_size, max_context_len=128)
    forks: list = []
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        # (the raw handles, read as another thread holding them from earlier would: cache.handles
        # flushes the cache, which only the cache's own thread may do)
        started = start_at_call(pool, at_call, lambda: forks.append(pool.fork(int(cache.requests.handles[0]))),
                                HOST_AND_DEVICE_EXTEND)
        out = greedy(model, p, None, NEW, cache=cache).sequences
        for t, _ in started:
            t.join(JOIN_S)
    assert forks, "the hook never ran"
    assert torch.equal(out, ref), (out, ref)
    del pool._extend_host, pool.extend
    pool.close(np.concatenate([np.asarray(f, dtype=np.int64).reshape(-1) for f in forks]))
    pool.allocator.check()
    assert pool.allocator.open_requests == 0


@pytest.mark.parametrize("edit", ["truncate", "close"])
@pytest.mark.parametrize("layer_buffers, at_call", [(False, 2), (False, NEW), (True, 2), (True, 3), (True, 4)])
def test_a_truncate_or_close_by_another_thread_mid_generate_is_refused_or_lands_after(model, layer_buffers, edit,
                                                                                       at_call):
    """Truncate and close are changes the cache cannot follow: done by another thread around a
    step's extend, generate either raises the typed error (at the next step) or, where the edit
    waited for the pool's lock, gives the right tokens; never wrong tokens, and the pool stays
    consistent with every page back once the cache is closed."""
    p = _prompts(5, 1, None)[0]
    with torch.inference_mode():
        ref = greedy(model, p, None, NEW).sequences
    pool = pool_for_model(model, max_tokens=1024, page_size=4, max_context_len=128)
    done: list = []

    def other():
        h = cache.requests.handles
        if edit == "truncate":
            pool.truncate(h, np.maximum(np.asarray(pool.lengths(h), dtype=np.int64) - 3, 1))
        else:
            pool.close(h)
        done.append(edit)

    out = None
    with torch.inference_mode(), KVPoolCache(pool, layer_buffers=layer_buffers) as cache:
        started = start_at_call(pool, at_call, other, HOST_AND_DEVICE_EXTEND)
        try:
            out = greedy(model, p, None, NEW, cache=cache).sequences
        except kvpool.errors.KVPoolError:
            pass
        for t, _ in started:
            t.join(JOIN_S)
    assert done, "the hook never ran"
    if out is not None:
        assert torch.equal(out, ref), (out, ref)
    del pool._extend_host, pool.extend
    pool.allocator.check()
    assert pool.allocator.open_requests == 0


def test_a_row_closed_by_another_thread_while_the_cache_closes_leaves_no_request_open(model, monkeypatch):
    """Sweep s82: the cache's close() closes its rows; when one was closed through the pool already
    it closes those still open. Another thread closing a second row between that check and that
    close made the close raise InvalidHandleError, and the third row, which the cache no longer
    named, stayed open in the pool for good. The check and the close now hold the pool's lock: the
    other thread's close waits, then finds its row closed (typed), and every request is closed."""
    p = _prompts(9, 1, None)[0].expand(3, -1)
    pool = pool_for_model(model, max_tokens=1024, page_size=4, max_context_len=128)
    with torch.inference_mode():
        cache = KVPoolCache(pool)
        greedy(model, p, None, 3, cache=cache)
    h = cache.requests.handles.copy()
    pool.close(h[:1])  # row 0 closed through the pool: close() must look at which are open
    is_open, calls, outcome = pool.is_open, [], []

    def other():
        try:
            pool.close(h[1:2])
            outcome.append("closed")
        except kvpool.errors.KVPoolError as e:
            outcome.append(type(e).__name__)

    def hooked(handle):
        calls.append(handle)
        if len(calls) == h.shape[0]:  # the cache has looked at every row: another thread closes row 1
            t = threading.Thread(target=other, daemon=True)
            t.start()
            t.join(0.5)  # (with the fix it waits for the pool's lock, so the join times out)
            threads.append(t)
        return is_open(handle)

    threads: list[threading.Thread] = []
    monkeypatch.setattr(pool, "is_open", hooked)
    cache.close()
    monkeypatch.undo()
    for t in threads:
        t.join(JOIN_S)
    assert threads and not threads[0].is_alive()
    assert outcome == ["InvalidHandleError"], outcome
    assert pool.allocator.open_requests == 0
    pool.allocator.check()


def test_a_close_by_another_thread_inside_a_crop_waits_for_it(model, monkeypatch):
    """A crop of rows another caller truncated through the pool, while decode steps were still
    deferred in the layer buffers, truncates the rows and then stores the pending tokens below the
    new length at the rows' slots (``store_below``). Another thread closing the rows in between
    (its close, or a new request taking their freed slots) made the crop fail on rows it had just
    truncated; the truncate and the stores now hold the pool's lock, so the close waits for them."""
    p = _prompts(11, 1, None)[0]
    pool = pool_for_model(model, max_tokens=1024, page_size=16, max_context_len=128)
    with torch.inference_mode():
        cache = KVPoolCache(pool, layer_buffers=True)
        greedy(model, p, None, 6, cache=cache)
    req = cache.requests
    assert req.deferred, "the steps inside the page should still be deferred"
    h = req.handles.copy()
    n = cache.get_seq_length()
    pool.truncate(h, np.full(h.shape[0], n - req.deferred - 1, dtype=np.int64))  # through the pool
    real, threads, outcome = pool.truncate, [], []

    def other():
        pool.close(h)
        outcome.append("closed")

    def hooked(handles, lengths):
        real(handles, lengths)
        t = threading.Thread(target=other, daemon=True)
        t.start()
        t.join(0.5)  # (with the fix it waits for the pool's lock, so the join times out)
        threads.append(t)

    monkeypatch.setattr(pool, "truncate", hooked)
    cache.crop(-(req.deferred + 3))
    monkeypatch.undo()
    for t in threads:
        t.join(JOIN_S)
    assert threads and not threads[0].is_alive() and outcome == ["closed"], outcome
    assert pool.allocator.open_requests == 0
    pool.allocator.check()

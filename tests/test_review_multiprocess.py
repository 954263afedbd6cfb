"""kvpool in multi-process engines (vLLM's multiproc executor, SGLang's scheduler and
detokenizer processes, DataLoader workers): exceptions and plain results cross a
process boundary intact, pools refuse to be pickled with a clear TypeError, a forked
child never waits on a lock a parent thread held at the fork, and a spawned child
builds its own pool.

Forked children run with a hard deadline (``_forked``): a hang fails the test and the
child is killed, so a regression never leaves the suite stuck.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from forking import forked as _forked

import kvpool
import kvpool.errors
from kvpool import GroupedAllocator, KVPool, SlotAllocator


def _pool() -> KVPool:
    return KVPool(2, 2, 8, page_size=4, num_pages=64, max_requests=8, max_context_len=64, dtype=torch.float32)


# ----- (1) exceptions ----------------------------------------------------------------

def _instance(cls: type) -> BaseException:
    if cls is kvpool.RankDivergenceError:
        return cls("ranks differ", rank=2, ranks=(2, 3))
    if cls is kvpool.TransferRejectedError:
        return cls("no room", reason="exhausted")
    return cls(f"what went wrong in a {cls.__name__}")


@pytest.mark.parametrize("name", kvpool.errors.__all__)
def test_every_error_survives_a_pickle_round_trip(name):
    cls = getattr(kvpool.errors, name)
    e = _instance(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls
    assert str(back) == str(e) and back.args == e.args
    assert vars(back) == vars(e)  # RankDivergenceError.rank/ranks, TransferRejectedError.reason
    assert isinstance(back, kvpool.KVPoolError)


def _raise_core_error(kind: str) -> None:
    a = SlotAllocator(4, 4, 2, 64, handle_seed=7)  # the same handle, so the same message
    h = a.open(1)
    if kind == "exhausted":
        a.extend(h, [64])
    elif kind == "handle":
        a.close(h)
        a.extend(h, [1])
    else:
        a.extend(h, [-1])


@pytest.mark.parametrize("kind,cls", [("exhausted", kvpool.PoolExhaustedError),
                                      ("handle", kvpool.InvalidHandleError),
                                      ("argument", kvpool.InvalidArgumentError)])
def test_an_error_raised_in_a_worker_process_arrives_with_its_type_and_message(kind, cls):
    with pytest.raises(cls) as here:
        _raise_core_error(kind)
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        fut = ex.submit(_raise_core_error, kind)
        with pytest.raises(cls) as there:
            fut.result(timeout=20)
    assert type(there.value) is cls and str(there.value) == str(here.value)


# ----- (2) what pickles and what does not ---------------------------------------------

def test_pools_and_their_companions_refuse_pickle_with_a_type_error_naming_them(tmp_path):
    from kvpool.events import LocalEventPublisher
    from kvpool.tiers.disk_cache import DiskCache
    from kvpool.tiers.file_tier import FileTier

    pool = _pool()
    hybrid = KVPool(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])
    objs = [pool, hybrid, SlotAllocator(8, 4, 2, 16),
            GroupedAllocator([{"kind": "full", "num_pages": 4, "page_size": 4}], 4, 16),
            LocalEventPublisher(pool), DiskCache(pool, FileTier(tmp_path, 1 << 20))]
    try:  # (the 'hf' extra; transformers 5.23 refuses torch < 2.6)
        from kvpool.integrations.transformers import KVPoolCache
    except ImportError:
        pass
    else:
        objs.append(KVPoolCache(pool))
    for obj in objs:
        name = type(obj).__name__
        with pytest.raises(TypeError, match=name) as e:
            pickle.dumps(obj)
        assert "pickle" in str(e.value), str(e.value)


def test_plain_results_round_trip_and_compare_equal():
    pool = _pool()
    h = pool.open(2)
    step = pool.extend(h, [5, 3], np.arange(8))
    stats, table, events = pool.stats(), pool.page_table(h), pool.take_events()

    assert np.array_equal(pickle.loads(pickle.dumps(h)), h)
    back = pickle.loads(pickle.dumps(step))
    assert np.array_equal(back.slots, step.slots) and torch.equal(back.out_cache_loc, step.out_cache_loc)
    back = pickle.loads(pickle.dumps(table))
    for f in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        assert torch.equal(getattr(back, f), getattr(table, f))
    back = pickle.loads(pickle.dumps(events))
    assert back.keys() == events.keys() and all(np.array_equal(back[k], events[k]) for k in events)

    back = pickle.loads(pickle.dumps(stats))
    assert type(back) is type(stats) and back == stats and repr(back) == repr(stats)
    pool.extend(h, [4, 4])
    assert pool.stats() != stats  # equality compares the counters, not identity


# ----- (3) os.fork() ---------------------------------------------------------------

def _use(pool: KVPool) -> str:
    h = pool.open(1)
    pool.extend(h, [6])
    pool.close(h)
    pool.allocator.check()
    return "ok"


def test_a_forked_child_uses_its_copy_of_a_used_pool():
    pool = _pool()
    h = pool.open(2)
    pool.extend(h, [5, 3], np.arange(8))
    before = pool.stats()
    assert _forked(lambda: _use(pool)) == (0, "ok")
    assert pool.stats() == before  # the child's calls changed its copy only


def _fork_while(busy: Callable[[], None], child: Callable[[], object], forks: int = 12) -> None:
    """Forks ``forks`` times while another thread runs ``busy`` in a loop, so that at some
    fork that thread is inside a call holding the pool's locks; each child must finish."""
    stop = threading.Event()
    errors: list[BaseException] = []
    rounds = [0]

    def loop() -> None:
        try:
            while not stop.is_set():
                busy()
                rounds[0] += 1
        except BaseException as e:  # noqa: BLE001 - checked below: a dead thread would test nothing
            errors.append(e)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        for _ in range(forks):
            time.sleep(0.002)
            assert _forked(child) == (0, "ok")
    finally:
        stop.set()
        t.join()
    assert not errors and rounds[0] > 0, (errors, rounds)


def test_fork_while_another_thread_is_inside_a_large_allocator_call():
    # Large calls run with the GIL released, holding the allocator's mutex.
    a = SlotAllocator(1 << 17, 1, 4200, 64)

    def busy() -> None:
        h = a.open(4096)
        a.extend(h, np.full(4096, 16))
        a.close(h)

    def child() -> str:
        a.close(a.open(1))
        return "ok"

    _fork_while(busy, child)


def test_fork_while_another_thread_is_inside_a_pool_call():
    pool = KVPool(1, 1, 8, page_size=1, num_pages=1 << 15, max_requests=4200, max_context_len=8,
                  dtype=torch.float32)

    def busy() -> None:
        h = pool.open(4096)
        pool.extend(h, np.full(4096, 4))
        pool.close(h)

    _fork_while(busy, lambda: _use(pool))


def test_fork_while_another_thread_publishes_events():
    from kvpool.events import LocalEventPublisher

    class SlowDelivery(LocalEventPublisher):
        def _deliver(self, seq_b: bytes, payload: bytes) -> None:
            time.sleep(0.001)  # as a network delivery would: publish() holds its lock, GIL released
            super()._deliver(seq_b, payload)

    pool = _pool()
    pub = SlowDelivery(pool)
    tokens = iter(range(1 << 40))

    def busy() -> None:
        h = pool.open(1)
        pool.extend(h, [8], np.fromiter(tokens, np.int64, 8))  # new tokens: new pages to publish
        pool.close(h, cache=True)
        pub.publish()
        pub.drain()

    def child() -> str:
        busy()
        return "ok"

    _fork_while(busy, child)


def test_zmq_publisher_in_a_forked_child_raises_instead_of_hanging():
    from kvpool.events import ZmqEventPublisher

    pool = _pool()
    pub = ZmqEventPublisher(pool, "tcp://127.0.0.1:0")
    try:
        def child() -> str:
            h = pool.open(1)
            pool.extend(h, [8], np.arange(8))
            pool.close(h, cache=True)
            with pytest.raises(kvpool.PublisherClosedError, match="fork"):
                pub.publish()
            with pytest.raises(kvpool.PublisherClosedError, match="fork"):
                pub.flush()
            pub.close()  # the child's copy: closing it must not touch the parent's sockets
            return "ok"

        assert _forked(child) == (0, "ok")
        h = pool.open(1)
        pool.extend(h, [8], np.arange(8))
        pool.close(h, cache=True)
        assert pub.publish() > 0 and pub.flush(timeout=10)
    finally:
        pub.close()


# ----- (4) the spawn start method -------------------------------------------------------

def _spawned_child() -> tuple[int, bool, int, int]:
    import torch as t

    tasks_before = len(os.listdir("/proc/self/task"))
    import kvpool as k

    tasks_after = len(os.listdir("/proc/self/task"))
    pool = k.KVPool(1, 1, 8, page_size=4, num_pages=8, dtype=t.float32)
    h = pool.open(1)
    pool.extend(h, [5])
    return threading.active_count(), t.cuda.is_initialized(), tasks_after - tasks_before, pool.stats().used_pages


def test_a_spawned_child_imports_kvpool_without_side_effects_and_builds_its_own_pool():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        py_threads, cuda_initialized, new_native_threads, used_pages = ex.submit(_spawned_child).result(timeout=20)
    assert (py_threads, cuda_initialized, new_native_threads, used_pages) == (1, False, 0, 2)

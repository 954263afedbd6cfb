"""``copy.copy`` / ``copy.deepcopy`` of objects whose copy would share their state refuse with
``CopyRefusedError`` (a ``KVPoolError`` and a ``TypeError``) that names the object and says what
to do: a ``DecodeGraphRunner``'s copy shared its graphs' static buffers (and ``deepcopy`` failed on
the pool's pickling refusal, naming pickling), a ``KVPoolCollector``'s exported its pools twice;
a pool's, a publisher's and a ``DiskCache``'s refused with the pickling message. ``pickle`` keeps
that message."""

from __future__ import annotations

import copy
import pickle
import tempfile

import pytest
import torch

import kvpool
from kvpool.errors import CopyRefusedError, KVPoolError

# Python 3.13's copy.replace() calls the class's __replace__ (a modified copy); on older Pythons
# the same call is made directly, so the refusal is checked on every Python.
replace = getattr(copy, "replace", lambda obj, **changes: type(obj).__replace__(obj, **changes))


def test_graph_runner_and_collector_refuse_copies():
    from kvpool.cuda_graph import DecodeGraphRunner

    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=64, max_requests=2, max_context_len=32)
    runner = DecodeGraphRunner(pool, lambda *a: a[0].float(), max_batch_size=2, enable_graphs=False)
    objs = [runner]
    try:
        from kvpool.metrics import KVPoolCollector

        objs.append(KVPoolCollector(pool))
    except ImportError:  # (prometheus_client is an extra)
        pass
    for obj in objs:
        for how in (copy.copy, copy.deepcopy, replace):
            with pytest.raises(CopyRefusedError, match=f"cannot copy a {type(obj).__name__}: .*build another") as e:
                how(obj)
            assert isinstance(e.value, KVPoolError) and isinstance(e.value, TypeError)


def test_pools_publishers_and_disk_caches_refuse_copies_and_keep_the_pickling_message():
    from kvpool.events import LocalEventPublisher
    from kvpool.tiers import DiskCache, FileTier

    pool = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=64, max_requests=2, max_context_len=32,
                         host_pages=8)
    hybrid = kvpool.KVPool(2, 2, 4, dtype=torch.float32, page_size=4, num_slots=256, max_requests=3,
                           max_context_len=64, layer_types=["linear_attention", "full_attention"],
                           state_shapes={"recurrent": (2, 4, 4)})
    h = pool.open(1)
    with tempfile.TemporaryDirectory() as d:
        disk = DiskCache(pool, FileTier(d, max_bytes=1 << 20), model="m")
        for obj in (pool, hybrid, LocalEventPublisher(pool), disk, pool.host):
            name = type(obj).__name__
            for how in (copy.copy, copy.deepcopy, replace):
                with pytest.raises(CopyRefusedError, match=f"cannot copy a {name}: .*(or build another|pool.host)"):
                    how(obj)
            with pytest.raises(TypeError, match=f"cannot pickle a {name}") as e:
                pickle.dumps(obj)
            assert not isinstance(e.value, CopyRefusedError)
    assert pool.open_requests == 1 and pool.is_open(int(h[0]))


@pytest.mark.parametrize("make", [
    lambda: kvpool.SlotAllocator(64, page_size=16, max_requests=4, max_context_len=64),
    lambda: kvpool.GroupedAllocator([{"kind": "full", "num_pages": 4, "page_size": 4}], 4, 16),
], ids=["SlotAllocator", "GroupedAllocator"])
def test_allocators_refuse_copies_typed_and_pickling_by_name(make):
    # Both fell through to copyreg's "cannot pickle 'kvpool._core.SlotAllocator' object": a
    # pickling message for a copy, untyped, naming neither what to do nor the class plainly.
    a = make()
    name = type(a).__name__
    h = a.open(1)
    before = a.stats()
    for how in (copy.copy, copy.deepcopy, replace, lambda a: replace(a, page_size=1)):
        with pytest.raises(CopyRefusedError, match=f"cannot copy a {name}: .*fork\\(\\) a request") as e:
            how(a)
        assert isinstance(e.value, KVPoolError) and isinstance(e.value, TypeError)
    # A memo holding the allocator (a deepcopy of a structure that names it twice) refuses alike.
    with pytest.raises(CopyRefusedError):
        copy.deepcopy({"a": a, "b": [a]})
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
        with pytest.raises(TypeError, match=f"cannot pickle a {name}: .*stats\\(\\)") as p:
            pickle.dumps(a, protocol=protocol)
        assert not isinstance(p.value, CopyRefusedError)
    assert a.stats() == before and a.is_open(int(h[0]))
    # stats() is what the message says to send: it still pickles.
    assert pickle.loads(pickle.dumps(a.stats())) == before

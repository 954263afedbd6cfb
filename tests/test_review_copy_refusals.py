"""``copy.copy`` / ``copy.deepcopy`` of objects whose copy would share their state refuse with
``CopyRefusedError`` (a ``KVPoolError`` and a ``TypeError``) that names the object and says what
to do: a ``DecodeGraphRunner``'s copy shared its graphs' static buffers (and ``deepcopy`` failed on
the pool's pickling refusal, naming pickling), a ``KVPoolCollector``'s exported its pools twice."""

from __future__ import annotations

import copy

import pytest
import torch

import kvpool
from kvpool.errors import CopyRefusedError, KVPoolError


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
        for how in (copy.copy, copy.deepcopy):
            with pytest.raises(CopyRefusedError, match=f"cannot copy a {type(obj).__name__}: .*build another") as e:
                how(obj)
            assert isinstance(e.value, KVPoolError) and isinstance(e.value, TypeError)

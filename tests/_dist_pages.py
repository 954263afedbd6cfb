"""Per-rank body of the descending-pages transfer test (spawned by tests/_dist.py).

Both ranks first cache a long prompt and then take pages for a new request with
only a few pages free, so the request gets the free pages and then cached pages
evicted from the LRU, tail first: page ids that run downwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import kvpool
from kvpool.distributed import chunks, kv_transfer

PAGE, MAX_CTX = 4, 80
LENGTH = 38


def make_pool() -> kvpool.KVPool:
    return kvpool.KVPool(2, 2, 8, dtype=torch.float32, page_size=PAGE, num_pages=24, max_requests=4,
                         max_context_len=MAX_CTX)


def fill_lru(pool: kvpool.KVPool, seed: int) -> None:
    prompt = np.random.default_rng(seed).integers(0, 1000, size=MAX_CTX)
    hs, _ = pool.open_with_prefix(prompt, [MAX_CTX])
    pool.extend(hs, MAX_CTX)
    pool.close(hs, cache=True)


def descending(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"pages": [], "kv": []}
    for chunk_bytes, max_runs in ((chunks.DEFAULT_CHUNK_BYTES, 32), (1, 0)):
        chunks.MAX_RUNS = max_runs  # 0: pack and unpack with index ops instead of page runs
        pool = make_pool()
        fill_lru(pool, seed=rank)
        dist.barrier()
        if rank == 0:
            h = int(pool.open(1)[0])
            pool.extend([h], LENGTH)
            g = torch.Generator().manual_seed(11)
            for layer in range(pool.num_layers):
                x = torch.randn(LENGTH, 2, 8, generator=g)
                pool.write(layer, pool.slots(h), x, x * 3)
            kv_transfer.send_request(pool, h, 1, chunk_bytes=chunk_bytes)
        else:
            h = kv_transfer.recv_request(pool, 0)
        out["pages"].append(pool.pages(h).tolist())
        out["kv"].append([pool.read(layer, pool.slots(h)) for layer in range(pool.num_layers)])
        pool.close([h])
        pool.check()
    return out

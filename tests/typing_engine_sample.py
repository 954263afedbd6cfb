"""An engine's calls into kvpool, type-checked by tests/test_review_typing.py (mypy --strict).

Never run (nor collected by pytest): it is only read by mypy. Each ``assert_type`` pins
what a call returns as mypy sees it; ``reveal_type`` lines must not reveal ``Any``.
Calls are written as README.md and docs/*.md write them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import assert_type, reveal_type

import kvpool
from kvpool import GroupedAllocator, KVPool, PoolStats, SlotAllocator
from kvpool.distributed import tp_pool
from kvpool.events import BlockStored, KVEventBatch, LocalEventPublisher, ZmqEventPublisher, schema
from kvpool.hybrid import HybridKVPool
from kvpool.integrations.transformers import KVPoolCache, pool_for_model
from kvpool.router import Route, Router, ZmqFeed

I64 = npt.NDArray[np.int64]


def allocator_step() -> int:
    """README.md / docs/allocator.md: the Rust allocator on its own."""
    a = SlotAllocator(num_pages=1 << 16, page_size=16, max_requests=256, max_context_len=4096)
    reqs = a.open(3)
    slots = a.extend(reqs, [17, 1, 40])
    assert_type(slots, I64)
    out = np.empty(8192, np.int64)
    assert_type(a.extend(reqs, 1, out=out), I64)
    assert_type(a.extend(reqs, 1, cow=False), I64)
    assert_type(a.extend(reqs, 1, cow=True), tuple[I64, "I64 | None"])
    assert_type(a.extend(reqs, 1, None, None, True, out), tuple[I64, "I64 | None"])
    new_slots, cow = a.extend(reqs, 1, cow=True, out=out)
    if cow is not None:
        reveal_type(cow)
    return int(slots[0]) + int(new_slots[0])


def route_and_publish(pool: KVPool, prompt: list[int]) -> int:
    """docs/events-and-metrics.md: names kvpool.router and kvpool.events load on first use."""
    pub = LocalEventPublisher(pool)
    r = Router(2, page_size=16, hash_seed=0)
    for msg in pub.drain():
        r.feed(0, *msg)
    route = r.route(prompt)
    assert_type(route, Route)
    assert_type(route.pool, int)
    feed = ZmqFeed(r)
    assert_type(feed.poll(10), int)
    zpub = ZmqEventPublisher(pool, "tcp://*:5557", replay_endpoint="tcp://*:5558")
    assert_type(zpub.publish(), int)
    reveal_type(zpub)
    reveal_type(KVEventBatch)
    reveal_type(kvpool.send_request)
    return route.pool


def pool_step(pool: KVPool, running: I64, finished: I64, prompt_lens: list[int]) -> int:
    """README.md: a scheduler step on the torch pool; its counters are forwarded from the allocator."""
    pool.close(finished)
    new, prefill = pool.admit(prompt_lens)
    decode = pool.extend(running, 1)
    assert_type(pool.free_pages, int)
    assert_type(pool.admissible_tokens, int)
    assert_type(pool.hit_tokens, int)
    assert_type(pool.clock, float)
    assert_type(pool.kv_events, bool)
    reveal_type(decode.out_cache_loc)
    return pool.free_pages + len(new) + len(prefill.slots)


def pool_parts(pool: KVPool) -> int:
    """pool.allocator (README: reachable for tests and tools) and the host tier (docs/tiers.md)."""
    assert_type(pool.allocator, SlotAllocator)
    assert_type(pool.allocator.stats(), PoolStats)
    reveal_type(pool.host)
    return pool.allocator.free_pages


def read_events(payload: bytes) -> int:
    """docs/events-and-metrics.md: a consumer decodes a publisher's payload with kvpool.events.schema."""
    batch = schema.decoder().decode(payload)
    assert_type(batch, KVEventBatch)
    stored = 0
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            assert_type(ev.block_hashes, "list[bytes | int]")
            stored += len(ev.block_hashes)
    return stored + len(KVEventBatch(ts=0.0, events=[]).events)


def hf_cache(model: torch.nn.Module) -> int:
    """docs/transformers.md: a transformers model on a pool, through KVPoolCache."""
    pool = pool_for_model(model, max_tokens=16384, page_size=16)
    assert_type(pool, KVPool)
    with KVPoolCache(pool) as cache:
        assert_type(cache, KVPoolCache)
        handles = cache.handles
        reveal_type(handles)
        reveal_type(cache.cached_lens)
        if handles is not None:
            return int(pool.lengths(handles).sum())
    return 0


def grad_modes(model: torch.nn.Linear, t: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """docs/grad-modes.md: audit a model, and make inference tensors normal again."""
    for finding in kvpool.audit(model):
        reveal_type(finding)
    assert_type(kvpool.mutable(model), torch.nn.Linear)
    assert_type(kvpool.mutable(p), torch.nn.Parameter)
    with kvpool.persistent():
        return kvpool.mutable(t)


def decode_with_graphs(pool: KVPool) -> torch.Tensor:
    """docs/kernels-and-graphs.md: run() returns what the step returns (cut to the real batch)."""

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor, req_rows: torch.Tensor,
                    out_cache_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return input_ids.float()

    runner = kvpool.DecodeGraphRunner(pool, decode_step, max_batch_size=256)
    runner.capture()
    logits = runner.run([1, 2], [5, 7], [0, 1], [33, 65], [6, 8])
    assert_type(logits, torch.Tensor)
    return logits


class EngineHoldingARunner:
    """An engine's attribute annotated with the bare class, as before it was generic: its
    step's type defaults to Any (no "Missing type arguments" under --strict)."""

    runner: kvpool.DecodeGraphRunner | None = None

    def logits(self) -> object:
        assert self.runner is not None
        return self.runner.run([1], [5], [0], [33], [6])


def hybrid_pool(pool: HybridKVPool) -> int:
    """docs/hybrid.md (built as HybridKVPool for type checkers) and docs/groups.md: its GroupedAllocator."""
    assert_type(pool.allocator, GroupedAllocator)
    assert_type(pool.allocator.free_pages(0), int)
    return pool.free_pages(0)


def tensor_parallel(tokens: list[int]) -> int:
    """docs/distributed.md: tp_pool's TPPool is used exactly like the pool (calls pass through)."""
    pool = tp_pool(32, 8, 128, dtype=torch.bfloat16, device="cuda", page_size=16, num_pages=1 << 14)
    assert_type(pool.num_kv_heads, int)
    assert_type(pool.free_pages, int)
    reqs = pool.open(1)
    step = pool.extend(reqs, len(tokens))
    reveal_type(step)
    pool.verify()
    return pool.num_kv_heads

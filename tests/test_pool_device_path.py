"""The device path of KVPool's table updates, run on CPU by clearing ``_table_np``
(the CPU shortcut that lets the core write the table itself): what a CUDA pool runs.

- ``open_with_prefix`` with several prompts, some missing and some hitting the
  cache, in any order: every request's row must hold exactly its own slots.
- A failed table update after the core committed (an injected CUDA OOM) rolls
  ``extend`` back exactly, for odd batch sizes too: the packed result pads its
  header segments to an even length, and the rollback reads the old lengths
  from one of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
import kvpool.extending as pool_module


def device_path_pool(**kw) -> kvpool.KVPool:
    kw = {"page_size": 4, "num_pages": 64, "max_requests": 12, "max_context_len": 48, **kw}
    pool = kvpool.KVPool(1, 1, 2, dtype=torch.float32, **kw)
    pool._table_np = None
    return pool


def rows_match(pool: kvpool.KVPool, handles) -> None:
    for h in np.asarray(handles).reshape(-1):
        slots = pool.slots(int(h))
        row = int(pool.rows([int(h)])[0])
        got = pool.req_to_token[row, : len(slots)].tolist()
        assert got == slots.tolist(), f"request {int(h):#x} (row {row}) reads {got}, owns {slots.tolist()}"


SYSTEM = list(range(500, 516))  # 4 full pages


def prompt(tail: list[int]) -> list[int]:
    return SYSTEM + tail


@pytest.mark.parametrize("order", ["miss_then_hit", "hit_then_miss", "mixed"])
def test_open_with_prefix_writes_each_request_its_own_prefix(order):
    pool = device_path_pool()
    h, _ = pool.open_with_prefix(prompt([1, 2, 3]), [19])
    pool.extend(h, 19, tokens=prompt([1, 2, 3]))
    pool.cache(h)
    other = list(range(900, 913))  # shares nothing
    prompts = {
        "miss_then_hit": [other, prompt([7] * 6), other[:6], prompt([8, 9])],
        "hit_then_miss": [prompt([4] * 5), other, prompt([5] * 9), other[:5]],
        "mixed": [other[:3], prompt([6]), other, prompt([1, 2, 3, 4, 5]), other[:9]],
    }[order]
    hs, cached = pool.open_with_prefix(np.concatenate(prompts), [len(p) for p in prompts])
    want = [16 if p[:16] == SYSTEM else 0 for p in prompts]
    assert cached.tolist() == want
    rows_match(pool, hs)
    # The hits share the cached pages; the misses hold nothing yet.
    for hh, c in zip(hs, want):
        assert pool.length(int(hh)) == c
        if c:
            assert pool.pages(int(hh)).tolist() == pool.pages(int(h[0])).tolist()[:4]
    # Prefill the rest of every prompt: rows stay right, and the tables of the hits
    # still point at the shared pages.
    pool.extend(hs, [len(p) - c for p, c in zip(prompts, want)], tokens=np.concatenate(
        [p[c:] for p, c in zip(prompts, want)]))
    rows_match(pool, np.concatenate([hs, h]))
    kids = pool.fork(hs[1], 3)
    rows_match(pool, kids)
    pool.check()


def state(pool: kvpool.KVPool, hs) -> tuple:
    return (pool.free_pages, pool.open_requests, pool.lengths(hs).tolist(),
            [pool.slots(int(h)).tolist() for h in hs], pool.req_to_token.clone().numpy().tobytes())


def fail_table_update(*args, **kwargs):
    raise RuntimeError("CUDA error: out of memory (injected)")


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("shared", [False, True], ids=["private", "copy-on-write"])
def test_failed_table_update_rolls_back_odd_batches_exactly(monkeypatch, batch, shared):
    pool, twin = device_path_pool(), device_path_pool()
    lengths = [3, 6, 1, 8, 5][:batch]  # each request starts mid-page, at its own length
    pair = []
    for p in (pool, twin):
        hs, res = p.admit(lengths)
        x = torch.arange(2.0 * sum(lengths)).view(-1, 1, 2)
        p.write(0, res.slots, x, -x)
        if shared:
            p.fork(hs[0], 1)  # the first request's last page is shared: extend copies it
        pair.append(hs)
    hs, ht = pair
    first = pool.read(0, pool.slots(int(hs[0])))
    counts = [2, 5, 3, 1, 4][:batch]
    before = state(pool, hs)
    monkeypatch.setattr(pool_module, "update_req_to_token", fail_table_update)
    with pytest.raises(RuntimeError, match="injected"):
        pool.extend(hs, counts, tokens=list(range(sum(counts))) if shared else None)
    monkeypatch.undo()
    after = state(pool, hs)
    if shared:
        # The first request keeps its private copy of the shared page (the copy ran
        # before the rollback, table entries included); everything else is as before.
        assert after[0] == before[0] - 1 and after[1:3] == before[1:3] and after[3][1:] == before[3][1:]
        assert after[3][0] != before[3][0]
        rows_match(pool, hs)
        k, v = pool.read(0, pool.slots(int(hs[0])))
        assert torch.equal(k, first[0]) and torch.equal(v, first[1])
    else:
        assert after == before
    pool.check()
    # The free stack is back in its old order: the retried call hands out the same
    # slots as a twin that never failed (the first request's copy aside).
    if not shared:
        got = pool.extend(hs, counts).slots.tolist()
        assert got == twin.extend(ht, counts).slots.tolist()
        assert torch.equal(pool.req_to_token, twin.req_to_token)
    else:
        pool.extend(hs, counts, tokens=list(range(sum(counts))))
    rows_match(pool, hs)
    pool.check()

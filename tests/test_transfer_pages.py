"""Page runs (distributed/pages.py) and transfers of page lists that are not ascending.

``contiguous_runs`` splits page ids into runs of consecutive ascending ids; a
descending list (pages re-taken from the LRU after eviction, tail first) is one
run per page. ``cache_pages`` views any pool's pages as whole words, and a
transfer of a descending page list moves every page to the right place, by page
runs and by index ops.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpool
from kvpool.distributed import contiguous_runs, page_descriptors
from kvpool.distributed.pages import cache_pages

sys.path.insert(0, str(Path(__file__).parent))
import _dist  # noqa: E402
import _dist_pages as D  # noqa: E402


@pytest.mark.parametrize("pages, starts, lengths", [
    ([5, 4, 3], [5, 4, 3], [1, 1, 1]),
    ([11, 10, 9, 8, 7, 6, 5, 4, 3, 2], list(range(11, 1, -1)), [1] * 10),
    ([21, 22, 23, 20, 19, 18], [21, 20, 19, 18], [3, 1, 1, 1]),
    ([7, 8, 9, 3, 2, 10, 11], [7, 3, 2, 10], [3, 1, 1, 2]),
    ([4, 4], [4, 4], [1, 1]),
    ([9], [9], [1]),
    ([], [], []),
])
def test_contiguous_runs_only_joins_ascending_neighbours(pages, starts, lengths):
    s, n = contiguous_runs(np.asarray(pages, dtype=np.int32))
    assert s.tolist() == starts and n.tolist() == lengths
    assert s.dtype == np.int64 and n.dtype == np.int64
    # The runs cover exactly the pages, in order.
    assert [int(a) + i for a, k in zip(s, n) for i in range(k)] == list(pages)


def lru_pool(**kw) -> kvpool.KVPool:
    pool = kvpool.KVPool(3, 2, 8, dtype=torch.float16, page_size=4, num_pages=12, max_requests=4,
                         max_context_len=40, layout="paged", **kw)
    hs, _ = pool.open_with_prefix(list(range(40)), [40])
    pool.extend(hs, 40)
    pool.close(hs, cache=True)
    return pool


def test_descending_pages_from_the_lru_are_addressed_right():
    pool = lru_pool()
    h = pool.open(1)
    pool.extend(h, 40)  # 1 free page, then 9 evicted from the LRU, tail first
    pages = pool.pages(h[0]).tolist()
    assert pages[1:] == sorted(pages[1:], reverse=True) and len(pages) == 10
    for layer in range(3):
        pool.k_buffer(layer).copy_(torch.randn(pool.k_buffer(layer).shape))
        pool.v_buffer(layer).copy_(torch.randn(pool.v_buffer(layer).shape))
    for merge in (True, False):
        desc = page_descriptors(pool, pages, merge=merge)
        assert desc.shape == (2 * 3 * len(pages), 3)  # no two descending pages merge
        it = iter(desc)
        for buf in (pool.k_buffer, pool.v_buffer):
            for layer in range(3):
                for p in pages:
                    addr, nbytes, _ = next(it)
                    assert ctypes.string_at(int(addr), int(nbytes)) == buf(layer)[p].contiguous().numpy().tobytes()


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 1), (torch.float16, 2), (torch.float8_e4m3fn, 4)])
def test_cache_pages_views_pools_whose_rows_are_not_whole_words(dtype, dim):
    kw = {"compute_dtype": torch.float32} if dtype == torch.float8_e4m3fn else {}
    pool = kvpool.KVPool(2, 1, dim, dtype=dtype, page_size=8, num_pages=6, max_requests=2, max_context_len=16, **kw)
    views = cache_pages(pool)
    assert len(views) == 2
    for (_, cache), view in zip(pool._storage.tensors(), views):
        assert view.shape[:2] == (2, 6) and view.data_ptr() == cache.data_ptr()
        page_bytes = 8 * dim * cache.element_size()
        assert view.shape[2] * view.element_size() == page_bytes
        view[1, 3].fill_(-1)  # page 3 of layer 1, every byte set
        raw = cache.view(torch.uint8).view(2, 6, -1)
        assert bool((raw[1, 3] == 255).all()) and int((raw != 0).sum()) == page_bytes


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_transfer_of_descending_pages_arrives_intact():
    src, dst = _dist.run_ranks(D.descending, world=2, timeout_s=180)
    for i in range(2):  # page runs, then index ops
        for side in (src, dst):
            pages = side["pages"][i]
            assert any(a > b for a, b in zip(pages, pages[1:])), f"pages never ran downwards: {pages}"
        for (k, v), (k0, v0) in zip(dst["kv"][i], src["kv"][i]):
            assert torch.equal(k, k0) and torch.equal(v, v0)

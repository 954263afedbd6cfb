"""DiskCache's own bookkeeping, found wrong by outside-style sweeps: a file a crash left at a
page's name, the hit counts of its scratch requests, and a prompt past max_context_len. Split
from test_tier_disk_cache.py, whose helpers and fixture these use."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tier_disk_cache import TOKENS, P, _files, hit, make_pool, prefill

import kvpool
from kvpool.tiers import DiskCache, FileTier, PageRecord
from kvpool.tiers.backend import encode


@pytest.mark.parametrize("damage", ["empty", "short", "header", "reserved"])
def test_a_file_a_crash_left_at_a_pages_name_does_not_stop_it_being_stored(tmp_path, damage):
    """Writes are not fsynced, so a crash can leave a record's file empty or short. store_new
    took any regular file at the name for the page's record and never wrote it while the pool
    cached it: the pages below it were stored unreachable, and a later prefetch stopped there."""
    import struct

    src = make_pool(hash_seed=11)
    want = prefill(src, TOKENS, seed=1)
    tier = FileTier(tmp_path, 1 << 20)
    files, _ = _files(tier, TOKENS)
    files[1].parent.mkdir(parents=True, exist_ok=True)
    if damage == "empty":
        files[1].write_bytes(b"")
    else:
        blob = bytearray(encode(PageRecord(0, 0, 0, np.zeros(P, np.int32), bytes(16), bytes(64))))
        if damage == "short":
            blob = blob[:100]
        elif damage == "header":
            blob[:8] = b"NOTAPAGE"
        else:  # a field this format keeps at 0 (a later format would change the version)
            struct.pack_into("<I", blob, 8 + 4 + 16 * 3 + 8 + 4, 1)
        files[1].write_bytes(bytes(blob))
    assert not tier.contains(int(files[1].stem, 16))
    assert DiskCache(src, tier, model="m").store_new() == 4
    assert DiskCache(make_pool(), tier, model="m").prefetch(TOKENS) == 4
    dst = make_pool()
    DiskCache(dst, tier, model="m").prefetch(TOKENS)
    n, got = hit(dst, TOKENS)
    assert n == 4 * P and torch.equal(got, want[:, : 4 * P])


def test_the_caches_own_requests_are_not_counted_as_prompts_served(tmp_path):
    """store_new's and prefetch's scratch requests (opened on a chain's cached pages) were
    counted in hit_tokens / miss_tokens, so the pool's hit rate and its exported metrics grew
    with every chain copied: a conversation of five turns reported 800 hit tokens for 320."""
    src = make_pool(num_pages=64)
    dc = DiskCache(src, FileTier(tmp_path / "a", 1 << 22), model="m")
    served = 0
    for turn in range(1, 6):  # one conversation, one page longer each turn
        tokens = np.arange(1000, 1000 + 2 * P * turn + 1, dtype=np.int32)
        h, cached = src.open_with_prefix(tokens, [len(tokens)])
        served += int(cached[0])
        src.extend(h, [len(tokens) - int(cached[0])])
        src.close(h, cache=True)
        assert dc.store_new() > 0
        assert src.stats().hit_tokens == served
    queries = sum(2 * P * t + 1 for t in range(1, 6))
    assert src.stats().hit_tokens + src.stats().miss_tokens == queries
    # A prefetch into a pool that caches the prompt's first page but has no room for more.
    dst = make_pool(num_pages=8)
    prefill(dst, tokens[: P + 1])
    busy = dst.open(1)
    dst.extend(busy, [(int(dst.free_pages) - 1) * P])
    before = dst.stats()
    disk = DiskCache(dst, FileTier(tmp_path / "a", 1 << 22), model="m")
    assert disk.prefetch(tokens) == 0
    after = dst.stats()
    assert (after.hit_tokens, after.miss_tokens, after.free_pages, after.cached_pages) == \
        (before.hit_tokens, before.miss_tokens, before.free_pages, before.cached_pages)


@pytest.mark.parametrize("pool_caches", [0, 1])
def test_a_prompt_past_max_context_len_is_refused_before_anything_is_read(tmp_path, pool_caches):
    """It returned 0 when the pool cached none of it, and raised from its own extend when the
    pool cached its first page (after reading and touching the records)."""
    tier = FileTier(tmp_path, 1 << 20)
    src = make_pool(hash_seed=11)
    prefill(src, TOKENS, seed=1)
    assert DiskCache(src, tier, model="m").store_new() == 4
    dst = make_pool()  # max_context_len 128
    if pool_caches:
        prefill(dst, TOKENS[: P + 1])
    long = np.concatenate([TOKENS, np.arange(200, 200 + 128, dtype=np.int32)])
    dc = DiskCache(dst, tier, model="m")
    before = (dst.cached_pages, dst.open_requests, dst.stats().hit_tokens, tier.hits, tier.misses)
    with pytest.raises(kvpool.ContextTooLongError, match="max_context_len=128"):
        dc.prefetch(long)
    assert (dst.cached_pages, dst.open_requests, dst.stats().hit_tokens, tier.hits, tier.misses) == before
    dst.check()

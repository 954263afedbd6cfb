"""Review of the disk tier (FileTier, DiskCache): path handling, arguments that cannot
work, and eviction that must not leave a chain's unreachable tail behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tier_disk_cache import LAYERS, P, make_pool, prefill

from kvpool.errors import InvalidArgumentError
from kvpool.tiers import DiskCache, FileTier, PageRecord
from kvpool.tiers.backend import record_bytes, shape_fingerprint


def _record(h: int) -> PageRecord:
    return PageRecord(h, 0, 0, np.arange(4, dtype=np.int32), bytes(16), bytes(range(64)))


def test_a_relative_path_keeps_naming_the_same_directory_after_a_chdir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    tier = FileTier("rel", 1 << 20)
    monkeypatch.chdir(tmp_path / "b")  # a server that changes directory after building its tiers
    assert tier.put(_record(7))
    assert tier.get(7) is not None
    assert tier.path.is_absolute()
    assert list((tmp_path / "a" / "rel").glob("*/*.kvp"))
    assert not (tmp_path / "b" / "rel").exists()


def test_an_empty_path_is_refused_not_taken_as_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="path"):
        FileTier("", 1 << 20)
    assert list(tmp_path.iterdir()) == []  # nothing created in the working directory


def test_a_bound_below_one_page_record_is_refused_with_the_size_needed(tmp_path):
    pool = make_pool()
    page = 2 * LAYERS * P * pool.num_kv_heads * pool.head_dim * pool.dtype.itemsize
    need = record_bytes(P, page)
    with pytest.raises(InvalidArgumentError, match=str(need)):
        DiskCache(pool, FileTier(tmp_path, need - 1), model="m")
    DiskCache(pool, FileTier(tmp_path, need), model="m")  # exactly one record fits


@pytest.mark.parametrize("pool", [None, object(), "pool"])
def test_a_pool_that_is_not_a_kvpool_is_refused(tmp_path, pool):
    with pytest.raises(InvalidArgumentError, match="KVPool"):
        DiskCache(pool, FileTier(tmp_path, 1 << 20))


def _hybrid():
    import kvpool

    return kvpool.KVPool(2, 2, 8, layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                         page_size=4, num_pages=32, max_requests=4, max_context_len=64)


def test_a_hybrid_pool_is_refused_before_any_event_is_drained(tmp_path):
    with pytest.raises(InvalidArgumentError, match="KVPool"):
        DiskCache(_hybrid(), FileTier(tmp_path, 1 << 20))


@pytest.mark.parametrize("pool", [None, "hybrid"])
def test_host_storage_and_runner_for_a_pool_that_is_not_a_kvpool_are_typed(pool):
    from kvpool.tiers import HostStorage, TransferRunner

    pool = _hybrid() if pool == "hybrid" else pool
    with pytest.raises(InvalidArgumentError, match="HostStorage.for_pool needs a plain kvpool.KVPool"):
        HostStorage.for_pool(pool, host_pages=4)
    host = HostStorage.for_pool(make_pool(), host_pages=4)
    with pytest.raises(InvalidArgumentError, match="TransferRunner.for_pool needs a plain kvpool.KVPool"):
        TransferRunner.for_pool(pool, host)


@pytest.mark.parametrize("model", [None, 5, b"m", "llama-\ud800"])
def test_a_model_that_is_not_a_str_of_text_is_refused(tmp_path, model):
    # model=None would share the fingerprint of model="None". A lone surrogate was taken, and
    # every store_new then raised UnicodeEncodeError, after draining the pool's events.
    pool = make_pool()
    with pytest.raises(InvalidArgumentError, match="model"):
        DiskCache(pool, FileTier(tmp_path, 1 << 20), model=model)
    with pytest.raises(InvalidArgumentError, match="model"):
        shape_fingerprint(pool, model)


def _chain(start: int) -> np.ndarray:
    return np.arange(start, start + 8 * P + 1, dtype=np.int32)  # 8 full pages a hit can use


def _loadable(tier: FileTier, tokens: np.ndarray) -> int:
    return DiskCache(make_pool(hash_seed=5, num_pages=64), tier, model="m").prefetch(tokens)


def test_eviction_takes_a_chains_tail_first_and_leaves_no_unreachable_records(tmp_path):
    src = make_pool(hash_seed=1, num_pages=64)
    page = 2 * LAYERS * P * src.num_kv_heads * src.head_dim * src.dtype.itemsize
    tier = FileTier(tmp_path, 12 * record_bytes(P, page), scan_interval_s=0.0)
    dc = DiskCache(src, tier, model="m")
    a, b, c = _chain(1000), _chain(5000), _chain(9000)
    prefill(src, a, seed=1)
    assert dc.store_new() == 8
    prefill(src, b, seed=2)
    assert dc.store_new() == 8  # 16 records past a bound of 12: 4 go
    files = lambda: len(list(tmp_path.glob("*/*.kvp")))  # noqa: E731
    assert files() == 12
    # A record whose ancestor is gone can never be hit: the 4 evicted are A's last pages.
    assert (_loadable(tier, a), _loadable(tier, b)) == (4, 8)
    # A prefetch of A makes its pages the most recently used, its first page last of all.
    prefill(src, c, seed=3)
    assert dc.store_new() == 8
    counts = [_loadable(tier, t) for t in (a, b, c)]
    assert sum(counts) == files() and counts[2] == 8, counts


def test_a_directory_removed_while_running_is_made_again_on_the_next_write(tmp_path):
    import shutil

    tier = FileTier(tmp_path / "cache", 1 << 20)
    shutil.rmtree(tmp_path / "cache")  # an operator clearing the cache under a running server
    assert tier.put(_record(9))
    assert tier.get(9) is not None
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


class _FullDisk(FileTier):
    """A FileTier whose writes fail (a full disk) while ``full`` is set."""

    full = True

    def put(self, record: PageRecord) -> bool:
        return False if self.full else super().put(record)


def test_pages_a_full_disk_refused_are_written_by_the_next_store(tmp_path):
    from test_tier_disk_cache import TOKENS, hit

    src = make_pool(hash_seed=1)
    want = prefill(src, TOKENS, seed=4)
    tier = _FullDisk(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    free = src.free_pages
    assert dc.store_new() == 0
    assert dc.stats.write_failures == 4
    assert src.free_pages == free and hit(src, TOKENS)[0] == 16  # the pool as it was
    assert list((tmp_path / ".tmp").iterdir()) == []
    tier.full = False  # space freed: the same pages are written now, without new events
    assert dc.store_new() == 4
    dst = make_pool(hash_seed=2)
    assert DiskCache(dst, tier, model="m").prefetch(TOKENS) == 4
    n, got = hit(dst, TOKENS)
    assert n == 16 and torch.equal(got, want[:, :16])


@pytest.mark.parametrize("room", [3, 5])
def test_a_chain_extended_on_disk_keeps_its_start_when_the_tier_is_full(tmp_path, room):
    """A store that extends a chain already on disk evicted that chain's first pages (written
    a turn before, so older than the pages written now) and kept the new deeper ones, whose
    parent was then gone: records that could never be hit, holding the room. With room for
    three records, a four-page chain now keeps pages 0-2 (the one past the tier's room is not
    written); with room for five, a chain stored after its first turn goes first."""
    src = make_pool(hash_seed=1, num_pages=64)
    page = 2 * LAYERS * P * src.num_kv_heads * src.head_dim * src.dtype.itemsize
    tier = FileTier(tmp_path, room * record_bytes(P, page), scan_interval_s=0.0)
    dc = DiskCache(src, tier, model="m")
    other = np.arange(5000, 5000 + 2 * P + 1, dtype=np.int32)
    chain = np.arange(1000, 1000 + 4 * P + 1, dtype=np.int32)
    prefill(src, chain[: 2 * P + 1], seed=1)
    assert dc.store_new() == 2  # pages 0 and 1
    if room == 5:  # newer than the chain's first turn
        prefill(src, other, seed=3)
        assert dc.store_new() == 2
    prefill(src, chain, seed=2)
    assert dc.store_new() == (1 if room == 3 else 2)  # pages 2 (and 3)
    files = len(list(tmp_path.glob("*/*.kvp")))
    assert files == room
    assert _loadable(tier, chain) == min(4, room)  # every record left is reachable
    if room == 5:
        assert _loadable(tier, other) == 1, "the older chain lost its tail first"

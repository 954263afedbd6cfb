"""FileTier driven as an engine that keeps KV across restarts drives it, with files and
arguments it did not make: it counts and evicts only the files it names as records, and
refuses a scan interval past float's range with its typed error."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvpool
from kvpool.tiers import FileTier, PageRecord
from kvpool.tiers.backend import record_bytes

FP = bytes(range(16))


def rec(i: int, payload_bytes: int = 200) -> PageRecord:
    return PageRecord(page_hash=(i << 72) | 0x5A, parent_hash=0, salt=0, tokens=np.arange(4, dtype=np.int32),
                      fingerprint=FP, payload=bytes([i % 256]) * payload_bytes)


def test_files_the_tier_did_not_name_are_neither_counted_nor_evicted(tmp_path):
    """A user's "backup/x.kvp", a "notes.kvp" in a two-hex directory, an upper-case or
    misplaced record name: not where file_for puts a record. They were counted against the
    bound and deleted as the least recently used "records" at the next write."""
    foreign = [tmp_path / "backup" / "mine.kvp", tmp_path / "ab" / "notes.kvp",
               tmp_path / "AB" / ("AB" + "0" * 30 + ".kvp"), tmp_path / "cd" / ("ef" + "0" * 30 + ".kvp")]
    for f in foreign:
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 5000)
        os.utime(f, (1, 1))  # older than any record: the first to go, were they counted
    size = record_bytes(4, 200)
    tier = FileTier(tmp_path, 3 * size, scan_interval_s=0)
    assert tier.used_bytes == 0
    for i in range(5):  # past the bound: the tier's own oldest records go
        assert tier.put(rec(i))
    assert all(f.read_bytes() == b"x" * 5000 for f in foreign)
    mine = sorted(tmp_path.glob("[0-9a-f][0-9a-f]/*.kvp"))
    assert [f for f in mine if f not in foreign] and tier.evicted == 2
    assert tier.used_bytes == 3 * size
    assert tier.get(rec(0).page_hash) is None and tier.get(rec(4).page_hash).payload == rec(4).payload


@pytest.mark.parametrize("bad", [10 ** 400, -(10 ** 400)], ids=["10**400", "-10**400"])
def test_a_scan_interval_past_float_range_is_a_typed_refusal(tmp_path, bad):
    """10**400 passed the range test (an int compares with inf exactly) and then float() raised
    an untyped OverflowError; nothing is created on a refusal."""
    where = tmp_path / "tier"
    with pytest.raises(kvpool.InvalidArgumentError, match="scan_interval_s"):
        FileTier(where, 1 << 20, scan_interval_s=bad)
    assert not where.exists()


def test_a_refused_path_leaves_no_directories_behind(tmp_path):
    """A last component too long for the file system failed after mkdir(parents=True) had made
    its parents: the refusal left new1/new2 on disk. The directories it made are removed."""
    with pytest.raises(kvpool.InvalidArgumentError, match="cannot be used as a directory"):
        FileTier(tmp_path / "new1" / "new2" / ("x" * 300), 1 << 20)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # one that was there before stays
    with pytest.raises(kvpool.InvalidArgumentError, match="cannot be used as a directory"):
        FileTier(tmp_path / "kept" / "new" / ("x" * 300), 1 << 20)
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("bad", ["abc", b"\x01", {1, 2}, {1: 2}], ids=["str", "bytes", "set", "dict"])
def test_touch_takes_an_ordered_list_of_hashes(tmp_path, bad):
    """A str was refused naming its first character as the bad page hash ('a'), and a set or a
    dict was taken in its arbitrary order (touch's order is the use order): each is refused as
    what it is, and no record's time changes."""
    tier = FileTier(tmp_path, 1 << 20)
    assert tier.put(rec(1))
    before = tier.file_for(rec(1).page_hash).stat().st_mtime_ns
    with pytest.raises(kvpool.InvalidArgumentError, match=f"page_hashes must be a list.*got {type(bad).__name__}"):
        tier.touch(bad)
    assert tier.file_for(rec(1).page_hash).stat().st_mtime_ns == before
    tier.touch([rec(1).page_hash])  # a list still does
    assert tier.file_for(rec(1).page_hash).stat().st_mtime_ns > before


def _filled_pool(tokens):
    import torch

    pool = kvpool.KVPool(2, 2, 8, dtype=torch.float16, page_size=4, num_pages=32, max_requests=4, max_context_len=64)
    h, _ = pool.open_with_prefix(tokens, [len(tokens)])
    slots = pool.extend(h, [len(tokens)]).slots
    for layer in range(2):
        pool.write(layer, slots, torch.ones(len(slots), 2, 8, dtype=torch.float16),
                   torch.ones(len(slots), 2, 8, dtype=torch.float16))
    pool.close(h, cache=True)
    return pool


def test_a_second_disk_cache_that_drains_by_itself_is_refused(tmp_path):
    """Two DiskCaches on one pool (a local and a shared tier), each store_new() draining the
    pool's events: the first stored 4 pages and the second 0, each only its share of what the
    pool cached, silently. The second is refused (nothing drained); the same events handed to
    each store their pages on both; once the first is gone the second may drain by itself."""
    from kvpool.tiers import DiskCache

    pool = _filled_pool(np.arange(17, dtype=np.int32))
    a = DiskCache(pool, FileTier(tmp_path / "a", 1 << 20), model="m")
    b = DiskCache(pool, FileTier(tmp_path / "b", 1 << 20), model="m")
    assert a.store_new() == 4
    h, _ = pool.open_with_prefix(np.arange(100, 117, dtype=np.int32), [17])
    pool.extend(h, [17])
    pool.close(h, cache=True)
    with pytest.raises(kvpool.InvalidArgumentError, match="another DiskCache .* drains by itself"):
        b.store_new()
    events = pool.take_events()  # still there: the refusal drained nothing
    assert int((events["kind"] == 0).sum()) == 4
    assert (a.store_new(events), b.store_new(events)) == (4, 4)  # each stores the second prompt's pages
    del a
    import gc

    gc.collect()
    assert b.store_new() == 0  # the only one now

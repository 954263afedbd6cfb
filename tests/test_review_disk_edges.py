"""Review of edge cases of the disk tier: a directory where a record belongs, a
``.tmp/`` on another file system, a record over a reader's own ``max_bytes``, the
rename that puts a record back where there are no hard links, and a FIFO or a link to a
device at a record's name."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from test_tier_disk_cache import P, make_pool, prefill

from kvpool.errors import InvalidArgumentError
from kvpool.tiers import DiskCache, FileTier, PageRecord
from kvpool.tiers import file_tier as ft
from kvpool.tiers.backend import decode, record_bytes


def _record(h: int, payload: int = 64, fill: int = 1) -> PageRecord:
    return PageRecord(h, 0, 0, np.arange(4, dtype=np.int32), bytes(16), bytes([fill]) * payload)


def _tmp_files(tier: FileTier) -> list[str]:
    return sorted(p.name for p in (tier.path / ".tmp").iterdir())


# ----- 0. a file that is not a regular file at a record's name -----------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="os.mkfifo is POSIX only")
def test_a_fifo_at_a_records_name_is_a_miss_not_a_hang(tmp_path):
    """Was: open() of the FIFO waited for a writer forever (DiskCache.prefetch then held
    its lock and every other store and prefetch waited too)."""
    tier = FileTier(tmp_path, 1 << 20)
    f = tier.file_for(9)
    f.parent.mkdir(parents=True)
    os.mkfifo(f)
    assert tier.get(9) is None and tier.misses == 1
    assert f.exists()  # foreign: left where it is


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_link_to_an_endless_device_at_a_records_name_is_a_miss(tmp_path):
    """Was: the link's size (0) passed the bound test and read() never ended."""
    tier = FileTier(tmp_path, 1 << 20)
    f = tier.file_for(10)
    f.parent.mkdir(parents=True)
    os.symlink("/dev/zero", f)
    assert tier.get(10) is None and tier.misses == 1


# ----- 1. a directory at a record's name ------------------------------------------


def test_an_empty_directory_at_a_records_name_is_removed_by_the_store(tmp_path):
    tier = FileTier(tmp_path, 1 << 20)
    f = tier.file_for(7)
    f.mkdir(parents=True)  # left by another tool or a crash
    assert not tier.contains(7)  # not a record: the store must try
    assert tier.get(7) is None
    assert tier.put(_record(7))
    assert f.is_file() and tier.get(7) is not None and tier.contains(7)
    assert _tmp_files(tier) == []


def test_a_full_directory_at_a_records_name_is_reported_once_and_kept(tmp_path):
    tier = FileTier(tmp_path, 1 << 20)
    f = tier.file_for(7)
    f.mkdir(parents=True)
    (f / "someone_elses.txt").write_text("keep me")
    assert not tier.contains(7)
    with pytest.warns(RuntimeWarning, match="is a directory") as got:
        assert not tier.put(_record(7))
        assert not tier.put(_record(7))  # refused again, but reported only once
    assert len(got) == 1 and str(f) in str(got[0].message)
    assert (f / "someone_elses.txt").read_text() == "keep me"  # never deleted
    assert tier.stored == 0 and _tmp_files(tier) == []


def test_a_file_at_a_records_directory_name_is_reported_once_and_kept(tmp_path):
    """Was: every record filed under the two-hex directory was refused for good, counted
    as a failed write, with no word of why (mkdir raised FileExistsError)."""
    tier = FileTier(tmp_path, 1 << 20)
    sub = tier.file_for(7).parent
    sub.write_text("someone else's file")
    with pytest.warns(RuntimeWarning, match="is a file, not the directory") as got:
        assert not tier.put(_record(7))
        assert not tier.put(_record(7))  # refused again, but reported only once
    assert len(got) == 1 and str(sub) in str(got[0].message)
    assert sub.read_text() == "someone else's file" and tier.stored == 0 and _tmp_files(tier) == []
    sub.unlink()  # moved away: the next put stores
    assert tier.put(_record(7)) and tier.get(7) is not None


def test_eviction_leaves_a_full_directory_at_a_records_name_where_it_is(tmp_path):
    """Was: the oldest "record" by mtime was the directory, and eviction renamed it (and what
    it held) into .tmp, counted it as evicted and took its size off the tier's bytes."""
    tier = FileTier(tmp_path, 6000, scan_interval_s=0)
    f = tier.file_for(5)
    f.mkdir(parents=True)
    (f / "precious.txt").write_text("x")
    os.utime(f, (1, 1))  # older than every record
    for h in range(10, 20):
        tier.put(_record(h, payload=1000))
    assert (f / "precious.txt").read_text() == "x"
    assert tier.evicted > 0 and tier.used_bytes <= 6000


def test_disk_cache_stores_a_page_whose_name_was_blocked_by_an_empty_directory(tmp_path):
    tokens = np.arange(100, 100 + 2 * P + 1, dtype=np.int32)
    src = make_pool(hash_seed=1, num_pages=16)
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    prefill(src, tokens, seed=1)
    assert dc.store_new() == 2
    first = sorted(tmp_path.glob("*/*.kvp"))[0]
    first.unlink()
    first.mkdir()  # the page's record is gone and a directory took its name
    dc._pending.update(dict.fromkeys(dc._entries))  # the page again to store (as after a restart)
    dc.store_new()
    assert first.is_file()  # stored, not skipped as present
    assert DiskCache(make_pool(hash_seed=9, num_pages=16), tier, model="m").prefetch(tokens) == 2


# ----- 2. a .tmp/ on another file system ------------------------------------------


def _exdev(*_a, **_k):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def test_a_write_that_cannot_be_renamed_into_place_leaves_no_temp_file(tmp_path, monkeypatch):
    tier = FileTier(tmp_path, 1 << 20)
    monkeypatch.setattr(ft.os, "replace", _exdev)
    assert not tier.put(_record(3))
    monkeypatch.undo()
    assert _tmp_files(tier) == [] and not tier.contains(3) and tier.stored == 0


def test_a_tmp_dir_on_another_file_system_is_refused_when_the_tier_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(ft.os, "rename", _exdev)
    with pytest.raises(InvalidArgumentError, match="another file system") as e:
        FileTier(tmp_path, 1 << 20)
    assert ".tmp" in str(e.value)
    monkeypatch.undo()
    assert _tmp_files(FileTier(tmp_path, 1 << 20)) == []  # the probe left nothing behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp"]


def test_a_read_only_directory_still_builds_a_tier(tmp_path, monkeypatch):
    """The construction probe refuses only EXDEV: a reader without write access keeps working."""
    writer = FileTier(tmp_path, 1 << 20)
    assert writer.put(_record(5))

    def denied(*_a, **_k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ft.os, "rename", denied)
    assert FileTier(tmp_path, 1 << 20).get(5) is not None


# ----- 3. a record over this process's max_bytes ----------------------------------


def test_a_reader_with_a_smaller_budget_skips_a_large_record_and_keeps_it(tmp_path):
    big = FileTier(tmp_path, 1 << 20)
    large = _record(11, payload=4096)
    assert big.put(large)
    small = FileTier(tmp_path, record_bytes(4, 1024))  # built over the bound: counts, evicts nothing
    assert small.get(11) is None and small.misses == 1 and small.rejected == 0
    assert big.file_for(11).is_file()
    got = big.get(11)
    assert got is not None and got.payload == large.payload


def test_building_a_tier_with_a_smaller_budget_deletes_nothing(tmp_path):
    big = FileTier(tmp_path, 1 << 20)
    for h in range(1, 6):
        assert big.put(_record(h, payload=512))
    small = FileTier(tmp_path, record_bytes(4, 512) + 1)
    assert all(big.contains(h) for h in range(1, 6)) and small.evicted == 0
    assert small.used_bytes == 5 * record_bytes(4, 512)
    # Its own write is what makes it apply its bound (documented: the directory's bound
    # is the smallest max_bytes of the processes writing to it).
    assert small.put(_record(6, payload=512))
    assert small.evicted == 5 and small.contains(6)


# ----- 4. no hard links: the put-back rename ---------------------------------------


def _no_link(*_a, **_k):
    raise OSError(errno.EPERM, "Operation not permitted")  # as on a file system without hard links


def test_without_hard_links_a_put_back_never_replaces_a_record_written_meanwhile(tmp_path, monkeypatch):
    tier = FileTier(tmp_path, 1 << 20)
    other = FileTier(tmp_path, 1 << 20)
    old, new = _record(21, fill=1), _record(21, fill=2)
    assert tier.put(old)
    monkeypatch.setattr(ft.os, "link", _no_link)
    f = tier.file_for(21)

    def judged_newer_then_rewritten(q):
        assert other.put(new)  # another writer takes the name while the file is away
        return False  # the file renamed away is not the one judged: it goes back

    assert not tier._drop(f, judged_newer_then_rewritten)
    assert decode(f.read_bytes()).payload == new.payload  # the newer record kept the name
    assert _tmp_files(tier) == []


def test_without_hard_links_a_put_back_restores_the_name_when_it_is_free(tmp_path, monkeypatch):
    tier = FileTier(tmp_path, 1 << 20)
    assert tier.put(_record(22, fill=3))
    monkeypatch.setattr(ft.os, "link", _no_link)
    assert not tier._drop(tier.file_for(22), lambda q: False)
    got = tier.get(22)
    assert got is not None and got.payload == bytes([3]) * 64 and _tmp_files(tier) == []


def test_a_record_overwritten_by_one_of_the_same_name_still_reads_as_a_verified_hit(tmp_path, monkeypatch):
    """What the remaining race (documented) can do: one record replaces another of its name.
    Both name the same page; a reader verifies what it gets, so it is a hit or a miss."""
    tokens = np.arange(300, 300 + 2 * P + 1, dtype=np.int32)
    src = make_pool(hash_seed=1, num_pages=16)
    tier = FileTier(tmp_path, 1 << 20)
    dc = DiskCache(src, tier, model="m")
    prefill(src, tokens, seed=1)
    assert dc.store_new() == 2
    a, b = sorted(tmp_path.glob("*/*.kvp"))
    blob_a = a.read_bytes()
    os.replace(b, a)  # another page's record under a's name (a wrong overwrite): rejected
    assert DiskCache(make_pool(hash_seed=2, num_pages=16), tier, model="m").prefetch(tokens) == 0
    a.write_bytes(blob_a)  # the same page's record over its name: a hit
    assert DiskCache(make_pool(hash_seed=3, num_pages=16), tier, model="m").prefetch(tokens) == 1


@pytest.mark.parametrize("where", ["offload_pages", "put"])
def test_pages_a_failed_store_took_stay_pending_for_the_next_call(tmp_path, monkeypatch, where):
    # Taken off the pending list before the write, they were lost on any error but a refused
    # put (a device copy, the staging buffer, the backend): a retry wrote nothing and the
    # disk never got pages the pool still cached.
    import kvpool.tiers.disk_cache as dcm
    pool = make_pool()
    prefill(pool, list(range(3 * P + 1)))
    disk = DiskCache(pool, FileTier(str(tmp_path), 1 << 24))
    target = (dcm, "offload_pages") if where == "offload_pages" else (FileTier, "put")

    def boom(*a, **kw):
        raise RuntimeError("out of memory (injected)")
    with monkeypatch.context() as m:
        m.setattr(*target, boom)
        with pytest.raises(RuntimeError, match="injected"):
            disk.store_new()
    assert disk.store_new() == 3
    assert DiskCache(make_pool(), FileTier(str(tmp_path), 1 << 24)).prefetch(list(range(3 * P + 1))) == 3  # pages

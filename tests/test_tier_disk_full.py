"""A disk that fills before the tier's ``max_bytes`` (a small volume, a quota), a backend
that refuses a chain's first pages, and a symlink at a record's name: none may leave
records nothing can reach, or a page that is never stored again.

An outside check filled a 256 KiB volume under a 10 MiB tier: ``DiskCache`` writes a chain
deepest page first, so the tail landed and the first pages failed; prefetch then loaded
nothing, every later store failed the same pages, and the tier never evicted (its count
was under ``max_bytes``)."""

from __future__ import annotations

import errno
import os

import numpy as np
import torch
from test_tier_disk_cache import hit, make_pool, prefill

from kvpool.tiers import DiskCache, FileTier
from kvpool.tiers.file_tier import FileTier as FileTierClass

PROMPT = np.arange(2000, 2033, dtype=np.int32)  # 33 tokens: 8 full pages a hit can use


def records(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) if ".tmp" not in d for f in fs if f.endswith(".kvp")]


def test_a_disk_full_before_max_bytes_evicts_the_tail_and_keeps_a_reachable_head(tmp_path, monkeypatch):
    src = make_pool()
    want = prefill(src, PROMPT)
    tier = FileTier(tmp_path, 10 << 20)
    disk = DiskCache(src, tier, model="m")
    real = FileTierClass._write_once

    size = {}

    def room():
        used = sum(os.path.getsize(f) for f in records(tmp_path))
        return 5 * size.get("record", 1 << 20) - used

    def small_disk(self, final, blob):  # room for five records, whatever max_bytes says
        size["record"] = len(blob)
        if len(blob) > room():
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(self, final, blob)

    class Stat:  # statvfs of that disk
        f_frsize = 1

        @property
        def f_bavail(self):
            return max(0, room())

    monkeypatch.setattr(FileTierClass, "_write_once", small_disk)
    monkeypatch.setattr(os, "statvfs", lambda path: Stat())
    disk.store_new()
    assert len(records(tmp_path)) == 5  # the disk's room, not max_bytes
    monkeypatch.undo()
    dst = make_pool()
    loaded = DiskCache(dst, FileTier(tmp_path, 10 << 20), model="m").prefetch(PROMPT)
    assert loaded == 5  # the chain's first five pages: the tail went to make room for them
    n, got = hit(dst, PROMPT)
    assert n == 5 * 4 and torch.equal(got, want[:, :n])


def test_records_below_a_refused_page_are_removed_and_stay_pending(tmp_path):
    src = make_pool()
    want = prefill(src, PROMPT)
    tier = FileTier(tmp_path, 10 << 20)
    refuse = {"on": True}
    put = tier.put

    class Refusing:  # the backend refuses the chain's second page while "on"
        def __getattr__(self, name):
            return getattr(tier, name)

        def put(self, rec):
            if refuse["on"] and rec.tokens[0] == PROMPT[4]:
                return False
            return put(rec)

    disk = DiskCache(src, tier, model="m")
    disk.backend = Refusing()
    assert disk.store_new() == 1  # only the first page: pages 3.. would hang below the refused one
    assert len(records(tmp_path)) == 1 and disk.stats.write_failures == 1
    refuse["on"] = False
    assert disk.store_new() == 7  # the refused page and everything below it, retried
    dst = make_pool()
    assert DiskCache(dst, FileTier(tmp_path, 10 << 20), model="m").prefetch(PROMPT) == 8
    n, got = hit(dst, PROMPT)
    assert n == 32 and torch.equal(got, want[:, :n])


def test_a_symlink_at_a_records_name_is_no_record_and_is_replaced(tmp_path):
    src = make_pool()
    prefill(src, PROMPT[:9])  # two full pages
    tier = FileTier(tmp_path, 10 << 20)
    disk = DiskCache(src, tier, model="m")
    disk.store_new()
    names = sorted(records(tmp_path))
    assert len(names) == 2
    other = tmp_path / "elsewhere.bin"
    other.write_bytes(b"not a record")
    for name in names:  # a symlink where each record was (another tool, a restore from a backup)
        os.unlink(name)
        os.symlink(other, name)
    hashes = [int(os.path.basename(n).split(".")[0], 16) for n in names]
    assert not any(tier.contains(h) for h in hashes)  # as get() sees it: no record there
    src.clear_cache()
    want = prefill(src, PROMPT[:9], seed=1)  # registered again: new pages for store_new
    assert disk.store_new() == 2  # stored over the links, not skipped as present
    assert all(os.path.isfile(n) and not os.path.islink(n) for n in names)
    dst = make_pool()
    assert DiskCache(dst, FileTier(tmp_path, 10 << 20), model="m").prefetch(PROMPT[:9]) == 2
    n, got = hit(dst, PROMPT[:9])
    assert n == 8 and torch.equal(got, want[:, :n])

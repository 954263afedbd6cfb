"""Review of the disk tier under concurrent use: a reader that rejects a damaged or wrong
record never deletes the good record another writer stored under that name meanwhile
(interleavings forced deterministically), eviction never deletes a record written after
its scan, ``~`` in a path names the home directory, a fork while another thread holds a
FileTier's lock leaves a child that does not hang, and a record a backend cannot encode
is a typed error with nothing written."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
from test_fork_leaf_locks import _fork_while_held
from test_tier_disk_cache import make_pool, prefill

import kvpool.tiers.file_tier as file_tier
from kvpool.errors import InvalidArgumentError
from kvpool.tiers import DiskCache, FileTier, PageRecord, shape_fingerprint
from kvpool.tiers.backend import decode, encode

JOIN_S = 60.0


def rec(h: int, fill: int = 1) -> PageRecord:
    return PageRecord(h, 0, 0, np.arange(4, dtype=np.int32), bytes(16), bytes([fill]) * 256)


def same(a: PageRecord | None, b: PageRecord) -> bool:
    return a is not None and (a.page_hash, a.parent_hash, a.salt, a.fingerprint, a.payload) == (
        b.page_hash, b.parent_hash, b.salt, b.fingerprint, b.payload) and np.array_equal(a.tokens, b.tokens)


def on_thread(fn) -> None:
    """Runs ``fn`` on another thread (another writer) and waits for it, bounded."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(JOIN_S)
    assert not t.is_alive(), "the other writer did not finish"
    if errors:
        raise errors[0]


# ----- (1) reject-and-delete against a concurrent writer -------------------------------------

def test_rejecting_a_torn_file_keeps_the_record_another_writer_stored_after_the_read(tmp_path, monkeypatch):
    reader, writer = FileTier(tmp_path, 1 << 20), FileTier(tmp_path, 1 << 20)
    good = rec(5)
    writer.put(good)
    f = reader.file_for(good.page_hash)
    f.write_bytes(f.read_bytes()[:-40])  # torn
    calls = []

    def decode_after_a_write(blob):
        if not calls:  # the reader has read the torn bytes; now the writer lands its record
            calls.append(1)
            on_thread(lambda: writer.put(good))
        return decode(blob)

    monkeypatch.setattr(file_tier, "decode", decode_after_a_write)
    assert reader.get(good.page_hash) is None and reader.rejected == 1  # what it read was torn
    monkeypatch.undo()
    assert same(FileTier(tmp_path, 1 << 20).get(good.page_hash), good)  # the writer's record stayed
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_rejecting_a_torn_file_still_deletes_it_when_no_one_wrote_meanwhile(tmp_path):
    tier = FileTier(tmp_path, 1 << 20)
    tier.put(rec(6))
    f = tier.file_for(6)
    f.write_bytes(f.read_bytes()[:-1])
    assert tier.get(6) is None and not f.exists() and list((tmp_path / ".tmp").iterdir()) == []


class RacingTier(FileTier):
    """A FileTier whose first get of ``key`` lets another writer store ``good`` right after
    the read: DiskCache then rejects what it read while the good record is on disk."""

    def arm(self, key: int, good: PageRecord) -> None:
        self.key, self.good, self.fired = key, good, False

    def get(self, page_hash):
        got = super().get(page_hash)
        if page_hash == getattr(self, "key", None) and not self.fired:
            self.fired = True
            on_thread(lambda: FileTier(self.path, self.max_bytes).put(self.good))
        return got


def test_disk_cache_rejecting_a_wrong_record_keeps_the_record_another_writer_stored(tmp_path):
    tokens = list(range(100, 113))  # three full pages
    src = make_pool()
    prefill(src, tokens)
    assert DiskCache(src, FileTier(tmp_path, 1 << 20), model="m").store_new() == 3
    tier = RacingTier(tmp_path, 1 << 20)
    files = sorted(tmp_path.glob("*/*.kvp"))
    first = next(r for r in map(lambda f: decode(f.read_bytes()), files) if r.parent_hash == 0)
    # An intact record under the first page's name, for other tokens (a collision).
    wrong = PageRecord(first.page_hash, 0, first.salt, first.tokens + 1, first.fingerprint, first.payload)
    tier.file_for(first.page_hash).write_bytes(encode(wrong))
    tier.arm(first.page_hash, first)
    disk = DiskCache(make_pool(), tier, model="m")
    assert disk.prefetch(tokens) == 0 and disk.stats.pages_rejected == 1
    assert same(tier.get(first.page_hash), first)  # the other writer's record survived the reject
    assert disk.prefetch(tokens) == 3


def test_disk_cache_still_deletes_a_wrong_record_no_one_replaced(tmp_path):
    tokens = list(range(200, 209))
    src = make_pool()
    prefill(src, tokens)
    tier = FileTier(tmp_path, 1 << 20)
    assert DiskCache(src, tier, model="m").store_new() == 2
    first = next(r for r in (decode(f.read_bytes()) for f in tmp_path.glob("*/*.kvp")) if r.parent_hash == 0)
    wrong = PageRecord(first.page_hash, 0, first.salt + 1, first.tokens, first.fingerprint, first.payload)
    tier.file_for(first.page_hash).write_bytes(encode(wrong))
    disk = DiskCache(make_pool(), tier, model="m")
    assert disk.prefetch(tokens) == 0 and not tier.contains(first.page_hash)


# ----- eviction against a concurrent writer -------------------------------------------------

def test_eviction_keeps_a_record_rewritten_after_its_scan(tmp_path, monkeypatch):
    size = len(encode(rec(1)))
    tier = FileTier(tmp_path, 3 * size, scan_interval_s=3600)
    other = FileTier(tmp_path, 1 << 20)
    for h in (1, 2, 3):
        tier.put(rec(h))
    scan = tier._files

    def scan_then_rewrite_the_oldest():
        files = scan()
        on_thread(lambda: other.put(rec(1, fill=9)))  # rewritten (and so most recent) after the scan
        return files

    monkeypatch.setattr(tier, "_files", scan_then_rewrite_the_oldest)
    tier.put(rec(4))  # over the bound: the scan saw record 1 as the oldest
    monkeypatch.undo()
    assert same(tier.get(1), rec(1, fill=9))  # the rewritten record stayed
    assert not tier.contains(2)  # the next oldest went instead
    assert tier.contains(3) and tier.contains(4) and tier.evicted == 1
    assert list((tmp_path / ".tmp").iterdir()) == []


# ----- (2) ~ in a path ------------------------------------------------------------------------

@pytest.mark.parametrize("as_path", [False, True])
def test_a_tilde_path_names_the_home_directory(tmp_path, monkeypatch, as_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    from pathlib import Path
    tier = FileTier(Path("~/kv") if as_path else "~/kv", 1 << 20)
    assert tier.path == home / "kv"
    assert tier.put(rec(3)) and (home / "kv").is_dir()
    assert list(cwd.iterdir()) == []  # no directory named "~" in the working directory


def test_a_tilde_path_of_an_unknown_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="home directory"):
        FileTier("~kvpool-no-such-user-56/kv", 1 << 20)
    assert list(tmp_path.iterdir()) == []


# ----- (3) fork while another thread holds the tier's lock ---------------------------------

def test_fork_while_another_thread_holds_the_tiers_lock(tmp_path):
    # The holder lets go only once the fork asks for the lock (or has happened): no timing
    # decides whether the fork met the lock held.
    tier = FileTier(tmp_path, 1 << 20)
    tier.put(rec(8))

    def child():
        assert same(tier.get(8), rec(8)) and tier.put(rec(9))
        return "ok"

    _fork_while_held(tier, "_lock", child)


# ----- records a backend cannot encode --------------------------------------------------------

BAD_RECORDS = {
    "negative hash": (dict(page_hash=-1), "page_hash"),
    "hash past 128 bits": (dict(page_hash=1 << 128), "page_hash"),
    "parent a str": (dict(parent_hash="0"), "parent_hash"),
    "salt past int64": (dict(salt=1 << 63), "salt"),
    "fingerprint a str": (dict(fingerprint="0123456789abcdef"), "fingerprint"),
    "float tokens": (dict(tokens=np.arange(4, dtype=np.float32)), "tokens"),
    "token past int32": (dict(tokens=np.array([0, 1, 2, 1 << 40])), "tokens"),
    "2-D tokens": (dict(tokens=np.zeros((2, 2), dtype=np.int32)), "tokens"),
    "payload a list": (dict(payload=[1, 2, 3]), "payload"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS), ids=str)
def test_a_record_that_cannot_be_encoded_is_a_typed_error_and_nothing_is_written(tmp_path, case):
    change, name = BAD_RECORDS[case]
    fields = dict(page_hash=3, parent_hash=0, salt=0, tokens=np.arange(4, dtype=np.int32), fingerprint=bytes(16),
                  payload=bytes(64))
    fields.update(change)
    tier = FileTier(tmp_path, 1 << 20)
    with pytest.raises(InvalidArgumentError, match=name):
        tier.put(PageRecord(**fields))
    assert tier.stored == 0 and list(tmp_path.glob("*/*.kvp")) == [] and list((tmp_path / ".tmp").iterdir()) == []


# ----- arguments, a full disk, pickling -----------------------------------------------------

@pytest.mark.parametrize("bad", [5, None, [1, "a"], [1, -1]], ids=repr)
def test_touch_with_bad_hashes_is_typed_and_stamps_nothing(tmp_path, bad):
    tier = FileTier(tmp_path, 1 << 20)
    tier.put(rec(1))
    f = tier.file_for(1)
    os.utime(f, ns=(10**18, 10**18))
    with pytest.raises(InvalidArgumentError, match="page_hash"):
        tier.touch(bad)
    assert f.stat().st_mtime_ns == 10**18  # all-or-nothing: the good hash before the bad one was not stamped


class _FullDiskFile:
    """A file whose write stores half the bytes, then fails as a full disk does."""

    def __init__(self, path, mode):
        self.fh = open(path, mode)  # noqa: SIM115 - closed in __exit__

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, blob):
        self.fh.write(blob[: len(blob) // 2])
        raise OSError(28, "No space left on device")


def test_a_write_that_fails_midway_leaves_the_old_record_and_no_temporary(tmp_path, monkeypatch):
    tier = FileTier(tmp_path, 1 << 20)
    old = rec(4, fill=1)
    assert tier.put(old)
    used, stored = tier.used_bytes, tier.stored
    monkeypatch.setattr(file_tier, "open", _FullDiskFile, raising=False)
    assert tier.put(rec(4, fill=2)) is False and tier.put(rec(5)) is False
    monkeypatch.undo()
    assert same(tier.get(4), old) and not tier.contains(5)
    assert (tier.used_bytes, tier.stored) == (used, stored)
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_a_file_tier_pickles_as_its_directory_and_bound(tmp_path):
    tier = FileTier(tmp_path, 1 << 20, scan_interval_s=2.5)
    tier.put(rec(7))
    back = pickle.loads(pickle.dumps(tier))
    assert (back.path, back.max_bytes, back.scan_interval_s) == (tier.path, 1 << 20, 2.5)
    assert same(back.get(7), rec(7)) and back.hits == 1 and tier.hits == 0


@pytest.mark.parametrize("model", [None, 3, b"m"], ids=repr)
def test_shape_fingerprint_refuses_a_model_that_is_not_a_str(model):
    # str(None) == "None": it would have shared the fingerprint (and so the pages) of model "None".
    with pytest.raises(InvalidArgumentError, match="model must be a str"):
        shape_fingerprint(make_pool(), model)


def test_shape_fingerprint_refuses_what_is_not_a_pool():
    with pytest.raises(InvalidArgumentError, match="plain kvpool.KVPool"):
        shape_fingerprint(object())

"""FileTier and the page-record format: round trips, every kind of damaged file is a miss
(never an exception), atomic writes, the byte bound with least-recently-used eviction,
and two processes writing one directory at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import kvpool
from kvpool.errors import InvalidArgumentError
from kvpool.tiers import FileTier, PageRecord
from kvpool.tiers.backend import decode, encode, record_bytes

FP = bytes(range(16))


def rec(i: int, payload_bytes: int = 256, parent: int = 0) -> PageRecord:
    rng = np.random.default_rng(i)
    return PageRecord(page_hash=(i << 80) | 0xABC, parent_hash=parent, salt=-i, tokens=np.arange(i, i + 4,
                      dtype=np.int32), fingerprint=FP, payload=rng.integers(0, 256, payload_bytes, np.uint8).tobytes())


def same(a: PageRecord, b: PageRecord) -> bool:
    return (a.page_hash, a.parent_hash, a.salt, a.fingerprint, a.payload) == (
        b.page_hash, b.parent_hash, b.salt, b.fingerprint, b.payload) and np.array_equal(a.tokens, b.tokens)


def test_encode_decode_round_trip():
    r = rec(7, parent=(1 << 127) + 5)
    blob = encode(r)
    assert len(blob) == record_bytes(4, 256)
    assert same(decode(blob), r)


def test_every_flipped_byte_and_every_truncation_is_rejected():
    blob = bytearray(encode(rec(3, payload_bytes=64)))
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        assert decode(bytes(bad)) is None, i
    for n in range(len(blob)):
        assert decode(bytes(blob[:n])) is None, n
    assert decode(bytes(blob) + b"\0") is None
    assert decode(b"") is None and decode(b"garbage" * 40) is None


def test_put_get_contains_remove(tmp_path):
    tier = FileTier(tmp_path, 1 << 20)
    r = rec(1)
    assert tier.get(r.page_hash) is None and not tier.contains(r.page_hash)
    assert tier.put(r) and tier.contains(r.page_hash)
    assert same(tier.get(r.page_hash), r)
    assert tier.file_for(r.page_hash).parent.parent == tmp_path
    tier.remove(r.page_hash)
    tier.remove(r.page_hash)  # absent: no error
    assert tier.get(r.page_hash) is None
    assert (tier.hits, tier.misses, tier.stored) == (1, 2, 1)
    assert list((tmp_path / ".tmp").iterdir()) == []  # nothing left half-written


def damage_cases():
    def truncate(f: Path, _):
        f.write_bytes(f.read_bytes()[:-40])

    def flip_payload(f: Path, _):
        b = bytearray(f.read_bytes())
        b[200] ^= 1
        f.write_bytes(bytes(b))

    def empty(f: Path, _):
        f.write_bytes(b"")

    def directory(f: Path, _):
        f.unlink()
        f.mkdir()

    def other_record(f: Path, tier: FileTier):
        # An intact record, but filed under another hash (a renamed or swapped file).
        f.write_bytes(encode(rec(99)))

    return [truncate, flip_payload, empty, directory, other_record]


@pytest.mark.parametrize("damage", damage_cases(), ids=lambda f: f.__name__)
def test_a_damaged_file_is_a_miss(tmp_path, damage):
    tier = FileTier(tmp_path, 1 << 20)
    r = rec(2)
    tier.put(r)
    f = tier.file_for(r.page_hash)
    damage(f, tier)
    assert tier.get(r.page_hash) is None
    assert tier.rejected + tier.misses == 1
    assert not f.is_file()  # not the record its name promises: deleted, so a put can replace it
    if damage.__name__ != "directory":
        assert tier.put(r) and same(tier.get(r.page_hash), r)


def test_a_directory_at_a_records_name_costs_no_file_descriptor(tmp_path):
    """open() of the descriptor os.open gave for a directory raised without closing it: every
    contains() (each store_new, for a page kept pending behind such a directory) and every
    get() leaked one, until the process ran out of descriptors."""
    import os

    tier = FileTier(tmp_path, 1 << 20)
    f = tier.file_for(rec(3).page_hash)
    f.mkdir(parents=True)
    (f / "someone's data").write_text("kept")
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    for _ in range(50):
        assert not tier.contains(rec(3).page_hash) and tier.get(rec(3).page_hash) is None
    assert fds() == before


def test_swapped_names_are_misses(tmp_path):
    tier = FileTier(tmp_path, 1 << 20)
    a, b = rec(4), rec(5)
    tier.put(a)
    tier.put(b)
    fa, fb = tier.file_for(a.page_hash), tier.file_for(b.page_hash)
    tmp = fa.with_suffix(".x")
    os.replace(fa, tmp)
    os.replace(fb, fa)
    os.replace(tmp, fb)
    assert tier.get(a.page_hash) is None and tier.get(b.page_hash) is None and tier.rejected == 2


def test_bounded_with_least_recently_used_out(tmp_path):
    size = record_bytes(4, 256)
    tier = FileTier(tmp_path, 3 * size + 10, scan_interval_s=3600)
    recs = [rec(i) for i in range(6)]
    for i, r in enumerate(recs[:3]):
        tier.put(r)
        os.utime(tier.file_for(r.page_hash), (1000 + i, 1000 + i))  # distinct ages
    assert tier.get(recs[0].page_hash) is not None  # the oldest is read: now the newest
    tier.put(recs[3])  # over the bound: the least recently used (recs[1]) goes
    assert [tier.contains(r.page_hash) for r in recs[:4]] == [True, False, True, True]
    assert tier.used_bytes <= tier.max_bytes and tier.evicted == 1
    for r in recs[4:]:
        tier.put(r)
    assert sum(tier.contains(r.page_hash) for r in recs) == 3
    assert sum(f.stat().st_size for f in tmp_path.glob("*/*.kvp")) <= tier.max_bytes


def test_a_full_tier_of_many_files_does_not_rescan_at_every_put(tmp_path, monkeypatch):
    """Evicting to fit exactly, a full tier went past its bound at the next put and rescanned
    the whole directory at every put: quadratic in its files (store_new at 1,700 files took
    0.75 s). From 256 files on it evicts a sixteenth of the bound more."""
    size = len(encode(rec(0)))
    tier = FileTier(tmp_path, 320 * size, scan_interval_s=3600.0)
    for i in range(320):
        assert tier.put(rec(i))
    scans = []
    real = FileTier._files
    monkeypatch.setattr(FileTier, "_files", lambda self: scans.append(1) or real(self))
    for i in range(320, 420):
        assert tier.put(rec(i))
    assert len(scans) <= 100 // (320 // 16) + 1, f"{len(scans)} rescans for 100 puts"
    left = len(list(tmp_path.glob("*/*.kvp")))
    assert 320 - 320 // 16 <= left <= 320
    assert all(tier.get(rec(i).page_hash) is not None for i in range(400, 420)), "the newest stay"


def test_a_record_larger_than_the_bound_is_not_stored(tmp_path):
    tier = FileTier(tmp_path, 100)
    assert not tier.put(rec(1)) and not tier.contains(rec(1).page_hash)


def test_existing_files_count_and_stale_temporaries_go(tmp_path):
    size = record_bytes(4, 256)
    first = FileTier(tmp_path, 10 * size)
    for i in range(4):
        first.put(rec(i))
    stale = tmp_path / ".tmp" / "dead.writer"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600,) * 2)
    second = FileTier(tmp_path, 2 * size)  # a later process with a smaller bound
    # Counted, not evicted, when built (a reader must not delete the writers' records)...
    assert second.used_bytes == 4 * size and len(list(tmp_path.glob("*/*.kvp"))) == 4
    assert not stale.exists()
    second.put(rec(5))  # ...its first write applies its bound
    assert second.used_bytes == 2 * size and len(list(tmp_path.glob("*/*.kvp"))) == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_bound(tmp_path, bad):
    with pytest.raises(InvalidArgumentError):
        FileTier(tmp_path, bad)


def test_unusable_path(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(InvalidArgumentError, match="directory"):
        FileTier(f, 1 << 20)


class IntPath:
    def __fspath__(self):
        return 5


@pytest.mark.parametrize("bad, match", [
    (lambda tmp: str(tmp / "a\0b"), "NUL"),  # (the file system raised ValueError: embedded null byte)
    (lambda tmp: tmp / "a\0b", "NUL"),
    (lambda tmp: IntPath(), "as str"),  # (os.fspath raised TypeError)
], ids=["str-nul", "path-nul", "fspath-int"])
def test_paths_no_file_system_can_take_are_typed(tmp_path, bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        FileTier(bad(tmp_path), 1 << 20)


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from kvpool.tiers import FileTier, PageRecord
    path, who, n, bound = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    tier = FileTier(path, bound, scan_interval_s=0.0)
    for i in range(n):
        k = i % 40  # both writers write the same 40 hashes, each with its own payload
        payload = np.full(512, (who * 7 + k) % 251, np.uint8).tobytes()
        tier.put(PageRecord(k + 1, 0, who, np.arange(4, dtype=np.int32), bytes(16), payload))
        got = tier.get(k + 1)  # may be the other writer's record, or evicted: never torn
        assert got is None or len(set(got.payload)) == 1, "a torn record was returned"
""")


def test_two_processes_share_a_directory(tmp_path):
    size = record_bytes(4, 512)
    bound = 25 * size
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(w), "200", str(bound)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    files = list(tmp_path.glob("*/*.kvp"))
    assert sum(f.stat().st_size for f in files) <= bound  # the writers' own scans kept it
    tier = FileTier(tmp_path, bound)
    assert files and all(tier.get(int(f.stem, 16)) is not None for f in files)  # every survivor intact
    assert list((tmp_path / ".tmp").iterdir()) == []

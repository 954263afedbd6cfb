"""``kvpool.packed`` (the one reader of ``extend_packed``'s layout, and the packer of
several int64 parts into one copy) and ``kvpool.staging.pool_to_device`` (the one
host -> device path for such parts), on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.packed import PackedExtend, pack, segment_len, slots_start, unpack
from kvpool.staging import pool_to_device, to_device


@pytest.mark.parametrize("counts", [[3], [1, 2], [0, 4, 1], [2, 2, 2, 1, 7]])
def test_parse_names_what_the_allocator_did(counts):
    a = kvpool.SlotAllocator(64, 2, 8, 64)
    h = a.open(len(counts))
    lengths = [i + 1 for i in range(len(counts))]
    a.extend(h, lengths)
    packed, b, _ = a.extend_packed(h, counts)
    p = PackedExtend.parse(packed, b)
    assert p.rows.tolist() == a.rows(h).tolist()
    assert p.starts.tolist() == lengths
    assert p.counts.tolist() == counts
    assert p.offsets.tolist() == (np.cumsum(counts) - counts).tolist()
    assert len(p.slots) == sum(counts) and slots_start(b) + len(p.slots) == len(packed)
    for hh, st, c, o in zip(h, p.starts, p.counts, p.offsets):
        assert p.slots[o : o + c].tolist() == a.slots(hh)[st : st + c].tolist()
    # views, not copies: a pool's rollback reads them after the device copy was queued
    assert all(np.shares_memory(x, packed) for x in p)


def test_parse_works_on_a_tensor_too():
    a = kvpool.SlotAllocator(64, 1, 8, 64)
    h = a.open(3)
    packed, b, _ = a.extend_packed(h, [2, 1, 3])
    host, dev = PackedExtend.parse(packed, b), PackedExtend.parse(torch.from_numpy(packed), b)
    for x, y in zip(host, dev):
        assert isinstance(y, torch.Tensor) and y.tolist() == x.tolist()


@pytest.mark.parametrize("lengths", [[1], [1, 2], [3, 0, 5], [2, 2, 2, 1, 7], [0]])
def test_pack_aligns_every_part_and_unpack_returns_them(lengths):
    parts = [np.arange(n, dtype=np.int64) + 100 * i for i, n in enumerate(lengths)]
    packed, starts = pack(parts)
    assert len(packed) == sum(segment_len(n) for n in lengths)
    assert all(s % 2 == 0 for s in starts)  # 16-byte boundaries
    out = unpack(torch.from_numpy(packed), starts, lengths)
    assert [o.tolist() for o in out] == [p.tolist() for p in parts]
    assert all(o.data_ptr() % 16 == 0 for o, n in zip(out, lengths) if n)


class _FakePool:
    def __init__(self, device, ring=None):
        self.device, self._to_device = torch.device(device), ring


def test_pool_to_device_is_one_copy_through_the_ring():
    copies = []

    def ring(host):
        copies.append(host.copy())
        return torch.from_numpy(host.copy())

    parts = [np.array([1, 2, 3], np.int64), np.array([4], np.int64), np.array([5, 6], np.int64)]
    out = pool_to_device(_FakePool("cuda", ring), *parts)
    assert len(copies) == 1 and [o.tolist() for o in out] == [[1, 2, 3], [4], [5, 6]]
    assert all(o.data_ptr() % 16 == 0 for o in out)


def test_to_device_is_zero_copy_on_cpu():
    host = np.arange(5, dtype=np.int64)
    t = to_device(host, torch.device("cpu"))
    host[0] = 42
    assert t[0].item() == 42
    out = pool_to_device(_FakePool("cpu"), host)
    assert out[0].tolist() == host.tolist()

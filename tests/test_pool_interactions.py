"""Features meeting: seeded random call sequences that mix prefix caching, fork and
copy-on-write, truncate (into registered and shared pages), the host tier (offloads,
host hits, swap_out / swap_in), retention priorities and pins, eviction under
pressure, KV events, refused calls and injected device failures, on ``KVPool`` (CPU,
both table paths) and on ``SlotAllocator`` driven directly with transfers left queued
across calls. After every call: ``check()``, every open request's K/V read back
against a reference (a function of its salt and tokens up to each position), every
page the KV events name holding that content, and a twin built alike that answers
every later call the same (a refused call changed nothing). See
``pool_interactions`` and ``allocator_interactions`` for the drivers."""

from __future__ import annotations

import pytest
from allocator_interactions import AllocDriver
from interactions_common import Faults
from pool_interactions import Driver

# (page_size, device pages, host pages, host policy)
POOL_CASES = [
    (1, 24, 0, "write_back", "token"),
    (16, 9, 6, "write_back", "paged"),
    (3, 14, 12, "write_back", "token"),
    (16, 8, 10, "write_through", "token"),
    (5, 12, 6, "write_back", "paged"),
    (1, 20, 16, "write_through", "paged"),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"p{c[0]}-n{c[1]}-h{c[2]}-{c[3]}-{c[4]}")
def test_pool_calls_mixed_keep_every_request_s_kv(case):
    page, pages, host, policy, layout = case
    counts = Driver(1000 + page * 31 + host, page, pages, host, policy, layout=layout,
                    max_pinned=2 if host else None).run(200)
    # The mix reached what it is for: hits, refusals, and the tier's moves.
    assert counts.get("op_open_prefix", 0) > 5 and any(k.startswith("refused") for k in counts)


@pytest.mark.parametrize("case", POOL_CASES[1:4], ids=lambda c: f"p{c[0]}-h{c[2]}-{c[3]}")
def test_pool_device_table_path_with_device_failures(case):
    """The table path a CUDA pool takes, with a table write or copy-on-write copy
    failing now and then (rolled back: lengths, prompts and K/V as before)."""
    page, pages, host, policy, layout = case
    faults = Faults()
    try:
        counts = Driver(2000 + page + host, page, pages, host, policy, layout=layout, device_table=True,
                        faults=faults).run(150)
    finally:
        faults.remove()
    assert counts.get("refused injected device failure", 0) > 0


ALLOC_CASES = [(1, 24, 12, "write_back"), (16, 10, 6, "write_back"), (3, 14, 12, "write_through"),
               (5, 12, 6, "write_back"), (2, 10, 0, "write_back"), (4, 9, 3, "write_back")]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", ALLOC_CASES, ids=lambda c: f"p{c[0]}-n{c[1]}-h{c[2]}-{c[3]}")
def test_allocator_with_transfers_left_queued_across_calls(case, seed):
    AllocDriver(seed * 100 + case[0] * 7 + case[2], *case, max_pinned=None if seed else 2).run(500)


def test_the_allocator_driver_catches_a_skipped_copy(monkeypatch):
    """The reference is strict enough: an engine that forgets copy-on-write copies (or
    runs loads before offloads) reads wrong K/V, and the driver says so."""
    def drain_without_copies(self):
        a, b = self.allocs
        off, ld = a.take_offloads(), a.take_loads()
        a.take_copies()
        b.take_offloads(), b.take_loads(), b.take_copies()
        P = self.P
        for hp, dp in zip(*ld):  # loads first: an offload's source may be a load's destination
            self.dev[dp * P:(dp + 1) * P] = self.host[hp]
        for dp, hp in zip(*off):
            self.host[hp] = self.dev[dp * P:(dp + 1) * P]
        for h, positions in self.pending.items():
            slots = a.slots(h)
            for pos in positions:
                self.dev[slots[pos]] = self.reqs[h].codes[pos]
        self.pending.clear()

    monkeypatch.setattr(AllocDriver, "drain", drain_without_copies)
    caught = 0
    for case in ALLOC_CASES[:4]:
        try:
            AllocDriver(7, *case).run(500)
        except AssertionError as e:
            assert "wrong K/V" in str(e) or "events say" in str(e)
            caught += 1
    assert caught >= 2, caught

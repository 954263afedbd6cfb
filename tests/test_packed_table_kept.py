"""A CUDA pool's ``extend`` writes its table rows through the kernel kept for the packed array's
shape, passing the parts' addresses (``req_table.launch_packed_kept``) rather than five views of
the device tensor (~9 µs of host time a step on the Xeon VM).

On the CPU the launcher is faked as in ``test_compiled_launch.py``: the kept launch must hand it
exactly what the generic launch (``launch_write_req_to_token`` of the views) gives it, the same
key, grid and arguments, each pointer argument the address of the view it stands for; and it
must decline, launching nothing, wherever ``CompiledLaunch.launch`` would take Triton's path.
A GPU test runs the real launcher (with the check mode off: it declines the raw addresses)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvpool
from kvpool.kernels import launch as L
from kvpool.packed import PackedExtend, pack, segment_len

R = pytest.importorskip("kvpool.kernels.req_table", reason="the table kernel needs Triton")


class Chain:  # Triton 3.5+'s HookChain
    def __init__(self, calls=()):
        self.calls = list(calls)


class Runtime:
    def __init__(self, hook=None):
        self.launch_enter_hook, self.launch_exit_hook = Chain([hook] if hook else []), Chain()


def _packed(b: int) -> torch.Tensor:
    """An ``extend_packed``-shaped array of ``b`` requests, one to three new slots each."""
    counts = np.arange(b, dtype=np.int64) % 3 + 1
    offsets = np.cumsum(counts) - counts
    arr, starts = pack([np.arange(b, dtype=np.int64), 2 * np.arange(b, dtype=np.int64), counts, offsets,
                        np.arange(100, 100 + int(counts.sum()), dtype=np.int64)])
    assert starts == [i * segment_len(b) for i in range(5)], "the layout extend_packed uses"
    return torch.from_numpy(arr)


@pytest.fixture
def generic(monkeypatch):
    """(launch_write_req_to_token of the views) -> (key, grid, args) it would give the launcher;
    its plan kept, as a first launch keeps it."""
    monkeypatch.setattr(L, "raw_stream", lambda device: 7000 + device)
    monkeypatch.setattr(L, "_CHECK", False)
    monkeypatch.setattr(R._LAUNCH, "_knobs", None)
    monkeypatch.setattr(R._LAUNCH, "raw_pointers", True)
    monkeypatch.setattr(R._LAUNCH, "enabled", True)

    def run(table: torch.Tensor, packed: torch.Tensor, b: int):
        seen = []

        def spy(launch, kernel, plans, key, make_plan, head, n, on_cuda):
            plan = make_plan()
            monkeypatch.setitem(plans, key, plan)
            tail, rows, grid_y, _ = plan
            seen.append((key, (-(-n // rows), grid_y), head + (n,) + tail))

        monkeypatch.setattr(R, "launch_planned", spy)
        p = PackedExtend.parse(packed, b)
        R.launch_write_req_to_token(table, p.rows, p.starts, p.counts, p.slots, p.offsets)
        return seen[0]

    return run


def _keep(monkeypatch, key, log, run=None):
    def launcher(*a):
        log.append(a)
    monkeypatch.setitem(R._LAUNCH._compiled, key, (run or launcher, "fn", "meta", None))


@pytest.mark.parametrize("b", [1, 3, 4, 16, 17])
def test_the_kept_launch_gives_the_launcher_what_the_views_would(generic, monkeypatch, b):
    table = torch.zeros((32, 64), dtype=torch.int32)
    packed = _packed(b)
    key, grid, args = generic(table, packed, b)
    log: list = []
    _keep(monkeypatch, key, log)
    assert R.launch_packed_kept(table, packed, b, segment_len(b))
    (call,) = log
    assert call[:9] == (grid[0], grid[1], 1, 7000 + table.get_device(), "fn", "meta", None, None, None)
    got = call[9:]
    assert len(got) == len(args) and got[0] is table
    for mine, theirs in zip(got[1:6], args[1:6]):  # rows, starts, counts, offsets, slots
        assert isinstance(mine, int) and mine == theirs.data_ptr()
    assert got[6:] == args[6:]  # b, then the plan's strides and constexprs


def test_nothing_is_launched_where_tritons_path_is_needed(generic, monkeypatch):
    b = 3
    table = torch.zeros((32, 64), dtype=torch.int64)
    packed = _packed(b)
    seg = segment_len(b)
    log: list = []
    assert not R.launch_packed_kept(table, packed, b, seg), "no kernel kept yet: the first launch is Triton's"
    key, _, _ = generic(table, packed, b)
    _keep(monkeypatch, key, log)
    monkeypatch.setattr(L, "_CHECK", True)  # the check mode asks Triton, with tensors
    assert not R.launch_packed_kept(table, packed, b, seg)
    monkeypatch.setattr(L, "_CHECK", False)
    monkeypatch.setattr(R._LAUNCH, "_knobs", Runtime(hook=print))  # a profiler reads launch metadata
    assert not R.launch_packed_kept(table, packed, b, seg)
    monkeypatch.setattr(R._LAUNCH, "_knobs", None)
    monkeypatch.setattr(R, "_write_req_to_token_kernel", object())  # the codegen tests' recorder
    assert not R.launch_packed_kept(table, packed, b, seg)
    monkeypatch.undo()
    assert not log


def test_a_launcher_that_refuses_raw_addresses_is_not_asked_again(generic, monkeypatch):
    b = 4
    table = torch.zeros((32, 64), dtype=torch.int32)
    packed = _packed(b)
    key, _, _ = generic(table, packed, b)
    calls = []

    def refuses(*a):
        calls.append(a)
        raise TypeError("Pointer argument must have data_ptr method")

    _keep(monkeypatch, key, [], run=refuses)
    assert not R.launch_packed_kept(table, packed, b, segment_len(b))
    assert not R._LAUNCH.raw_pointers and R._LAUNCH.enabled, "tensors still go through the launcher"
    assert not R.launch_packed_kept(table, packed, b, segment_len(b))
    assert len(calls) == 1


def test_other_packed_arrays_are_declined():
    table = torch.zeros((8, 16), dtype=torch.int64)
    packed = _packed(3)
    assert not R.launch_packed_kept(table, packed.to(torch.int32), 3, segment_len(3))
    assert not R.launch_packed_kept(table, torch.stack([packed, packed], 1)[:, 0], 3, segment_len(3))


def test_a_cpu_table_takes_the_views(monkeypatch):
    """(``write_packed_kept`` is for CUDA tables: on the CPU it declines before any lookup)"""
    from kvpool.kernels import table_ops

    monkeypatch.setattr(R, "launch_packed_kept", lambda *a: pytest.fail("asked on a CPU table"))
    assert not table_ops.write_packed_kept(torch.zeros((8, 16), dtype=torch.int64), _packed(3), 3, segment_len(3))


def test_update_req_to_token_returns_the_slots_part_when_the_kept_launch_wrote_the_rows(monkeypatch):
    from kvpool import tables

    b = 3
    packed = _packed(b).numpy()
    monkeypatch.setattr(tables, "write_packed_kept", lambda table, staged, n, seg: (n, seg) == (b, segment_len(b)))
    host, dev = tables.update_req_to_token(torch.zeros((8, 16), dtype=torch.int64), packed, b)
    assert host.tolist() == dev.tolist() == list(range(100, 106))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_extends_through_the_kept_launch_write_the_rows_the_core_gave(monkeypatch):
    monkeypatch.setattr(L, "_CHECK", False)  # (the GPU session's check mode declines raw addresses)
    kept = []
    real = R._LAUNCH.launch_kept

    def counting(*a):
        ok = real(*a)
        kept.append(ok)
        return ok

    monkeypatch.setattr(R._LAUNCH, "launch_kept", counting)
    for page in (1, 16):
        pool = kvpool.KVPool(1, 1, 8, device="cuda", num_pages=512, page_size=page, max_requests=5,
                             max_context_len=128, kv_events=False)
        hs = pool.open(5)
        for step in range(24):
            live = hs[: 1 + step % 5]  # odd and even batch sizes
            pool.extend(live, np.asarray([1 + (i + step) % 3 for i in range(len(live))]))
        torch.cuda.synchronize()
        table = pool.req_to_token.cpu()
        for h, row in zip(hs, pool.rows(hs)):
            n = pool.length(h)
            assert table[row, :n].tolist() == pool.slots(h).tolist()
    assert any(kept), "no extend took the kept launch"

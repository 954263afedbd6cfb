"""Memory figures and capacity sizing, checked against numbers computed by hand.

``memory_fraction`` sizing is host arithmetic over a free-memory query; the
query is mocked here so both the CPU and the CUDA branch are tested on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvpool
import kvpool.capacity as capacity
from kvpool.capacity import free_device_memory, resolve_num_pages
from kvpool.layout import padded_row_stride

L, H, D = 3, 2, 8
MB = 1 << 20


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_overhead_bytes_is_table_plus_scales_plus_metadata(dtype, mla):
    kw = dict(kv_lora_rank=6, qk_rope_head_dim=2) if mla else {}
    pool = kvpool.KVPool(L, 1 if mla else H, D, dtype=dtype, num_pages=10, page_size=2,
                         max_requests=5, max_context_len=12, **kw)
    # int32 req_to_token with its null row; rows padded to an odd number of
    # 64-byte lines (12 ints -> one line of 16)
    table = (5 + 1) * padded_row_stride(12) * 4
    assert padded_row_stride(12) == 16
    fp8 = dtype == torch.float8_e4m3fn
    scales = 0 if not fp8 else 4 * L * (1 if mla else 2)  # float32 per layer; MLA shares one
    assert pool.overhead_bytes == table + scales + pool.allocator.metadata_bytes
    if fp8:
        assert pool.k_scale.nbytes == 4 * L


def _meminfo(monkeypatch, text):
    import builtins
    import io
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/meminfo":
            if text is None:
                raise FileNotFoundError(path)
            return io.StringIO(text)
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", fake_open)


def test_free_device_memory_cpu_reads_mem_available(monkeypatch):
    # MemAvailable counts the page cache the kernel can reclaim; MemFree does not.
    _meminfo(monkeypatch, "MemTotal:       24683772 kB\nMemFree:         9793952 kB\n"
                          "MemAvailable:   19085064 kB\nCached:          9022300 kB\n")
    monkeypatch.setattr(os, "sysconf", lambda name: pytest.fail("sysconf read though MemAvailable is there"))
    assert free_device_memory(torch.device("cpu")) == 19085064 * 1024


@pytest.mark.parametrize("text", [None, "MemTotal: 100 kB\nMemFree: 50 kB\n", "MemAvailable: lots\n"])
def test_free_device_memory_cpu_falls_back_to_free_pages(monkeypatch, text):
    # No /proc/meminfo (not Linux), an old kernel without MemAvailable, or a line it cannot read.
    _meminfo(monkeypatch, text)
    values = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: values[name])
    assert free_device_memory(torch.device("cpu")) == 1000 * 4096


def test_free_device_memory_cuda_uses_mem_get_info(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: seen.append(dev) or (7 * MB, 80 * MB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: {})
    assert free_device_memory(torch.device("cuda", 0)) == 7 * MB
    assert seen == [torch.device("cuda", 0)]


def test_free_device_memory_cuda_counts_what_torchs_cache_holds_unused(monkeypatch):
    # The driver reports reserved-but-unused blocks as used; the pool's tensors can reuse them.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (7 * MB, 80 * MB))
    stats = {"reserved_bytes.all.current": 30 * MB, "allocated_bytes.all.current": 18 * MB,
             "inactive_split_bytes.all.current": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev: stats)
    assert free_device_memory(torch.device("cuda", 0)) == 19 * MB
    # Free pieces of segments that also hold live tensors cannot be released: not counted.
    stats["inactive_split_bytes.all.current"] = 5 * MB
    assert free_device_memory(torch.device("cuda", 0)) == 14 * MB


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_memory_fraction_sizes_from_the_free_memory_query(monkeypatch, device, fraction):
    monkeypatch.setattr(capacity, "free_device_memory", lambda dev: 64 * MB)
    slot_bytes, page_size, fixed = 2 * L * H * D * 2, 4, 12345
    pages = resolve_num_pages(page_size=page_size, slot_bytes=slot_bytes, fixed_bytes=fixed, num_pages=None,
                              num_slots=None, memory_bytes=None, memory_fraction=fraction,
                              device=torch.device(device))
    assert pages == (int(64 * MB * fraction) - fixed) // (slot_bytes * page_size)


@pytest.mark.parametrize("fraction", [0.125, 0.5])
def test_cpu_pool_honours_memory_fraction(monkeypatch, fraction):
    monkeypatch.setattr(capacity, "_available_host_memory", lambda: 4096 * 4096)
    pool = kvpool.KVPool(L, H, D, dtype=torch.float16, memory_fraction=fraction, page_size=4,
                         max_requests=4, max_context_len=64)
    budget = int(4096 * 4096 * fraction)
    fixed = 5 * padded_row_stride(64) * 4  # the table as allocated, row padding included
    page_bytes = 2 * L * H * D * 2 * 4
    assert pool.num_pages == (budget - fixed) // page_bytes
    assert pool.nbytes + fixed <= budget


def test_memory_bytes_budget_is_exact():
    pool = kvpool.KVPool(L, H, D, dtype=torch.float16, memory_bytes=100_000, page_size=4,
                         max_requests=4, max_context_len=64)
    assert pool.num_pages == (100_000 - 5 * padded_row_stride(64) * 4) // (2 * L * H * D * 2 * 4)


@pytest.mark.parametrize("kw", [dict(), dict(dtype=torch.float8_e4m3fn),
                                dict(dtype=torch.float8_e4m3fn, kv_lora_rank=6, qk_rope_head_dim=2)],
                         ids=["fp16", "fp8", "mla-fp8"])
def test_memory_bytes_covers_the_table_as_allocated(kw):
    # req_to_token's rows are padded (layout.padded_row_stride), so the budget
    # must count the padded table, not max_context_len ints per row.
    heads, dim = (1, 8) if "kv_lora_rank" in kw else (H, D)
    for budget in range(20_000, 200_000, 7_919):
        pool = kvpool.KVPool(2, heads, dim, page_size=4, memory_bytes=budget, max_requests=8,
                             max_context_len=64, **kw)
        scales = {id(s): s.nbytes for s in (pool.k_scale, pool.v_scale) if s is not None}
        used = pool.nbytes + pool.req_to_token.untyped_storage().nbytes() + sum(scales.values())
        assert used <= budget, (budget, used)
        assert budget - used < pool.bytes_per_slot * pool.page_size, (budget, used)  # no whole page left over

"""KVPool with a host tier (CPU here; the Triton interpreter in a child process at the
end): a cached prefix evicted from the device by pressure and hit again from the host
reads back bitwise what was written (write_back and write_through, fp8 and MLA pools,
both table paths), so does every position of a request after swap_out -> swap_in;
the transfers run inside the calls that queue them (nothing is left queued); typed
errors leave the pool bitwise as it was; every grad mode; and a pool without a tier
is the pool it always was."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

import kvpool
from kvpool.kernels import _common

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
H, D, LAYERS, PS = 2, 4, 2, 4
KINDS = ["f16", "fp8", "mla"]


def make(kind="f16", policy="write_back", num_pages=8, host_pages=24, table_path="host", **kw):
    """A small CPU pool (7 usable device pages of 4 tokens) with a host tier.
    ``table_path="device"`` updates req_to_token the way a device pool does."""
    geo = dict(num_kv_heads=H, head_dim=D, dtype=torch.float16)
    if kind == "fp8":
        geo["dtype"] = torch.float8_e4m3fn
    elif kind == "mla":
        geo = dict(num_kv_heads=1, head_dim=6, dtype=torch.bfloat16, kv_lora_rank=4, qk_rope_head_dim=2)
    pool = kvpool.KVPool(LAYERS, geo.pop("num_kv_heads"), geo.pop("head_dim"), page_size=PS, num_pages=num_pages,
                         max_requests=8, max_context_len=64, host_pages=host_pages, host_policy=policy,
                         hash_seed=3, **geo, **kw)
    if table_path == "device":
        pool._table_np = None
    return pool


def kv_for(pool, tokens, layer):
    """K/V rows of a token sequence (each depends on the token, its position and the layer)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    base = ((t % 97) / 8 + torch.arange(len(tokens)) % 5 + layer).view(-1, 1, 1)
    base = base.expand(-1, pool.num_kv_heads, pool.head_dim).to(pool.compute_dtype).clone()
    return base, -base


def write(pool, slots, tokens, start):
    for layer in range(LAYERS):
        k, v = kv_for(pool, tokens, layer)
        if pool.mla:
            pool.write(layer, torch.as_tensor(slots), k[start:])
        else:
            pool.write(layer, torch.as_tensor(slots), k[start:], v[start:])


def raw(pool, slots):
    """Every layer's stored bytes at ``slots`` (fp8 and MLA alike), as one uint8 tensor."""
    idx = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    # (the uint8 view indexed: torch 2.4 has no CPU indexing of fp8)
    return torch.cat([c.view(torch.uint8)[:, idx].contiguous().reshape(-1) for c in pool._storage.caches])


def serve(pool, prompt):
    h, cached = pool.open_with_prefix(prompt, [len(prompt)])
    r = pool.extend(h, len(prompt) - int(cached[0]))
    write(pool, r.slots, prompt, int(cached[0]))
    return int(h[0]), int(cached[0])


def assert_table(pool, h):
    slots = pool.slots(h)
    row = int(pool.rows([h])[0])
    assert pool.req_to_token[row, : len(slots)].tolist() == slots.tolist()


def nothing_queued(pool):
    a = pool.allocator
    assert (a.pending_offloads, a.pending_loads, a.pending_copies) == (0, 0, 0)


def flood(pool, base, n=3):
    """Other requests take, write and release every free device page (evicting cached
    ones): a page whose bytes are not restored by a transfer shows up as wrong K/V."""
    for i in range(n):
        prompt = [base + i * 100 + j for j in range(pool.free_pages * PS - 1)]  # free counts evictable
        if len(prompt) < 2:
            return
        h, _ = serve(pool, prompt)
        pool.close([h])


@pytest.mark.parametrize("table_path", ["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_offload_evict_load_is_bitwise(policy, kind, table_path):
    pool = make(kind, policy, table_path=table_path)
    prompt = list(range(1000, 1013))  # three full pages and a token
    h, _ = serve(pool, prompt)
    wrote = raw(pool, pool.slots(h)[:12])
    pool.close([h], cache=True)
    if policy == "write_through":  # copied when cache() registered them
        assert pool.offload_bytes == 3 * pool.host.page_bytes
    flood(pool, 5000)
    assert pool.host_cached_pages >= 3 and pool.cached_pages == 0, "pressure must evict the prefix"
    nothing_queued(pool)
    loaded = pool.load_bytes
    h2, cached = serve(pool, prompt)
    assert cached == 12 and pool.host_hit_tokens == 12
    assert pool.load_bytes - loaded == 3 * pool.host.page_bytes
    nothing_queued(pool)
    assert torch.equal(raw(pool, pool.slots(h2)[:12]), wrote)
    assert_table(pool, h2)
    pool.check()


@pytest.mark.parametrize("kind", KINDS)
def test_one_call_offloads_then_loads_through_the_same_device_page(kind):
    """A host hit on a full device evicts a cached page (write_back: offloaded) and loads
    into that very page, in one call: the offload must read it before the load writes it,
    or the evicted prefix's host copy holds the other prefix's K/V."""
    pool = make(kind)
    p = list(range(1000, 1013))
    h, _ = serve(pool, p)
    want_p = raw(pool, pool.slots(h)[:12])
    pool.close([h], cache=True)
    flood(pool, 5000)
    assert pool.cached_pages == 0
    q = list(range(9000, 9000 + (pool.free_pages - 1) * PS))  # all device pages but one, registered
    h, _ = serve(pool, q)
    want_q = raw(pool, pool.slots(h)[: len(q) // PS * PS])
    pool.close([h], cache=True)
    assert pool.free_pages == pool.evictable_pages + 1
    offloaded = pool.allocator.offloaded_pages
    h, cached = serve(pool, p)
    assert cached == 12 and pool.allocator.offloaded_pages - offloaded >= 2, "the hit must evict and offload"
    assert torch.equal(raw(pool, pool.slots(h)[:12]), want_p)
    pool.close([h])
    flood(pool, 6000)
    h, cached = serve(pool, q + [1])
    assert cached == len(q) // PS * PS
    assert torch.equal(raw(pool, pool.slots(h)[:cached]), want_q)
    pool.check()


@pytest.mark.parametrize("table_path", ["host", "device"])
def test_a_copy_on_write_into_an_offloaded_page_runs_after_the_offload(table_path):
    """extend's copy-on-write copy takes its new page by evicting a cached one (write_back:
    offloaded) in the same call: the copy must write it only after the offload read it."""
    pool = make(table_path=table_path)
    a, _ = serve(pool, list(range(1000, 1006)))  # a full page and a half-filled one
    kid = int(pool.fork(a, 1)[0])
    q = list(range(9000, 9000 + pool.free_pages * PS))  # every other device page, registered
    h, _ = serve(pool, q)
    want_q = raw(pool, pool.slots(h))
    pool.close([h], cache=True)
    assert pool.free_pages == pool.evictable_pages
    offloaded = pool.allocator.offloaded_pages
    r = pool.extend([kid], 1, tokens=[7])
    assert pool.allocator.offloaded_pages - offloaded == 1 and pool.copied_slots == 2
    write(pool, r.slots, list(range(1000, 1006)) + [7], 6)
    pool.close([a, kid])
    flood(pool, 6000)
    h, cached = serve(pool, q + [1])
    assert cached == len(q)
    assert torch.equal(raw(pool, pool.slots(h)[:cached]), want_q)
    pool.check()


def test_write_through_eviction_moves_nothing_and_write_back_offloads_on_eviction():
    wt, wb = make(policy="write_through"), make(policy="write_back")
    for pool in (wt, wb):
        h, _ = serve(pool, list(range(1000, 1009)))
        pool.close([h], cache=True)
    assert (wt.offload_bytes, wb.offload_bytes) == (2 * wt.host.page_bytes, 0)
    assert wt.evict(2) == wb.evict(2) == 2
    assert (wt.offload_bytes, wb.offload_bytes) == (2 * wt.host.page_bytes, 2 * wb.host.page_bytes)
    assert wt.stats().offloaded_pages == wb.stats().offloaded_pages == 2


def test_a_pinned_prefix_stays_on_the_device_and_an_offloaded_one_comes_back_at_the_default():
    """Priorities choose the device victim, the host tier keeps what is evicted: under
    pressure the pinned prefix is neither evicted nor offloaded, the other one goes to the
    host and is served back bitwise as a new registration with the default priority."""
    pool = make(num_pages=10)
    pinned, other = list(range(1000, 1009)), list(range(2000, 2009))  # two full pages each
    h, _ = serve(pool, pinned)
    pool.close([h], cache=True, priority=100)
    h, _ = serve(pool, other)
    wrote = raw(pool, pool.slots(h)[:8])
    pool.close([h], cache=True, priority=80)
    assert pool.pinned_pages == 2
    flood(pool, 5000)
    assert (pool.cached_pages, pool.pinned_pages, pool.host_cached_pages) == (2, 2, 2)
    nothing_queued(pool)
    h, cached = serve(pool, pinned)
    assert cached == 8 and pool.host_hit_tokens == 0, "the pinned prefix is served from the device"
    pool.close([h])
    h2, cached = serve(pool, other)
    assert cached == 8 and pool.host_hit_tokens == 8
    assert torch.equal(raw(pool, pool.slots(h2)[:8]), wrote)
    pool.close([h2], cache=True)
    by = pool.evictable_pages_by_priority()
    assert (by[80], by[kvpool.DEFAULT_PRIORITY]) == (0, 2)
    pool.check()


@pytest.mark.parametrize("table_path", ["host", "device"])
@pytest.mark.parametrize("kind", KINDS)
def test_swap_out_then_in_is_bitwise_at_every_position(kind, table_path):
    pool = make(kind, table_path=table_path)
    a, _ = serve(pool, list(range(2000, 2010)))  # two full pages and a partial one
    b, _ = serve(pool, list(range(3000, 3006)))
    want_a, want_b = raw(pool, pool.slots(a)), raw(pool, pool.slots(b))
    free = pool.free_pages
    pool.swap_out([a])
    nothing_queued(pool)
    assert pool.is_swapped(a) and not pool.is_swapped(b)
    assert pool.free_pages == free + 3 and pool.offload_bytes == 3 * pool.host.page_bytes
    assert pool.length(a) == 10
    flood(pool, 7000)
    pool.swap_in([a])
    nothing_queued(pool)
    assert not pool.is_swapped(a) and pool.load_bytes == 3 * pool.host.page_bytes
    assert torch.equal(raw(pool, pool.slots(a)), want_a)
    assert torch.equal(raw(pool, pool.slots(b)), want_b)
    assert_table(pool, a)
    # The request carries on: its next token goes after its old ones.
    r = pool.extend([a], 1)
    assert r.slots.tolist() == [pool.slots(a)[10]]
    pool.check()


def test_no_tier_is_the_pool_it_always_was():
    for pool in (kvpool.KVPool(LAYERS, H, D, num_pages=8, page_size=PS),
                 kvpool.KVPool(LAYERS, H, D, num_pages=8, page_size=PS, host_pages=0)):
        assert pool.host is None and pool._transfers is None
        assert (pool.host_pages, pool.offload_bytes, pool.load_bytes) == (0, None, None)
        assert "host_kv" not in [n for n, _ in pool.named_tensors()]
        h = pool.open(1)
        with pytest.raises(kvpool.InvalidArgumentError, match="host tier"):
            pool.swap_out(h)


def test_host_memory_bytes_sizes_the_tier():
    page = kvpool.tiers.host_page_bytes(LAYERS, PS, H, D, torch.float16, mla=False)
    pool = make(host_pages=None, host_memory_bytes=10 * page + page // 2)
    assert pool.host_pages == 10 and pool.host.host_pages == 10 and pool.host.buffer.shape[0] == 10
    assert "host_kv" in [n for n, _ in pool.named_tensors()]


@pytest.mark.parametrize("kw", [
    dict(host_pages=4, host_memory_bytes=1 << 20),
    dict(host_pages=1),
    dict(host_pages=-2),
    dict(host_pages=2.5),
    dict(host_pages=8, host_policy="write_around"),
    dict(host_memory_bytes=1),
], ids=str)
def test_bad_tier_arguments_are_typed(kw):
    with pytest.raises(kvpool.InvalidArgumentError):
        kvpool.KVPool(LAYERS, H, D, num_pages=8, page_size=PS, **kw)


def test_a_host_budget_past_what_a_tier_addresses_names_host_memory_bytes():
    page = kvpool.tiers.host_page_bytes(LAYERS, PS, H, D, torch.float16, mla=False)
    with pytest.raises(kvpool.InvalidArgumentError, match=r"host_memory_bytes=.*at most") as info:
        kvpool.KVPool(LAYERS, H, D, num_pages=8, page_size=PS, host_memory_bytes=2**31 * page)
    assert "host_pages" not in str(info.value)


def snapshot(pool, handles):
    s = pool.stats()
    fields = [f for f in dir(s) if not f.startswith("_") and not callable(getattr(s, f))]
    per = []
    for h in handles:
        if not pool.is_open(h):
            per.append(None)
        elif pool.is_swapped(h):
            per.append(("swapped", pool.length(h), pool.known_tokens(h).tolist()))
        else:
            per.append((pool.slots(h).tolist(), pool.known_tokens(h).tolist()))
    tensors = [bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for _, t in pool.named_tensors()]
    return [getattr(s, f) for f in fields], per, tensors


def test_typed_errors_leave_the_pool_as_it_was():
    pool = make(host_pages=6)
    a, _ = serve(pool, list(range(2000, 2010)))
    b, _ = serve(pool, list(range(3000, 3006)))
    pool.swap_out([a])
    hs = [a, b]
    before = snapshot(pool, hs)
    bad = [
        (lambda: pool.extend([a], 1), kvpool.RequestSwappedOutError),
        (lambda: pool.truncate([a], [2]), kvpool.RequestSwappedOutError),
        (lambda: pool.fork(a, 1), kvpool.RequestSwappedOutError),
        (lambda: pool.cache([a]), kvpool.RequestSwappedOutError),
        (lambda: pool.close([a], cache=True), kvpool.RequestSwappedOutError),
        (lambda: pool.slots(a), kvpool.RequestSwappedOutError),
        (lambda: pool.swap_out([a]), kvpool.RequestSwappedOutError),
        (lambda: pool.swap_in([b]), kvpool.InvalidArgumentError),
        (lambda: pool.swap_in([a, a]), kvpool.InvalidArgumentError),
        (lambda: pool.swap_out([b + 12345]), kvpool.InvalidHandleError),
        (lambda: pool.swap_in("x"), kvpool.KVPoolError),
        # The host holds 5 usable pages, 3 of them a's: b's 2 fit, then nothing more.
    ]
    for call, err in bad:
        with pytest.raises(err):
            call()
        assert snapshot(pool, hs) == before, call
    assert issubclass(kvpool.RequestSwappedOutError, kvpool.KVPoolError)
    # The device full of held pages: swap_in has no room.
    c, _ = serve(pool, list(range(4000, 4000 + pool.free_pages * PS)))
    hs.append(c)
    before = snapshot(pool, hs)
    with pytest.raises(kvpool.PoolExhaustedError):
        pool.swap_in([a])
    assert snapshot(pool, hs) == before
    pool.close([c])
    pool.swap_in([a])
    pool.check()


def test_swap_out_beyond_the_host_is_exhausted_and_changes_nothing():
    pool = make(host_pages=3)  # two usable host pages
    a, _ = serve(pool, list(range(2000, 2010)))  # three pages
    before = snapshot(pool, [a])
    with pytest.raises(kvpool.PoolExhaustedError):
        pool.swap_out([a])
    assert snapshot(pool, [a]) == before


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_grad_modes(mode):
    ctx = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    with ctx():
        pool = make()
        prompt = list(range(1000, 1013))
        h, _ = serve(pool, prompt)
        wrote = raw(pool, pool.slots(h)[:12])
        pool.close([h], cache=True)
        flood(pool, 5000)
        h2, cached = serve(pool, prompt)
        pool.swap_out([h2])
        flood(pool, 6000)
        pool.swap_in([h2])
    assert cached == 12
    assert torch.equal(raw(pool, pool.slots(h2)[:12]), wrote)
    for _, t in pool.named_tensors():
        assert not t.is_inference() and not t.requires_grad


def test_kernel_backend_in_use():
    """Under TRITON_INTERPRET=1 the pool's page transfers run the Triton kernel."""
    assert _common.use_triton(torch.zeros(1)) == (INTERPRETED and _common.INTERPRET)


@pytest.mark.skipif(INTERPRETED, reason="runs the interpreter child itself")
def test_through_the_triton_interpreter(tmp_path):
    """Every test above once more, the page transfers going through the Triton kernel
    under the interpreter (none skipped: a child that fell back fails test_kernel_backend_in_use)."""
    report = tmp_path / "report.xml"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvpool.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
         "-k", "not through_the_triton_interpreter", __file__],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 25 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts
